"""The host-side fast paths change nothing: the scheduler's decode fast path schedules, reserves
and preempts as its general loop does; outputs' token windows read as the lists they stand
for; the block-table mirror equals the cache's tables; the worker's gc settings."""

import gc
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import KVCacheManager
from radixkv.engine.block_tables import BlockTables
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.outputs import OutputTokens
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, Sequence


def _lockstep(lengths, max_tokens, block_size, num_blocks, max_num_seqs, seed, samples=()):
    """Two schedulers over two caches fed the same requests and tokens, one without the decode
    fast path: every step the same schedule, preemptions, copy-on-write copies and block tables.
    samples[i] > 1: request i forks that many samples when its prompt is computed (as the
    engine does: after the commit, before the sampled tokens)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(n)] for n in lengths]
    sides = []
    for fast in (True, False):
        cache = KVCacheManager(num_blocks, block_size)
        sched = Scheduler(cache, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_seqs + 8, max_prefill_chunk=8, defer_shared_prefill=True)
        if not fast:
            sched._schedule_decodes = lambda: None
        seqs = []
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            req = Request(f"r{i}", p, SamplingParams(max_tokens=m), arrival=i)
            seq = Sequence(i, req, 0, list(p), cache)
            seq.pending_forks = (samples[i] if i < len(samples) else 1) - 1
            req.seqs.append(seq)
            sched.add(seq)
            seqs.append(seq)
        sides.append((cache, sched, seqs))
    fast_steps = 0
    while sides[0][1].has_unfinished():
        token = rng.randrange(50)
        outs = []
        for cache, sched, seqs in sides:
            decoding = not sched.waiting and sched.running and all(
                s.num_tokens - s.num_computed_tokens == 1 for s in sched.running)
            out = sched.schedule()
            fast_steps += bool(decoding) and sched is sides[0][1]
            outs.append(([(s.seq_id, n) for s, n in out.scheduled], [s.seq_id for s in out.preempted],
                         sorted(out.freed_seq_ids), cache.take_copy_ops()))
            sampled = []
            for seq, n in out.scheduled:
                start = seq.num_computed_tokens
                cache.mark_tokens_computed(seq.seq_id, seq.token_ids[start : start + n])
                if seq.num_computed_tokens == seq.num_tokens:
                    sampled.append(seq)
                    for _ in range(seq.pending_forks):
                        child = Sequence(1000 + len(seqs), seq.request, len(seq.request.seqs), list(seq.token_ids),
                                         cache)
                        seq.request.seqs.append(child)
                        sched.fork(seq, child)
                        seqs.append(child)
                        sampled.append(child)
            for k, seq in enumerate(sampled):
                seq.token_ids.append((token + k) % 50)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
            cache.check_invariants()
        assert outs[0] == outs[1]
        tables = [[cache.block_table(s.seq_id) if s.seq_id in cache else None for s in seqs]
                  for cache, _, seqs in sides]
        assert tables[0] == tables[1]
    assert sides[0][1].num_preemptions == sides[1][1].num_preemptions
    return fast_steps, sides[0][1].num_preemptions


@settings(max_examples=30, deadline=None)
@given(data=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(1, 3)), min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 4, 8]), extra_blocks=st.integers(0, 12), max_num_seqs=st.integers(3, 6),
       seed=st.integers(0, 3))
def test_decode_fast_path_schedules_as_the_general_loop(data, block_size, extra_blocks, max_num_seqs, seed):
    # the engine's rules: each request fits the pool alone, with every sample at full length
    need = max(-(-n // block_size) + k * -(-m // block_size) + k for n, m, k in data)
    _lockstep([n for n, _, _ in data], [m for _, m, _ in data], block_size, need + extra_blocks, max_num_seqs, seed,
              samples=[k for *_, k in data])


def test_decode_fast_path_runs_and_preempts():
    # a pool too small for all: the fast path meets a block it cannot reserve and preempts
    fast_steps, preemptions = _lockstep([9] * 6, [24] * 6, block_size=4, num_blocks=30, max_num_seqs=6, seed=1)
    assert fast_steps > 20 and preemptions > 0


def test_decode_fast_path_after_forks():
    # samples fork from a partial block: the parent reserves (and copies) first, as in the general loop
    fast_steps, _ = _lockstep([6, 10], [20, 20], block_size=4, num_blocks=40, max_num_seqs=6, seed=2, samples=[3, 2])
    assert fast_steps > 10


def _engine_outputs(model_dir, fast: bool, **kw):
    e = Engine(EngineConfig(model_dir=str(model_dir), device="cpu", block_size=4, max_num_seqs=8,
                            max_num_batched_tokens=32, **kw))
    if not fast:
        e.scheduler._schedule_decodes = lambda: None
    rng = random.Random(0)
    system = [rng.randrange(3, 2048) for _ in range(9)]
    for i in range(6):
        params = SamplingParams(n=1 + i % 3, seed=i, temperature=1.0 if i % 2 else 0.0, max_tokens=12 + i,
                                ignore_eos=True)
        e.add_request(f"r{i}", system + [rng.randrange(3, 2048) for _ in range(i)], params)
    done, streamed = {}, {}
    while e.has_unfinished_requests():
        for out in e.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.new_token_ids)
                assert list(c.token_ids) == streamed[(out.request_id, c.index)]
            if out.finished:
                done[out.request_id] = [(c.index, list(c.token_ids), c.finish_reason) for c in out.outputs]
    e.cache.check_invariants()
    return done, e.scheduler.num_preemptions, e.cache.copy_on_write_blocks


@pytest.mark.parametrize("num_blocks", [200, 16])
def test_engine_fast_path_same_tokens(tiny_llama_dir, num_blocks):
    # samples share partial blocks (copy-on-write after each fork); 16 blocks: preemptions too
    fast = _engine_outputs(tiny_llama_dir, True, num_blocks=num_blocks)
    slow = _engine_outputs(tiny_llama_dir, False, num_blocks=num_blocks)
    assert fast == slow
    assert fast[2] > 0 and (num_blocks > 100 or fast[1] > 0)


def test_output_tokens_window():
    toks = [1, 2, 3, 4, 5]
    w = OutputTokens(toks, 2, 4)
    toks.append(6)  # what later steps append lies past the window
    assert len(w) == 2 and list(w) == [3, 4] and w == [3, 4] and [3, 4] == w and w == (3, 4) and w != [3]
    assert w[0] == 3 and w[-1] == 4 and w[-2:] == [3, 4] and w[5:] == [] and tuple(w) == (3, 4) and 4 in w
    with pytest.raises(IndexError):
        w[2]
    with pytest.raises(IndexError):
        w[-3]
    assert pickle.loads(pickle.dumps(w)) == [3, 4] and repr(w) == "[3, 4]"
    assert not OutputTokens(toks, 3, 3) and w.tolist() == [3, 4]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 4)), max_size=6),
                min_size=1, max_size=8))
def test_block_table_mirror_equals_the_tables(steps):
    """Random growth, copy-on-write of the block being written, release: the rows read back as
    the tables they mirror."""
    B, width = 4, 12
    t = BlockTables(max_rows=6, max_blocks=width, block_size=B)
    tables, computed, next_block = {}, {}, [100]
    for step in steps:
        entries = []
        for seq_id, grow, action in {s: (s, g, a) for s, g, a in step}.values():
            table = tables.setdefault(seq_id, [])
            if action == 4 and seq_id in computed:  # freed
                del tables[seq_id], computed[seq_id]
                t.release(seq_id)
                continue
            for _ in range(min(grow, width - len(table))):
                table.append(next_block[0])
                next_block[0] += 1
            done = computed.get(seq_id, 0)
            if action == 1 and done // B < len(table):  # copy-on-write of the block being written
                table[done // B] = next_block[0]
                next_block[0] += 1
            entries.append((seq_id, list(table), done))
            computed[seq_id] = min(len(table) * B, done + action * 3)
        rows = t.sync(entries)
        for (seq_id, table, _), row in zip(entries, rows):
            assert t.table[row, : len(table)].tolist() == table and t.lens[row] == len(table)


def test_settle_gc_freezes_and_raises_the_young_threshold():
    from radixkv.engine.worker import settle_gc

    before = gc.get_threshold()
    try:
        settle_gc(512)
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (50 * 512, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
