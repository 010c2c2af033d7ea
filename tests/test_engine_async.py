"""The overlapped loop (async_scheduling) against the synchronous one on the same engine config:
the same tokens and finish reasons, with the one-step lag never visible in outputs or the cache."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import PENDING_TOKEN, Engine
from radixkv.engine.sampling_params import SamplingParams

SMALL_POOL = dict(num_blocks=24, max_num_batched_tokens=64, max_prefill_chunk=16, max_num_seqs=16)
BIG_POOL = dict(num_blocks=256)


def _engine(model_dir, overlapped: bool, **kw) -> Engine:
    return Engine(EngineConfig(model_dir=str(model_dir), device="cpu", async_scheduling=overlapped, **kw))


def _drive(e: Engine, reqs, abort_at: dict | None = None) -> dict:
    """Run to the end; abort_at: request id -> step before which it is aborted. Checks on every
    step that no output carries a pending token and that the cache holds together."""
    for rid, prompt, sp in reqs:
        e.add_request(rid, prompt, sp)
    finished, step = {}, 0
    while e.has_unfinished_requests():
        for rid, at in (abort_at or {}).items():
            if at == step:
                e.abort_request(rid)
        for out in e.step():
            for c in out.outputs:
                assert PENDING_TOKEN not in c.new_token_ids and PENDING_TOKEN not in c.token_ids
            if out.finished:
                finished[out.request_id] = [(list(c.token_ids), c.finish_reason) for c in out.outputs]
        e.cache.check_invariants()
        step += 1
        assert step < 2000
    assert e.cache.stats().in_use_blocks == 0 and not e.scheduler.running
    return finished


def _workload(seed: int, n: int = 12):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(40)]
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.8, seed=seed + 1, max_tokens=15, n=2),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, min_tokens=4),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=seed + 2, max_tokens=18, stop_token_ids=[7, 9]),
        SamplingParams(use_beam_search=True, beam_width=2, max_tokens=8),  # runs synchronously
        SamplingParams(temperature=0.7, seed=seed + 3, repetition_penalty=1.3, max_tokens=10),  # likewise
    ]
    return [(f"r{i}", shared + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 30))], kinds[i % len(kinds)])
            for i in range(n)]


@pytest.mark.parametrize("pool", [BIG_POOL, SMALL_POOL], ids=["big-pool", "small-pool-preempting"])
def test_overlapped_loop_gives_the_synchronous_tokens(tiny_llama_dir, pool):
    reqs = _workload(0)
    sync = _drive(_engine(tiny_llama_dir, False, **pool), reqs)
    e = _engine(tiny_llama_dir, True, **pool)
    assert _drive(e, reqs) == sync


def test_the_small_pool_really_preempts_in_the_overlapped_loop(tiny_llama_dir):
    e = _engine(tiny_llama_dir, True, **SMALL_POOL)
    _drive(e, _workload(0))
    assert e.metrics().preemptions > 0


def test_overlapped_steps_launch_before_the_last_tokens_are_known(tiny_llama_dir):
    """Greedy decoding only: every step after the first is launched with pending tokens fed on
    the device, so the loop really overlaps (no step fell back to the synchronous path)."""
    e = _engine(tiny_llama_dir, True, **BIG_POOL)
    fed = []
    execute = e.runner.execute

    def note(scheduled, block_table, copy_ops, feed=None):
        fed.append(feed is not None and len(feed[1]) > 0)
        return execute(scheduled, block_table, copy_ops, feed)

    e.runner.execute = note
    _drive(e, [(f"g{i}", [5 + i, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
               for i in range(3)])
    assert fed[0] is False and all(fed[1:-1])


def test_a_request_aborted_mid_flight_ends_within_a_step_of_the_synchronous_abort(tiny_llama_dir):
    """Aborted before step 6: its tokens are a prefix of its full answer, as many as the
    synchronous loop gave or one fewer (the last step's token was still on the device)."""
    reqs = [(f"a{i}", [11 + i, 12, 13], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
            for i in range(3)]
    full = _drive(_engine(tiny_llama_dir, False, **BIG_POOL), reqs)["a1"][0][0]
    sync = _drive(_engine(tiny_llama_dir, False, **BIG_POOL), reqs, {"a1": 6})["a1"][0]
    [(tokens, reason)] = _drive(_engine(tiny_llama_dir, True, **BIG_POOL), reqs, {"a1": 6})["a1"]
    assert reason == sync[1] == "abort"
    assert tokens == full[: len(tokens)] and len(tokens) in (len(sync[0]), len(sync[0]) - 1)


def test_an_abort_leaves_the_other_requests_unchanged(tiny_llama_dir):
    reqs = [(f"a{i}", [11 + i, 12, 13], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
            for i in range(3)]
    full = _drive(_engine(tiny_llama_dir, False, **BIG_POOL), reqs)
    overlapped = _drive(_engine(tiny_llama_dir, True, **BIG_POOL), reqs, {"a1": 6})
    assert overlapped["a0"] == full["a0"] and overlapped["a2"] == full["a2"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), num_blocks=st.integers(24, 96), n=st.integers(1, 10),
       aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 12), max_size=3))
def test_random_workloads_with_aborts_keep_the_cache_whole(tiny_llama_dir, seed, num_blocks, n, aborts):
    """Every step's cache invariant holds, no pending token leaks, nothing leaks at the end (_drive)."""
    reqs = _workload(seed, n)
    e = _engine(tiny_llama_dir, True, num_blocks=num_blocks, max_num_batched_tokens=48, max_prefill_chunk=12,
                max_num_seqs=8)
    _drive(e, [r for r in reqs], {f"r{i}": at for i, at in aborts.items() if i < n})


def test_turning_the_overlap_off_mid_run_settles_the_step_in_flight(tiny_llama_dir):
    reqs = [(f"t{i}", [21 + i, 22, 23], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for i in range(2)]
    sync = _drive(_engine(tiny_llama_dir, False, **BIG_POOL), reqs)
    e = _engine(tiny_llama_dir, True, **BIG_POOL)
    for rid, prompt, sp in reqs:
        e.add_request(rid, prompt, sp)
    for _ in range(4):
        e.step()
    e.async_scheduling = False
    assert _drive(e, []) == {rid: sync[rid] for rid in sync}
