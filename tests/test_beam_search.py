"""Beam search in the engine against HF transformers' generate(num_beams=W, do_sample=False) on the
tiny models (CPU, fp32), and the engine-side rules: beams share blocks through forks, run in the
same batches as other requests, are never preempted, and free everything when done or aborted.

The tiny models almost never emit their EOS, so finished hypotheses would never compete; the HF
comparisons therefore stop on a few tokens that rank just behind the greedy choice (the same ids
as HF's eos_token_id and our stop_token_ids), which makes beams finish early and the length
penalty and early-stopping rules decide the outcome.
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from radixkv.engine.beam_search import worst_case_blocks
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.llm import LLM
from radixkv.engine.sampling_params import SamplingParams
from test_engine_cases import run_engine

B = 4
MAX_TOKENS = 10
# (prompt seed, rank of the alternative tokens that stop) per model: chosen so that several
# beams finish before the length limit and the early_stopping settings change the result
SETUP = {"tiny_llama_dir": (1, 1), "tiny_qwen3_dir": (1, 3)}
SETTINGS = [(lp, es) for lp in (1.0, 2.0, -0.5) for es in (False, True, "never")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_models():
    hf_logging.set_verbosity_error()
    cache = {}

    def get(model_dir):
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                                    dtype=torch.float32).eval()
        return cache[model_dir]

    return get


def _stop_tokens(hf, prompt, *ranks):
    """Tokens of the given ranks (0 = best) at the first greedy steps, minus the greedy tokens themselves."""
    with torch.no_grad():
        o = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_scores=True,
                        return_dict_in_generate=True)
    greedy = o.sequences[0, len(prompt):].tolist()
    k = max(ranks) + 1
    return sorted({int(s[0].topk(k).indices[r]) for s in o.scores for r in ranks} - set(greedy))


def _hf_beams(hf, prompt, W, lp, es, eos, min_new=0):
    with torch.no_grad():
        o = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, num_beams=W,
                        num_return_sequences=W, early_stopping=es, length_penalty=lp, eos_token_id=eos,
                        pad_token_id=eos[0], min_new_tokens=min_new, output_scores=True, return_dict_in_generate=True)
    return o.sequences[:, len(prompt):].tolist(), o.sequences_scores.tolist(), eos[0]


def _assert_same(out, ref, lp):
    """Our outputs (unpadded, best first) against HF's (padded with the pad id after a finish)."""
    seqs, scores, pad = ref
    assert len(out.outputs) == len(seqs)
    for rank, (c, row, score) in enumerate(zip(out.outputs, seqs, scores)):
        assert c.index == rank
        assert row[: len(c.token_ids)] == c.token_ids, (rank, row, c.token_ids)
        assert all(t == pad for t in row[len(c.token_ids):])
        assert c.cumulative_logprob / len(c.token_ids) ** lp == pytest.approx(score, abs=1e-5)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_beam_search_equals_hf_generate(fixture, W, request, hf_models):
    model_dir = request.getfixturevalue(fixture)
    hf = hf_models(model_dir)
    seed, rank = SETUP[fixture]
    prompt = _prompt(10, seed)  # 2.5 blocks: beams share a partial block and copy it on write
    stops = _stop_tokens(hf, prompt, rank)
    llm = LLM(str(model_dir), device="cpu", block_size=B, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    results = {}
    for lp, es in SETTINGS:
        params = SamplingParams(use_beam_search=True, beam_width=W, n=W, length_penalty=lp, early_stopping=es,
                                max_tokens=MAX_TOKENS, stop_token_ids=stops, ignore_eos=True)
        out = llm.generate(prompt, params)[0]
        _assert_same(out, _hf_beams(hf, prompt, W, lp, es, stops), lp)
        results[(lp, es)] = [tuple(c.token_ids) for c in out.outputs]
        assert {c.finish_reason for c in out.outputs} <= {"stop", "length"}
        for c in out.outputs:
            assert (c.finish_reason == "stop") == (c.token_ids[-1] in stops)
    # the setup exercises what it means to: finished hypotheses, and early stopping that matters
    assert any(t[-1] in stops for r in results.values() for t in r)
    assert len({tuple(results[(1.0, es)]) for es in (False, True, "never")}) > 1

    # many stop tokens: more than W of the 2W best candidates may finish in one step, so only
    # K = W x (1 + stop tokens) candidates leave W beams running
    prompt2 = _prompt(10, 2)
    many = _stop_tokens(hf, prompt2, 1, 2)
    out = llm.generate(prompt2, SamplingParams(use_beam_search=True, beam_width=W, n=W, max_tokens=MAX_TOKENS,
                                               stop_token_ids=many, ignore_eos=True))[0]
    _assert_same(out, _hf_beams(hf, prompt2, W, 1.0, False, many), 1.0)

    # the model's own EOS ids stay finish tokens (more candidates per step), min_tokens masks them all
    eos = sorted(set(llm.engine.eos_token_ids) | set(stops))
    out = llm.generate(prompt, SamplingParams(use_beam_search=True, beam_width=W, max_tokens=MAX_TOKENS,
                                              stop_token_ids=stops, min_tokens=3))[0]
    ref = _hf_beams(hf, prompt, W, 1.0, False, eos, min_new=3)
    _assert_same(out, ([ref[0][0]], [ref[1][0]], ref[2]), 1.0)  # n = 1: the best only
    assert len(out.outputs[0].token_ids) >= 3
    m = llm.engine.metrics()
    assert m.cache.in_use_blocks == 0 and m.running == 0
    assert llm.engine.scheduler.admission.reserved_blocks == 0
    llm.engine.cache.check_invariants()


def _engine(model_dir, **kw):
    args = dict(device="cpu", block_size=B, num_blocks=128, max_num_seqs=12, max_num_batched_tokens=64)
    args.update(kw)
    return Engine(EngineConfig(model_dir=str(model_dir), **args))


def _alone(model_dir, prompt, params, **kw):
    e = _engine(model_dir, **kw)
    e.add_request("x", prompt, params)
    return run_engine(e)["x"]


def _beam(W, n=None, max_tokens=12, **kw):
    return SamplingParams(use_beam_search=True, beam_width=W, n=n or W, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_beams_share_blocks_through_forks(tiny_llama_dir):
    prompt, W = _prompt(14, 5), 4
    e = _engine(tiny_llama_dir)
    e.add_request("beam", prompt, _beam(W, max_tokens=16))
    worst = worst_case_blocks(len(prompt), 16, W, B)
    peaks = []
    out = run_engine(e, on_step=lambda eng: peaks.append(eng.cache.stats().in_use_blocks))["beam"]
    assert len(out.outputs) == W and len({tuple(c.token_ids) for c in out.outputs}) == W
    assert all(len(c.token_ids) == 16 for c in out.outputs)
    # every beam holds its own copy of the prompt and history without sharing: (14 + 15) / 4 -> 8 blocks
    assert out.sharing.blocks_without_sharing == W * 8
    assert out.sharing.blocks_held < out.sharing.blocks_without_sharing and max(peaks) <= worst
    assert out.sharing.block_steps_held < out.sharing.block_steps_without_sharing
    assert out.sharing.num_computed_prompt_tokens == len(prompt)
    # histories are shared, not copied: copy-on-write only ever copies a beam's partial last block
    m = e.metrics()
    steps_after_prompt = m.steps - 1
    assert m.cache.copy_on_write_blocks <= (W - 1) * steps_after_prompt
    assert m.computed_tokens == len(prompt) + W * 15
    assert m.cache.in_use_blocks == 0 and e.scheduler.admission.reserved_blocks == 0


def test_beam_request_in_the_same_batches_as_others(tiny_llama_dir):
    prompts = [_prompt(11, 20), _prompt(7, 21), _prompt(19, 22), _prompt(6, 23)]
    params = [_beam(3, n=2), SamplingParams(temperature=0.0, max_tokens=9),
              SamplingParams(n=2, seed=4, max_tokens=8), _beam(2, length_penalty=0.5, early_stopping=True)]
    e = _engine(tiny_llama_dir)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add_request(f"r{i}", p, sp)
    batches = []
    execute = e.runner.execute

    def record(scheduled, *args):
        batches.append({s.request.request_id for s, _ in scheduled})
        return execute(scheduled, *args)

    e.runner.execute = record
    got = run_engine(e)
    assert any({"r0", "r1", "r2", "r3"} <= b for b in batches)  # beams decode beside the others
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ref = _alone(tiny_llama_dir, p, sp)
        assert [c.token_ids for c in got[f"r{i}"].outputs] == [c.token_ids for c in ref.outputs]
    assert e.cache.stats().in_use_blocks == 0


def test_beams_are_not_preempted_and_admission_keeps_their_worst_case(tiny_llama_dir):
    beams = [(_prompt(10, 30), _beam(4, max_tokens=10)), (_prompt(9, 31), _beam(3, max_tokens=10))]
    others = [(_prompt(20 + i, 40 + i), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
              for i in range(3)]
    worst = [worst_case_blocks(len(p), 10, sp.beam_width, B) for p, sp in beams]
    num_blocks = max(worst) + 8  # each beam request fits, not both with the others
    assert sum(worst) > num_blocks
    e = _engine(tiny_llama_dir, num_blocks=num_blocks)
    for i, (p, sp) in enumerate(beams + others):
        e.add_request(f"r{i}", p, sp)
    seen = []

    def check(eng):
        assert eng.scheduler.admission.reserved_blocks <= eng.num_blocks
        seen.append(sum(1 for s in eng.scheduler.running if s.request.beam is not None))

    got = run_engine(e, on_step=check)
    assert e.metrics().preemptions > 0
    assert max(seen) == 4  # never both beam requests at once (4 + 3 beams)
    for i, (p, sp) in enumerate(beams + others):
        ref = _alone(tiny_llama_dir, p, sp)
        assert [c.token_ids for c in got[f"r{i}"].outputs] == [c.token_ids for c in ref.outputs]
    assert e.scheduler.admission.reserved_blocks == 0 and e.cache.stats().in_use_blocks == 0


def test_abort_mid_search_ranks_running_beams_and_frees(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    e.add_request("b", _prompt(9, 50), _beam(3, n=2, max_tokens=20, logprobs=2))
    e.add_request("waiting", _prompt(9, 51), _beam(2))
    for _ in range(6):
        assert not e.step()  # a beam search reports only at its end
    e.abort_request("b")
    e.abort_request("waiting")
    outs = {o.request_id: o for o in e.step()}
    assert outs["b"].finished and [c.finish_reason for c in outs["b"].outputs] == ["abort", "abort"]
    first, second = outs["b"].outputs
    assert len(first.token_ids) == 6 and first.cumulative_logprob >= second.cumulative_logprob  # 1 per step
    assert len(first.logprobs) == 6 and all(t in d for t, d in zip(first.token_ids, first.logprobs))
    assert sum(d[t] for t, d in zip(first.token_ids, first.logprobs)) == pytest.approx(first.cumulative_logprob,
                                                                                        abs=1e-4)
    assert outs["waiting"].finished
    assert not e.has_unfinished_requests()
    assert e.scheduler.admission.reserved_blocks == 0 and e.cache.stats().in_use_blocks == 0


def test_logprobs_of_finished_beams_add_up(tiny_llama_dir):
    out = _alone(tiny_llama_dir, _prompt(8, 60), _beam(3, max_tokens=7, logprobs=3))
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 7
        assert all(t in d and len(d) <= 4 for t, d in zip(c.token_ids, c.logprobs))
        assert sum(d[t] for t, d in zip(c.token_ids, c.logprobs)) == pytest.approx(c.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("kw,match", [
    (dict(use_beam_search=True), "use_beam_search"),
    (dict(use_beam_search=True, beam_width=1), "beam_width"),
    (dict(use_beam_search=True, beam_width=2, n=3), "n"),
    (dict(use_beam_search=True, beam_width=2, best_of=3, n=2), "best_of"),
    (dict(use_beam_search=True, n=2, top_p=0.5), "top_p"),
    (dict(use_beam_search=True, n=2, top_k=5), "top_k"),
    (dict(use_beam_search=True, n=2, repetition_penalty=1.2), "repetition_penalty"),
    (dict(use_beam_search=True, n=2, early_stopping="sometimes"), "early_stopping"),
    (dict(use_beam_search=True, n=2, length_penalty=float("nan")), "length_penalty"),
    (dict(use_beam_search="yes", n=2), "use_beam_search"),
    (dict(beam_width=2), "beam_width"),
    (dict(length_penalty=2.0), "length_penalty"),
    (dict(early_stopping=True), "early_stopping"),
])
def test_bad_beam_params_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate()


def test_engine_rejects_beams_that_cannot_fit(tiny_llama_dir):
    e = _engine(tiny_llama_dir, num_blocks=20, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_tokens"):  # 4 beams x 40 tokens cannot fit 20 blocks of 4
        e.add_request("big", _prompt(8, 0), _beam(4, max_tokens=40))
    with pytest.raises(ValueError, match="beam_width"):
        e.add_request("wide", _prompt(8, 0), _beam(6, max_tokens=2))
    assert not e.requests and not e.has_unfinished_requests()
    e.add_request("ok", _prompt(8, 0), _beam(2, max_tokens=4))
    assert len(run_engine(e)["ok"].outputs) == 2


def test_generate_command_beam_search(tiny_llama_dir, capsys):
    import argparse
    import json

    from radixkv.cli import generate as generate_cmd

    p = argparse.ArgumentParser()
    generate_cmd.add_arguments(p)
    common = [str(tiny_llama_dir), "--prompt", "Hello there, how are you today?", "--max-tokens", "6",
              "--device", "cpu", "--num-blocks", "64", "--block-size", "4"]
    args = p.parse_args(common + ["--beam-width", "3", "--n", "2", "--length-penalty", "0.5", "--early-stopping",
                                  "true", "--json"])
    assert generate_cmd.main(args) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    got = json.loads(line)
    llm = LLM(str(tiny_llama_dir), device="cpu", num_blocks=64, block_size=4)
    ref = llm.generate("Hello there, how are you today?",
                       SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6, length_penalty=0.5,
                                      early_stopping=True))[0]
    assert [o["token_ids"] for o in got["outputs"]] == [c.token_ids for c in ref.outputs]
    sh = ref.sharing
    assert got["blocks_held"] == sh.blocks_held < got["blocks_without_sharing"] == sh.blocks_without_sharing
    assert generate_cmd.main(p.parse_args(common + ["--beam-width", "2", "--top-p", "0.5"])) == 2
    assert "top_p" in capsys.readouterr().err
