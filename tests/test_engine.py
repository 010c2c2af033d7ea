"""Engine behaviour on the tiny Llama (CPU, fp32): samples, stops, aborts, rejections, salts."""

import random

import pytest

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams


def _engine(model_dir, **kw):
    args = dict(device="cpu", block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    args.update(kw)
    return Engine(EngineConfig(model_dir=str(model_dir), **args))


def _run(engine, check_stream=True):
    """Step to the end; returns {request_id: final RequestOutput}; checks the increments add up."""
    streamed, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.new_token_ids)
                if c.new_token_ids:
                    assert c.token_ids[-len(c.new_token_ids):] == c.new_token_ids
            if out.finished:
                final[out.request_id] = out
    for rid, out in final.items():
        for c in out.outputs:
            if check_stream:
                assert streamed[(rid, c.index)] == c.token_ids
    return final


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def test_n_samples_share_the_prompt_and_equal_seeded_singles(tiny_llama_dir):
    prompt = _prompt(10)  # not block aligned: the samples share a partial block -> copy-on-write
    e = _engine(tiny_llama_dir)
    e.add_request("multi", prompt, SamplingParams(n=3, seed=11, max_tokens=8, temperature=1.0))
    out = _run(e)["multi"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    stats = e.cache.stats()
    assert stats.copy_on_write_blocks >= 2  # two of the three holders of the partial block copy it
    assert e.metrics().computed_tokens == len(prompt) + 3 * 7  # prompt once, then 7 decodes per sample
    singles = _engine(tiny_llama_dir)
    for i in range(3):
        singles.add_request(f"s{i}", prompt, SamplingParams(seed=11 + i, max_tokens=8, temperature=1.0))
    got = _run(singles)
    assert [c.token_ids for c in out.outputs] == [got[f"s{i}"].outputs[0].token_ids for i in range(3)]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_best_of_returns_the_n_most_likely(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    e.add_request("b", _prompt(7), SamplingParams(n=2, best_of=4, seed=3, max_tokens=5))
    out = _run(e)["b"]
    assert [c.index for c in out.outputs] == [0, 1]
    everything = _engine(tiny_llama_dir)
    everything.add_request("all", _prompt(7), SamplingParams(n=4, seed=3, max_tokens=5))
    all4 = sorted(_run(everything)["all"].outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in all4[:2]]


def test_stop_token_max_tokens_min_tokens_and_eos(tiny_llama_dir):
    prompt = _prompt(9, seed=4)
    e = _engine(tiny_llama_dir)
    e.add_request("free", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    free_out = _run(e)["free"].outputs[0]
    assert free_out.finish_reason == "length"
    free = free_out.token_ids
    stop = free[4]
    first = free.index(stop)
    e.add_request("stop", prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop]))
    e.add_request("min", prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop],
                                                min_tokens=first + 2))
    got = _run(e)
    assert got["stop"].outputs[0].token_ids == free[: first + 1]
    assert got["stop"].outputs[0].finish_reason == "stop"
    assert stop not in got["min"].outputs[0].token_ids[: first + 2]
    assert len(got["min"].outputs[0].token_ids) >= first + 2


def test_abort_frees_blocks_and_reports(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    e.add_request("a", _prompt(12), SamplingParams(temperature=0.0, max_tokens=30))
    e.add_request("b", _prompt(8, seed=1), SamplingParams(temperature=0.0, max_tokens=6))
    for _ in range(4):
        e.step()
    e.abort_request("a")
    e.abort_request("nope")  # unknown: no-op
    outs = e.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    final = _run(e, check_stream=False)
    assert final["b"].outputs[0].finish_reason in ("length", "stop")
    e.abort_request("a")  # finished: no-op
    assert not e.has_unfinished_requests()
    assert e.cache.stats().in_use_blocks == 0


def test_bad_requests_rejected_while_others_finish(tiny_llama_dir):
    e = _engine(tiny_llama_dir, num_blocks=16, max_num_seqs=4, max_model_len=48)  # context limit 48
    e.add_request("ok1", _prompt(20), SamplingParams(temperature=0.0, max_tokens=8))
    e.step()
    bad = [
        (("ok1", [5, 6], None), "request_id"),
        (("e", [], None), "prompt_token_ids"),
        (("v", [5, 2048], None), "prompt_token_ids"),
        (("neg", [5, -1], None), "prompt_token_ids"),
        (("long", [5] * 48, None), "prompt_token_ids: prompt of 48 tokens"),
        (("mt", [5] * 40, SamplingParams(max_tokens=9)), "max_tokens"),
        (("t", [5], SamplingParams(temperature=-1.0)), "temperature"),
        (("n", [5], SamplingParams(n=5)), "max_num_seqs"),
        (("stop", [5], SamplingParams(stop_token_ids=[4096])), "stop_token_ids"),
        (("p", [5], "greedy"), "params"),
    ]
    for (rid, prompt, params), match in bad:
        with pytest.raises(ValueError, match=match):
            e.add_request(rid, prompt, params if params is not None else SamplingParams())
    with pytest.raises(ValueError, match="cache_salt"):
        e.add_request("salt", [5], SamplingParams(), cache_salt=7)
    e.add_request("ok2", _prompt(30, seed=2), SamplingParams(temperature=0.0, max_tokens=18))
    final = _run(e, check_stream=False)
    assert set(final) == {"ok1", "ok2"}
    assert len(final["ok2"].outputs[0].token_ids) == 18 or final["ok2"].outputs[0].finish_reason == "stop"
    assert e.cache.stats().in_use_blocks == 0


def test_salts_do_not_share_and_lpm_matches_fcfs(tiny_llama_dir):
    shared = _prompt(24, seed=5)
    prompts = [shared + _prompt(k, seed=10 + k) for k in (3, 6, 1, 9)]
    results = {}
    for policy in ("fcfs", "lpm"):
        e = _engine(tiny_llama_dir, scheduling_policy=policy)
        e.add_request("warm", shared + [7], SamplingParams(temperature=0.0, max_tokens=2), cache_salt="t1")
        _run(e)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6), cache_salt="t2" if i else "t1")
        got = _run(e)
        results[policy] = [got[f"r{i}"].outputs[0].token_ids for i in range(4)]
        assert got["r0"].num_cached_tokens == 24  # same salt as the warm-up
        assert got["r1"].num_cached_tokens in (0, 24)  # other salt: only what t2 itself computed
    assert results["fcfs"] == results["lpm"]


def test_engine_config_rejects_bad_values(tiny_llama_dir):
    for kw, match in [
        (dict(block_size=0), "block_size"),
        (dict(device="tpu"), "device"),
        (dict(dtype="int8"), "dtype"),
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(scheduling_policy="random"), "scheduling_policy"),
        (dict(num_blocks=-3), "num_blocks"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model_dir=str(tiny_llama_dir), **kw)


def test_triton_backend_in_interpreter_matches_torch_backend(tiny_llama_dir):
    """The Triton kernels (store_kv, paged_attention, copy_blocks via n > 1) through the engine."""
    prompts = [_prompt(7, seed=8), _prompt(13, seed=9)]
    got = {}
    for backend in ("triton", "torch"):
        e = _engine(tiny_llama_dir, attention_backend=backend, max_prefill_chunk=5)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, SamplingParams(n=2, seed=4, max_tokens=5))
        out = _run(e)
        got[backend] = [[c.token_ids for c in out[f"r{i}"].outputs] for i in range(2)]
        assert e.cache.stats().copy_on_write_blocks > 0
    assert got["triton"] == got["torch"]
