"""The engine loop with beam search, sampling and greedy requests mixed under random pool sizes and
budgets, the model's forward swapped for seeded random logits (everything else is the real engine:
scheduler, cache manager, block tables, batch building, beam selection, forks and frees).

Checked after every step: the cache invariants, the beam reservation never exceeds the pool, no
beam is ever preempted, and in the end every request finishes with all blocks released."""

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from radixkv.engine.batch import build_batch
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams

request_st = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.sampled_from(["beam2", "beam3", "beam4", "greedy", "n3"]),
    st.sampled_from([1.0, 0.5, -1.0]),  # length penalty (beams)
    st.sampled_from([False, True, "never"]),  # early stopping (beams)
)


def _params(kind, max_tokens, lp, es):
    if kind.startswith("beam"):
        w = int(kind[-1])
        return SamplingParams(use_beam_search=True, beam_width=w, n=min(2, w), max_tokens=max_tokens,
                              length_penalty=lp, early_stopping=es)
    if kind == "n3":
        return SamplingParams(n=3, seed=1, max_tokens=max_tokens)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=1, max_size=6), num_blocks=st.integers(8, 48),
       block_size=st.sampled_from([2, 4, 8]), max_num_seqs=st.integers(4, 12), extra_budget=st.integers(0, 24),
       chunk=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_random_mixes_finish_and_never_preempt_beams(tiny_llama_dir, reqs, num_blocks, block_size, max_num_seqs,
                                                     extra_budget, chunk, seed):
    e = Engine(EngineConfig(model_dir=str(tiny_llama_dir), device="cpu", block_size=block_size,
                            num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_seqs + extra_budget, max_prefill_chunk=chunk))
    vocab = e.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)

    def random_forward(scheduled, block_table, copy_ops):
        tables = e.runner.block_tables
        batch = build_batch(scheduled, tables, tables.sync_step(scheduled, block_table))
        logits = torch.randn(len(batch.sample_seqs), vocab, generator=gen) * 3
        logits[:, list(e.eos_token_ids)] += 4  # finishing is common, so hypotheses compete
        return batch, logits

    e.runner.execute = random_forward
    accepted = []
    for i, (plen, max_tokens, kind, lp, es) in enumerate(reqs):
        prompt = [(seed + 7 * i + 13 * j) % (vocab - 3) + 3 for j in range(plen)]
        try:
            e.add_request(f"r{i}", prompt, _params(kind, max_tokens, lp, es))
        except ValueError as err:  # too big for this pool: rejected up front, nothing added
            assert any(f in str(err) for f in ("max_tokens", "max_num_seqs", "prompt_token_ids"))
            continue
        accepted.append((f"r{i}", kind, max_tokens, lp))
    finished, steps = {}, 0
    while e.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "no progress"
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out
        e.cache.check_invariants()
        assert e.scheduler.admission.reserved_blocks <= e.num_blocks
        assert not any(s.preempted for s in e.scheduler.waiting if s.request.beam is not None)
    assert set(finished) == {rid for rid, *_ in accepted}
    for rid, kind, max_tokens, lp in accepted:
        out = finished[rid]
        assert out.sharing.blocks_held <= out.sharing.blocks_without_sharing
        if kind.startswith("beam"):  # the n best, best first
            assert len(out.outputs) == min(2, int(kind[-1]))
            assert all(1 <= len(c.token_ids) <= max_tokens for c in out.outputs)
            scores = [c.cumulative_logprob / len(c.token_ids) ** lp for c in out.outputs]
            assert scores == sorted(scores, reverse=True)
    beams = [rid for rid, kind, *_ in accepted if kind.startswith("beam")]
    event(f"beam requests: {'2 or more' if len(beams) >= 2 else len(beams)}")
    event(f"preempted: {e.metrics().preemptions > 0}")
    event(f"a beam stopped early: {any(c.finish_reason == 'stop' for r in beams for c in finished[r].outputs)}")
    assert e.cache.stats().in_use_blocks == 0 and e.scheduler.admission.reserved_blocks == 0
    assert not e.scheduler.running and not e.scheduler.waiting
