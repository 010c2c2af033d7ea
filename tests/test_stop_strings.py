"""Stop strings in the one output processor: offline (LLM) as over HTTP, across token boundaries,
with n > 1; and the one SamplingParams definition on the wire and in the limits check."""

import httpx
import msgspec
import pytest
from test_server_harness import running_server

from radixkv import protocol as P
from radixkv.engine.errors import ParamError
from radixkv.output_processor import OutputProcessor
from radixkv.sampling_params import FIELDS, SamplingParams, rule

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, one_torch_thread):
    from radixkv.engine.llm import LLM

    return LLM(str(tiny_llama_dir), device="cpu", num_blocks=96)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


def spanning_stop(tokenizer, ids: list[int], start: int = 2) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next, and the
    number of tokens up to the one that completes it (its first occurrence in the text)."""
    text = tokenizer.decode(ids)
    for k in range(start, len(ids) - 1):
        left, right = tokenizer.decode(ids[: k + 1]), tokenizer.decode(ids[: k + 2])
        if len(left) >= 2 and len(right) - len(left) >= 2 and text.startswith(right):
            stop = left[-2:] + right[len(left) : len(left) + 2]
            if text.find(stop) == len(left) - 2:  # first seen exactly here
                return stop, k + 2
    pytest.skip("no token boundary to span in this output")


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw)


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


# ---- the processor alone ---------------------------------------------------------------------------


def test_a_stop_string_across_tokens_cuts_at_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode(" hello world, plain ascii and more words")
    text = tokenizer.decode(ids)
    stop, k = spanning_stop(tokenizer, ids)
    for chunks in ([[t] for t in ids], [ids]):  # token by token, or one delta (best_of, beams)
        proc = OutputProcessor(tokenizer, [1, 2], SamplingParams(stop=[stop]))
        shown = "".join(proc.process(c) or "" for c in chunks)
        assert shown == proc.text == text[: text.index(stop)]
        assert proc.finish_reason == "stop" and proc.stopped_by_string and proc.num_tokens == k
        assert proc.process([5], "length") is None  # ended: later tokens are ignored


def test_include_stop_str_and_min_tokens(tokenizer):
    ids = tokenizer.encode(" one two three two one")
    text = tokenizer.decode(ids)
    proc = OutputProcessor(tokenizer, [], SamplingParams(stop=["two"], include_stop_str_in_output=True))
    for t in ids:
        proc.process([t])
    assert proc.text == text[: text.index("two") + 3] and proc.finish_reason == "stop"
    # before min_tokens no stop string counts: the second "two" ends it
    first = len(tokenizer.encode(" one two"))
    proc = OutputProcessor(tokenizer, [], SamplingParams(stop=["two"], min_tokens=first + 1, max_tokens=64))
    for t in ids:
        proc.process([t])
    assert proc.text == text[: text.rindex("two")]
    # no stop string met: the whole text, the engine's finish_reason
    proc = OutputProcessor(tokenizer, [], SamplingParams(stop=["@@"]))
    assert proc.process(ids, "length") == text and proc.finish_reason == "length" and not proc.stopped_by_string


# ---- offline ----------------------------------------------------------------------------------------


def test_offline_stop_string_ends_the_output_and_the_engine_request(llm, tokenizer):
    ids = prompt_ids(tokenizer)
    full = llm.generate([ids], greedy())[0].outputs[0]
    stop, k = spanning_stop(tokenizer, full.token_ids)
    before = llm.engine.metrics().generation_tokens
    out = llm.generate([ids], greedy(stop=["@@never@@", stop]))[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:k]  # up to the token that completed the stop string
    assert llm.engine.metrics().generation_tokens - before == k  # aborted: decoded no further
    assert not llm.engine.has_unfinished_requests()
    with_stop = llm.generate([ids], greedy(stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert with_stop.text == full.text[: full.text.index(stop) + len(stop)]


def test_offline_stop_strings_with_n_samples(llm, tokenizer):
    ids = prompt_ids(tokenizer)
    sampled = dict(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    full = llm.generate([ids], SamplingParams(**sampled))[0].outputs
    stop = full[1].text[6:8]  # met by sample 1 at least
    outs = llm.generate([ids], SamplingParams(**sampled, stop=[stop]))[0].outputs
    for ref, out in zip(full, outs):
        if stop in ref.text:
            assert (out.text, out.finish_reason) == (ref.text[: ref.text.index(stop)], "stop")
            assert ref.token_ids[: len(out.token_ids)] == out.token_ids
        else:
            assert (out.text, out.finish_reason, out.token_ids) == (ref.text, ref.finish_reason, ref.token_ids)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.metrics().cache.in_use_blocks == 0


def test_offline_stop_strings_need_a_valid_list(llm, tokenizer):
    with pytest.raises(ValueError, match=r"prompts\[0\]: stop must be a list of non-empty strs"):
        llm.generate([prompt_ids(tokenizer)], greedy(stop=[""]))


# ---- offline equals the server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("stop")) as srv:
        yield srv


def test_offline_stop_strings_equal_the_server(server, llm, tokenizer):
    ids = prompt_ids(tokenizer)
    full = llm.generate([ids], greedy())[0].outputs[0]
    stop, _ = spanning_stop(tokenizer, full.token_ids)
    sampled = dict(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    other = llm.generate([ids], SamplingParams(**sampled))[0].outputs[0].text[4:6]
    cases = [(dict(temperature=0.0, max_tokens=16, ignore_eos=True), [stop]),
             (dict(temperature=0.0, max_tokens=16, ignore_eos=True), [stop, full.text[9:11], "@@"]),
             (sampled, [other])]
    with httpx.Client(base_url=server.api, timeout=120) as http:
        for kw, stops in cases:
            offline = llm.generate([ids], SamplingParams(**kw, stop=stops))[0].outputs
            r = http.post("/completions", json={"model": server.model, "prompt": ids, "stop": stops, **kw})
            assert r.status_code == 200, r.text
            online = sorted(r.json()["choices"], key=lambda c: c["index"])
            assert [(c["text"], c["finish_reason"]) for c in online] == [(o.text, o.finish_reason) for o in offline]
            assert any(o.finish_reason == "stop" for o in offline)


# ---- one definition: the wire and the limits ------------------------------------------------------


def test_sampling_params_cross_the_wire_whole():
    p = SamplingParams(n=2, best_of=3, temperature=0.5, seed=3, stop=["x", "yz"], include_stop_str_in_output=True,
                       skip_special_tokens=False, stop_token_ids=[4], logprobs=2)
    msg = P.GenerateRequest("r", [1, 2], P.sampling_options(p))
    got = P.make_decoder("to_worker").decode(P.make_encoder().encode(msg)).sampling
    assert SamplingParams(**msgspec.structs.asdict(got)) == p
    assert set(P.SamplingOptions.__struct_fields__) == set(FIELDS)
    assert SamplingParams(stop="x").stop == ["x"]  # one bare stop string, as vLLM takes it


def test_the_api_takes_its_bounds_from_the_definition():
    from tokenizer_server.api_models import ChatCompletionRequest, CompletionRequest

    def bounds(model, name):
        return {type(m).__name__.lower(): getattr(m, type(m).__name__.lower()) for m in model.model_fields[name].metadata
                if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}

    for name in ("top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "logprobs"):
        assert bounds(CompletionRequest, name) == rule(name).api_bounds(), name
    assert bounds(ChatCompletionRequest, "top_logprobs") == rule("logprobs").api_bounds()
    assert bounds(CompletionRequest, "temperature") == {**rule("temperature").api_bounds(), "le": 2.0}


def test_validate_request_takes_limits_not_the_engine():
    from radixkv.engine.validate import RequestLimits, validate_request

    limits = RequestLimits(vocab_size=100, max_model_len=32, max_positions=64, num_blocks=8, block_size=4,
                           max_num_seqs=4, eos_token_ids=(2,))
    validate_request(limits, "a", [1, 2, 3], SamplingParams(max_tokens=8), None)
    for args, param in [(("a", [1], SamplingParams(), None, {"a"}), "request_id"),
                        (("b", [100], SamplingParams(), None), "prompt_token_ids"),
                        (("b", [1] * 30, SamplingParams(max_tokens=8)), "max_tokens"),
                        (("b", [1], SamplingParams(n=5)), "n"),
                        (("b", [1], SamplingParams(stop_token_ids=[100])), "stop_token_ids"),
                        (("b", [1], SamplingParams(use_beam_search=True, n=2, max_tokens=30)), "max_tokens")]:
        if len(args) == 3:
            args = (*args, None)
        with pytest.raises(ParamError) as e:
            validate_request(limits, *args)
        assert e.value.param == param and str(e.value).startswith(param)
