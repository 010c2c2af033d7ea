"""Fault isolation in the engine (tiny Llama, CPU, fp32): an exception while stepping one
request fails that request only ("error" on every choice it had not finished, its blocks
freed), every other request's output equals a fault-free run token for token, and the
engine goes on. Also: inputs at the edges of validation (top_k = 2**63 - 1, extreme length
penalties) run without failing, and device-level errors are told apart."""

import random

import pytest
import torch

import radixkv.engine.engine as engine_module
from radixkv.engine.beam_search import MAX_LOG_LENGTH_POWER, length_power
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.errors import ParamError, is_device_error
from radixkv.engine.llm import LLM
from radixkv.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BAD = "bad"


def _engine(model_dir, **kw):
    # a 24-token budget and 8-token chunks: prompts are admitted over several steps, so prefill
    # chunks and decodes share most steps
    args = dict(device="cpu", block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=24,
                max_prefill_chunk=8)
    args.update(kw)
    return Engine(EngineConfig(model_dir=str(model_dir), **args))


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _beam(**kw):
    return SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=6, **kw)


def _workload(bad_params, bad_at=0):
    """(request id, prompt, params, step to add it at): greedy requests, one with n = 2, one
    seeded sample, and the request a fault is aimed at: by default admitted first, so that it
    decodes while the others' prompts are computed."""
    return [
        (BAD, _prompt(9, 1), bad_params, bad_at),
        ("g0", _prompt(21, 2), _greedy(10), 0),
        ("g1", _prompt(14, 3), _greedy(8), 0),
        ("pair", _prompt(10, 4), SamplingParams(n=2, seed=5, max_tokens=7, ignore_eos=True), 0),
        ("seeded", _prompt(12, 5), SamplingParams(seed=7, temperature=0.8, top_p=0.9, max_tokens=8,
                                                  ignore_eos=True), 0),
        ("late", _prompt(17, 6), _greedy(6), 4),
    ]


def _run(e, workload, max_steps=500):
    """Add the workload's requests at their steps and step to the end; {id: final output}.
    Checks that what streamed adds up to each final output."""
    streamed, final = {}, {}
    for step in range(max_steps):
        for rid, prompt, params, at in workload:
            if at == step:
                e.add_request(rid, prompt, params)
        if step > max((at for *_, at in workload), default=-1) and not e.has_unfinished_requests():
            break
        for out in e.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    else:
        raise AssertionError("the engine did not finish")
    beams = {rid for rid, _, p, _ in workload if p.use_beam_search}
    for rid, out in final.items():
        for c in out.outputs:
            if rid not in beams and out.outputs[0].finish_reason != "error":
                assert streamed[(rid, c.index)] == c.token_ids
    return final


def _tokens(final, rids):
    return {rid: [c.token_ids for c in final[rid].outputs] for rid in rids}


def _assert_settled(e):
    assert e.cache.stats().in_use_blocks == 0
    e.cache.check_invariants()
    assert not e.requests and not e.scheduler.running and not e.scheduler.waiting
    assert e.scheduler.admission.reserved_blocks == 0


def _assert_serves(e):
    """A fresh request afterwards runs to its end."""
    e.add_request("fresh", _prompt(11, 9), _greedy(5))
    out = _run(e, [])["fresh"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    _assert_settled(e)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Fault-free outputs of the workload, per kind of request at fault."""
    cache = {}

    def get(bad_params, bad_at=0):
        key = (repr(bad_params), bad_at)
        if key not in cache:
            cache[key] = _run(_engine(tiny_llama_dir), _workload(bad_params, bad_at))
        return cache[key]

    return get


# ---- faults aimed at one request ----------------------------------------------------------


def _is_mixed(scheduled):
    return any(n > 1 for _, n in scheduled) and any(n == 1 for _, n in scheduled)


def _fault_in_forward(e, after_tokens):
    """The forward raises whenever the request at fault, with `after_tokens` generated, is in it."""
    execute, fired = e.runner.execute, []

    def execute_or_fail(scheduled, block_table, copy_ops):
        mine = [s for s, _ in scheduled if s.request.request_id == BAD]
        if mine and mine[0].num_output_tokens >= after_tokens:
            fired.append(_is_mixed(scheduled) and len(scheduled) > len(mine))
            raise RuntimeError("injected: the forward failed")
        return execute(scheduled, block_table, copy_ops)

    e.runner.execute = execute_or_fail
    return fired


def _fault_in_sampler(e):
    """The sampler raises after drawing (the seeded generators have moved) when a row is the
    request at fault's, from its third token on."""
    sampler, fired = e.sampler, []
    execute, mixed = e.runner.execute, []

    def execute_and_note(scheduled, block_table, copy_ops):
        mixed.append(_is_mixed(scheduled))
        return execute(scheduled, block_table, copy_ops)

    def sample_or_fail(logits, seqs):
        out = sampler(logits, seqs)
        if any(s.request.request_id == BAD and s.num_output_tokens >= 2 for s in seqs) and len(seqs) > 1:
            fired.append(mixed[-1])
            raise RuntimeError("injected: the sampler failed")
        return out

    e.runner.execute = execute_and_note
    e.sampler = sample_or_fail
    return fired


def _fault_in_beam_step(e):
    beam, fired = e.requests[BAD].beam, []
    step = beam.step

    def step_or_fail(logprobs, parents):
        if beam.num_generated >= 2:
            fired.append(True)
            raise OverflowError("injected: the beam step failed")
        return step(logprobs, parents)

    beam.step = step_or_fail
    return fired


def _fault_in_output(monkeypatch):
    build, fired = engine_module.request_output, []

    def build_or_fail(req, finished):
        if req.request_id == BAD and req.seqs[0].num_output_tokens >= 3:
            fired.append(True)
            raise KeyError("injected: the output failed")
        return build(req, finished)

    monkeypatch.setattr(engine_module, "request_output", build_or_fail)
    return fired


def _fault_in_commit(e):
    """The cache refuses the request at fault's computed tokens, sampled ones included (apply,
    per request)."""
    mark, fired = e.cache.mark_tokens_computed, []

    def mark_or_fail(seq_id, token_ids):
        req = e.requests.get(BAD)
        if req is not None and any(s.seq_id == seq_id for s in req.seqs) and req.seqs[0].num_output_tokens >= 2:
            fired.append(True)
            raise ValueError("injected: the commit failed")
        return mark(seq_id, token_ids)

    e.cache.mark_tokens_computed = mark_or_fail
    return fired


# fault: (the params of the request at fault, the step it arrives at, the injector)
FAULTS = {
    "forward-decode": (_greedy(10), 0, lambda e, mp: _fault_in_forward(e, after_tokens=2)),
    # its prompt chunk fails beside the others' decodes, before its second sample is forked
    "forward-prefill-n2": (SamplingParams(n=2, seed=3, max_tokens=8), 5, lambda e, mp: _fault_in_forward(e, 0)),
    "sampler-row": (SamplingParams(n=2, seed=11, max_tokens=8, ignore_eos=True), 0,
                    lambda e, mp: _fault_in_sampler(e)),
    "beam-step": (_beam(), 0, lambda e, mp: _fault_in_beam_step(e)),
    "output": (_greedy(10), 0, lambda e, mp: _fault_in_output(mp)),
    "commit": (_greedy(10), 0, lambda e, mp: _fault_in_commit(e)),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_fails_only_its_request(tiny_llama_dir, reference, monkeypatch, fault):
    bad_params, bad_at, inject = FAULTS[fault]
    workload = _workload(bad_params, bad_at)
    e = _engine(tiny_llama_dir)
    if bad_at == 0:  # added before the injector, which may look it up
        e.add_request(*workload[0][:3])
        workload = workload[1:]
    fired = inject(e, monkeypatch)
    final = _run(e, workload)

    assert fired, "the fault never fired"
    if fault.startswith(("forward", "sampler")):
        assert any(fired), "the fault never fired in a mixed batch of several requests"
    bad = final[BAD]
    assert bad.finished and len(bad.outputs) == bad_params.n
    assert all(c.finish_reason == "error" for c in bad.outputs)
    assert e.counters.requests_failed == 1
    others = [rid for rid, *_ in _workload(bad_params) if rid != BAD]
    assert _tokens(final, others) == _tokens(reference(bad_params, bad_at), others)
    assert all(c.finish_reason == "length" for rid in others for c in final[rid].outputs)
    _assert_settled(e)
    _assert_serves(e)


def test_a_copy_on_write_runs_again_only_with_its_sequence(tiny_llama_dir):
    """The step where two samples first write their shared partial block (one copies it) fails
    for another request scheduled after them: computed again in halves, the samples' half
    comes first, and the copy must not run again with the other half (it would overwrite what
    the sample wrote into its copy)."""
    pair = SamplingParams(n=2, seed=5, max_tokens=8, ignore_eos=True)
    prompt = _prompt(10, 4)  # two full blocks and a partial one, which the samples share

    def run(fault):
        e = _engine(tiny_llama_dir)
        e.add_request("pair", prompt, pair)
        e.add_request(BAD, _prompt(6, 1), _greedy(8))
        execute, logits, fired, step = e.runner.execute, e.runner.model.compute_logits, [], {}

        def execute_and_note(scheduled, block_table, copy_ops):
            first_write = any(s.request.request_id == "pair" and s.num_output_tokens == 1 for s, _ in scheduled)
            if fault and first_write and "at" not in step:
                step["at"] = e.counters.steps
                fired.append(len(copy_ops))
            # the request at fault fails in every attempt at that step
            step["fail"] = step.get("at") == e.counters.steps and any(s.request.request_id == BAD
                                                                         for s, _ in scheduled)
            return execute(scheduled, block_table, copy_ops)

        def logits_or_fail(hidden):  # after the copies and the KV writes
            if step["fail"]:
                raise RuntimeError("injected")
            return logits(hidden)

        e.runner.execute = execute_and_note
        e.runner.model.compute_logits = logits_or_fail
        final = _run(e, [])
        _assert_settled(e)
        return final, fired

    ref, _ = run(fault=False)
    got, fired = run(fault=True)
    assert fired and fired[0] > 0  # the failing step had a copy to run
    first = [c.token_ids[0] for c in ref["pair"].outputs]
    assert first[0] != first[1]  # the samples write different KV into their copies
    assert got[BAD].outputs[0].finish_reason == "error"
    assert _tokens(got, ["pair"]) == _tokens(ref, ["pair"])
    for c, r in zip(got["pair"].outputs, ref["pair"].outputs):  # the KV they attend to is the same
        assert abs(c.cumulative_logprob - r.cumulative_logprob) < 1e-4


def test_a_fault_in_every_step_fails_everyone_and_the_engine_lives(tiny_llama_dir, reference):
    e = _engine(tiny_llama_dir)
    execute, broken = e.runner.execute, [True]

    def execute_or_fail(scheduled, block_table, copy_ops):
        if broken[0]:
            raise MemoryError("injected: every forward fails")
        return execute(scheduled, block_table, copy_ops)

    e.runner.execute = execute_or_fail
    workload = _workload(_greedy(10))
    final = _run(e, workload)
    assert set(final) == {rid for rid, *_ in workload}
    assert all(c.finish_reason == "error" for out in final.values() for c in out.outputs)
    assert e.counters.requests_failed == len(workload)
    _assert_settled(e)
    broken[0] = False
    again = [(f"{rid}-again", prompt, params, at) for rid, prompt, params, at in workload]
    final = _run(e, again)
    ref = reference(_greedy(10))
    assert {rid: _tokens(final, [f"{rid}-again"])[f"{rid}-again"] for rid in ref} == _tokens(ref, list(ref))
    _assert_settled(e)


def test_a_failure_only_the_whole_batch_meets_fails_no_request(tiny_llama_dir, reference):
    """Out of memory at full size: the halves fit, and every request gets its tokens."""
    e = _engine(tiny_llama_dir)
    execute, failures = e.runner.execute, []

    def execute_or_oom(scheduled, block_table, copy_ops):
        if len({s.request.request_id for s, _ in scheduled}) >= 4:
            failures.append(len(scheduled))
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
        return execute(scheduled, block_table, copy_ops)

    e.runner.execute = execute_or_oom
    workload = _workload(_greedy(10))
    final = _run(e, workload)
    assert failures and e.counters.requests_failed == 0
    rids = [rid for rid, *_ in workload]
    assert _tokens(final, rids) == _tokens(reference(_greedy(10)), rids)
    _assert_settled(e)


@pytest.mark.parametrize("where", ["after-schedule", "mid-admission"])
def test_an_exception_in_schedule_fails_the_unfinished_requests(tiny_llama_dir, monkeypatch, where):
    e = _engine(tiny_llama_dir)
    for rid, prompt, params, _ in _workload(_greedy(10))[:5]:
        e.add_request(rid, prompt, params)
    e.step()
    e.step()
    if where == "after-schedule":  # admitted and reserved, never computed
        schedule = e.scheduler.schedule

        def schedule_then_fail():
            schedule()
            raise RuntimeError("injected: schedule failed")

        monkeypatch.setattr(e.scheduler, "schedule", schedule_then_fail)
    else:  # a new prompt's cached blocks are pinned, then its reservation raises: waiting, holding blocks
        e.add_request("late", _prompt(21, 2)[:16] + _prompt(5, 7), _greedy(4))  # shares g0's first blocks
        reserve, pinned = e.cache.try_reserve, {s.seq_id for s in e.scheduler.waiting}

        def reserve_or_fail(seq_id, n):
            if seq_id in pinned:
                raise RuntimeError("injected: reserve failed")
            return reserve(seq_id, n)

        monkeypatch.setattr(e.cache, "try_reserve", reserve_or_fail)
    outs = {o.request_id: o for o in e.step()}
    assert set(outs) == {"bad", "g0", "g1", "pair", "seeded"} | ({"late"} if where == "mid-admission" else set())
    assert all(out.finished and all(c.finish_reason == "error" for c in out.outputs) for out in outs.values())
    assert len(outs["pair"].outputs) == 2
    monkeypatch.undo()
    assert not e.has_unfinished_requests()
    _assert_settled(e)
    _assert_serves(e)


def test_a_device_error_is_raised_not_isolated(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    calls = []

    def execute(scheduled, block_table, copy_ops):
        calls.append(len(scheduled))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    e.runner.execute = execute
    e.add_request("a", _prompt(5, 1), _greedy(3))
    e.add_request("b", _prompt(5, 2), _greedy(3))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        e.step()
    assert calls == [2]  # not computed again in halves


def test_a_broken_cache_after_a_failure_is_raised(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    execute = e.runner.execute

    def corrupt_and_fail(scheduled, block_table, copy_ops):
        if any(s.num_output_tokens >= 1 for s, _ in scheduled):
            e.cache.pool.ref[e.cache.block_table(scheduled[0][0].seq_id)[0]] += 3
            raise RuntimeError("injected")
        return execute(scheduled, block_table, copy_ops)

    e.runner.execute = corrupt_and_fail
    e.add_request("a", _prompt(5, 1), _greedy(4))
    e.step()
    with pytest.raises(AssertionError):
        e.step()


# ---- inputs at the edges of validation ----------------------------------------------------


def test_huge_top_k_with_top_p_is_off_and_batches_with_others(tiny_llama_dir):
    prompt = _prompt(9, 3)
    mixed = [("huge", SamplingParams(top_k=2**63 - 1, top_p=0.5, seed=1, max_tokens=6)),
             ("vocab", SamplingParams(top_k=2048, top_p=0.5, seed=1, max_tokens=6)),
             ("k5", SamplingParams(top_k=5, seed=2, max_tokens=6)),
             ("p9", SamplingParams(top_p=0.9, seed=3, max_tokens=6)),
             ("greedy", _greedy(6))]
    e = _engine(tiny_llama_dir)
    for rid, p in mixed:
        e.add_request(rid, prompt, p)
    got = _run(e, [])
    assert e.counters.requests_failed == 0
    assert all(got[rid].outputs[0].finish_reason in ("stop", "length") for rid, _ in mixed)
    alone = _engine(tiny_llama_dir)
    alone.add_request("off", prompt, SamplingParams(top_p=0.5, seed=1, max_tokens=6))  # top_k off
    assert got["huge"].outputs[0].token_ids == got["vocab"].outputs[0].token_ids
    assert got["huge"].outputs[0].token_ids == _run(alone, [])["off"].outputs[0].token_ids


@pytest.mark.parametrize("length_penalty", [1000, 1000.0, 1e308, -1e308, 2**1000])
def test_beam_search_with_extreme_length_penalties_completes(tiny_llama_dir, length_penalty):
    e = _engine(tiny_llama_dir)
    stop = [int(t) for t in _prompt(40, 8)]  # many finish tokens: hypotheses finish at many lengths
    e.add_request("beam", _prompt(7, 4), SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=8,
                                                        length_penalty=length_penalty, stop_token_ids=stop))
    e.add_request("other", _prompt(8, 5), _greedy(6))
    got = _run(e, [])
    assert e.counters.requests_failed == 0
    assert [c.finish_reason in ("stop", "length") for c in got["beam"].outputs] == [True] * 3
    _assert_settled(e)


def test_beam_search_aborted_with_an_extreme_length_penalty_ranks_its_beams(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    e.add_request("beam", _prompt(7, 4), _beam(length_penalty=-1e308))
    for _ in range(4):
        e.step()
    e.abort_request("beam")
    out = _run(e, [])["beam"]
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    _assert_settled(e)


def test_length_power_is_hfs_for_ordinary_penalties_and_bounded_otherwise():
    for length in (1, 2, 7, 100):
        for lp in (1.0, 2.0, -0.5, 0.0, 2, 3):
            assert length_power(length, lp) == length**lp
    for lp in (1000, 1e308, -1e308, 2**1000, -(2**1000)):
        for length in (2, 10**6):
            p = length_power(length, lp)
            assert 0.0 < p < float("inf")
            assert abs(abs(torch.log(torch.tensor(p, dtype=torch.float64))) - MAX_LOG_LENGTH_POWER) < 1e-9
            assert torch.isfinite(torch.tensor([-30.0]) / p).all() and float(torch.tensor([-1e-3]) / p) != 0.0
    assert length_power(1, 1e308) == 1


# ---- classification ---------------------------------------------------------------------


def test_is_device_error():
    sticky = ["CUDA error: an illegal memory access was encountered",
              "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`",
              "CUDA error: unspecified launch failure",
              "Triton Error [CUDA]: an illegal memory access was encountered"]
    for message in sticky:
        assert is_device_error(RuntimeError(message)), message
    assert is_device_error(torch.AcceleratorError("CUDA error: invalid argument"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    assert not is_device_error(RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
    assert not is_device_error(ValueError("illegal memory access"))  # only errors torch raises
    assert not is_device_error(None)
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise KeyError("while sampling") from inner
    except KeyError as outer:
        assert is_device_error(outer)


def test_validation_errors_name_their_field(tiny_llama_dir):
    for kw, param in [(dict(top_p=2.0), "top_p"), (dict(temperature=10**400), "temperature"),
                      (dict(frequency_penalty=3.0), "frequency_penalty"), (dict(top_k=-2), "top_k"),
                      (dict(use_beam_search=True, n=2, length_penalty=float("inf")), "length_penalty"),
                      (dict(length_penalty=2.0), "length_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens")]:
        with pytest.raises(ParamError, match=param) as info:
            SamplingParams(**kw).validate()
        assert info.value.param == param and isinstance(info.value, ValueError)
    e = _engine(tiny_llama_dir)
    for args, param in [(("", [5], SamplingParams()), "request_id"), (("a", [], SamplingParams()), "prompt_token_ids"),
                        (("a", [5], SamplingParams(n=9)), "n"), (("a", [5], SamplingParams(n=2, best_of=9)), "best_of"),
                        (("a", [5], SamplingParams(max_tokens=10**6)), "max_tokens"),
                        (("a", [5], SamplingParams(use_beam_search=True, beam_width=9)), "beam_width"),
                        (("a", [5], "greedy"), "params")]:
        with pytest.raises(ParamError, match=param) as info:
            e.add_request(*args)
        assert info.value.param == param
    assert not e.requests


# ---- the offline API ----------------------------------------------------------------------


def test_llm_generate_returns_a_failed_prompt_with_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=4, num_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32)
    prompts = [_prompt(6, 1), _prompt(9, 2), _prompt(7, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ref = llm.generate(prompts, params)
    execute = llm.engine.runner.execute
    target = {}

    def execute_or_fail(scheduled, block_table, copy_ops):
        if any(s.request.prompt_token_ids == prompts[1] and s.num_output_tokens >= 2 for s, _ in scheduled):
            target["hit"] = True
            raise RuntimeError("injected")
        return execute(scheduled, block_table, copy_ops)

    llm.engine.runner.execute = execute_or_fail
    got = llm.generate(prompts, params)
    assert target and [o.outputs[0].finish_reason for o in got] == ["length", "error", "length"]
    assert got[1].outputs[0].token_ids == ref[1].outputs[0].token_ids[:2]  # what it had before
    assert [got[i].outputs[0].token_ids for i in (0, 2)] == [ref[i].outputs[0].token_ids for i in (0, 2)]
    assert got[0].outputs[0].text == ref[0].outputs[0].text
    assert llm.engine.cache.stats().in_use_blocks == 0


def test_llm_generate_returns_a_prompt_it_could_not_add_with_error(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=4, num_blocks=64, max_num_seqs=4)
    add = llm.engine.add_request
    prompts = [_prompt(6, 1), _prompt(9, 2)]

    def add_or_fail(rid, ids, *args, **kw):
        if ids == prompts[0]:
            raise RuntimeError("injected")
        return add(rid, ids, *args, **kw)

    monkeypatch.setattr(llm.engine, "add_request", add_or_fail)
    got = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [[c.finish_reason for c in o.outputs] for o in got] == [["error", "error"], ["length", "length"]]
    assert got[0].prompt_token_ids == prompts[0] and got[0].finished
