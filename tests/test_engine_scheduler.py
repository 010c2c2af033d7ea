"""Scheduler over the real cache manager, no model: budgets, limits, preemption, progress."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import KVCacheManager
from radixkv.engine.batch import build_batch
from radixkv.engine.block_tables import BlockTables
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, Sequence, Status


def _simulate(lengths, max_tokens, block_size, num_blocks, max_num_seqs, budget, chunk, policy="fcfs", seed=0,
              defer=False, shared_len=12):
    """Drive the scheduler like the engine does (commit, sample a token, stop at max_tokens).
    The computed counts are the cache's; the block-table rows follow the freed ids."""
    rng = random.Random(seed)
    cache = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(cache, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_prefill_chunk=chunk, policy=policy, defer_shared_prefill=defer)
    tables = BlockTables(max_num_seqs, num_blocks, block_size)
    shared = [rng.randrange(100) for _ in range(shared_len)]
    seqs = []
    for i, (n, m) in enumerate(zip(lengths, max_tokens)):
        prompt = (shared + [rng.randrange(100) for _ in range(n)])[: max(1, n)]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=m), arrival=i)
        seq = Sequence(i, req, 0, list(prompt), cache)
        req.seqs.append(seq)
        sched.add(seq)
        seqs.append(seq)
    finished_order, steps = [], 0
    sched.computed = 0
    limit = 50 * sum(n + m for n, m in zip(lengths, max_tokens)) + 100
    while sched.has_unfinished():
        steps += 1
        assert steps < limit, "no progress"
        out = sched.schedule()
        assert out.scheduled, "a step with unfinished work scheduled nothing"
        assert out.num_batched_tokens == sum(n for _, n in out.scheduled) <= budget
        assert len(sched.running) <= max_num_seqs
        assert all(n <= chunk for s, n in out.scheduled if s.num_computed_tokens + n < s.num_tokens)
        for seq_id in out.freed_seq_ids:
            tables.release(seq_id)
        batch = build_batch(out.scheduled, tables, tables.sync_step(out.scheduled, cache.block_table))
        for i, (s, _) in enumerate(out.scheduled):  # the mirrored rows equal the cache's tables
            table = cache.block_table(s.seq_id)
            assert batch.block_tables[i, : len(table)].tolist() == table
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            cache.mark_tokens_computed(seq.seq_id, seq.token_ids[start : start + n])
            sched.computed += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(100))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
                    finished_order.append(seq.seq_id)
        cache.check_invariants()
    assert all(s.status is Status.FINISHED for s in seqs)
    assert cache.stats().in_use_blocks == 0
    return sched, finished_order


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    extra_blocks=st.integers(0, 30),
    max_num_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 20),
    chunk=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "lpm"]),
    defer=st.booleans(),
)
def test_every_request_finishes_within_limits(data, block_size, extra_blocks, max_num_seqs, budget_extra, chunk,
                                              policy, defer):
    lengths = [n for n, _ in data]
    max_tokens = [m for _, m in data]
    # the engine's up-front rule: every request fits the pool alone
    need = max(-(-(n + m) // block_size) for n, m in data)
    _simulate(lengths, max_tokens, block_size, need + extra_blocks, max_num_seqs, max_num_seqs + budget_extra,
              chunk, policy, defer=defer)


def test_small_pool_preempts_latest_and_keeps_fcfs():
    sched, order = _simulate([20] * 6, [10] * 6, block_size=4, num_blocks=20, max_num_seqs=6, budget=64, chunk=64)
    assert sched.num_preemptions > 0
    assert order == sorted(order)  # equal work: admission order is finishing order


def test_deferring_shared_prompts_computes_the_prefix_once():
    # 8 prompts of a 64-token shared prefix + 8 own tokens, a budget that admits them all at once
    kw = dict(lengths=[72] * 8, max_tokens=[2] * 8, block_size=4, num_blocks=400, max_num_seqs=8, budget=1024,
              chunk=1024, shared_len=64)
    eager, _ = _simulate(**kw, defer=False)
    deferred, _ = _simulate(**kw, defer=True)
    assert deferred.computed == 64 + 8 * (8 + 1)  # the prefix once, then each own part and decode
    assert eager.computed == 8 * (72 + 1)


def test_chunked_prefill_mixes_with_decodes():
    cache = KVCacheManager(64, 4)
    sched = Scheduler(cache, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_prefill_chunk=5)
    reqs = []
    for i, n in enumerate((3, 17)):
        req = Request(f"r{i}", list(range(1, n + 1)), SamplingParams(), arrival=i)
        req.seqs.append(Sequence(i, req, 0, list(req.prompt_token_ids), cache))
        sched.add(req.seqs[0])
        reqs.append(req)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 3), (1, 5)]
    for s, n in out.scheduled:
        cache.mark_tokens_computed(s.seq_id, s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n])
    reqs[0].seqs[0].token_ids.append(9)
    out = sched.schedule()  # a decode and the next prompt chunk in one step
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 5)]
