"""Structured outputs (grammar-constrained decoding through xgrammar), offline: LLM.generate and
Engine.add_request on the tiny random model, whose outputs are only what the grammar forces."""

import json
import re

import msgspec
import pytest

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar: pip install '.[structured]'")

from radixkv import protocol  # noqa: E402
from radixkv.engine.config import EngineConfig  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.errors import ParamError  # noqa: E402
from radixkv.engine.llm import LLM  # noqa: E402
from radixkv.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = [[5, 17, 300, 41], [9, 9, 1000, 2, 77, 13, 400], [1500, 3, 8]]
MAX = 64


def _valid(value, schema) -> bool:
    """The few keywords SCHEMA uses (jsonschema is not a dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
                and set(value) <= set(props) and all(_valid(v, props[k]) for k, v in value.items()))
    if t == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    raise AssertionError(f"no check for {schema}")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu")


def _params(**so):
    return SamplingParams(temperature=0.0, max_tokens=MAX, structured_outputs=StructuredOutputs(**so))


def _texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_output_parses_and_validates(llm):
    outs = llm.generate(PROMPTS, _params(json=SCHEMA))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert _valid(json.loads(o.outputs[0].text), SCHEMA), o.outputs[0].text


def test_json_schema_as_text_equals_the_dict(llm):
    assert _texts(llm.generate(PROMPTS[:1], _params(json=json.dumps(SCHEMA)))) == \
        _texts(llm.generate(PROMPTS[:1], _params(json=SCHEMA)))


def test_choice_gives_one_choice_exactly(llm):
    for o in llm.generate(PROMPTS, _params(choice=CHOICES)):
        assert o.outputs[0].text in CHOICES and o.outputs[0].finish_reason == "stop"


def test_regex_output_fullmatches(llm):
    for o in llm.generate(PROMPTS, _params(regex=REGEX)):
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "x"'
    for o in llm.generate(PROMPTS, _params(grammar=grammar)):
        assert re.fullmatch(r"\((\d|x)(,(\d|x))?\)", o.outputs[0].text), o.outputs[0].text


def test_json_object_gives_an_object(llm):
    # any JSON: a random model may nest long; the test only asks for an object when it finishes
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200,
                                                structured_outputs=StructuredOutputs(json_object=True)))
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished
    for text in finished:
        assert isinstance(json.loads(text), dict)
    for o in outs:
        assert o.outputs[0].text.startswith("{")


def test_seeded_samples_each_valid(llm):
    p = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX, structured_outputs=StructuredOutputs(json=SCHEMA))
    outs = llm.generate(PROMPTS[:2], p)
    for o in outs:
        assert len(o.outputs) == 2
        for c in o.outputs:
            assert c.finish_reason == "stop" and _valid(json.loads(c.text), SCHEMA), c.text
    assert _texts(llm.generate(PROMPTS[:2], p)) == _texts(outs)  # seeded: the same again


@pytest.mark.parametrize("engine_args", [dict(enable_prefix_caching=False),
                                         dict(block_size=4, num_blocks=20, max_num_seqs=8, max_num_batched_tokens=16,
                                              max_prefill_chunk=5)],
                         ids=["no-prefix-caching", "small-pool-preempting"])
def test_greedy_structured_equal_across_caching_and_preemption(llm, tiny_llama_dir, engine_args):
    prompts = [p + s for s in ([], [11, 12], [13], [14, 15, 16]) for p in PROMPTS]  # shared prefixes
    params = [_params(json=SCHEMA), _params(regex=REGEX), _params(choice=CHOICES)] * 4
    want = _texts(llm.generate(prompts, params))
    other = LLM(str(tiny_llama_dir), device="cpu", **engine_args)
    assert _texts(other.generate(prompts, params)) == want
    if "num_blocks" in engine_args:
        assert other.engine.metrics().preemptions > 0


def _engine(model_dir, **kw):
    return Engine(EngineConfig(model_dir=str(model_dir), device="cpu", **kw))


def _run(engine, requests):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [(list(c.token_ids), c.finish_reason) for c in out.outputs]
    return tokens


def test_unconstrained_request_in_a_constrained_batch_gets_its_tokens_alone(tiny_llama_dir):
    plain = (PROMPTS[0], SamplingParams(temperature=0.8, seed=3, max_tokens=20))
    alone = _run(_engine(tiny_llama_dir), {"plain": plain})
    mixed = _run(_engine(tiny_llama_dir), {"a": (PROMPTS[1], _params(json=SCHEMA)), "plain": plain,
                                           "b": (PROMPTS[2], _params(regex=REGEX))})
    assert mixed["plain"] == alone["plain"]


def test_overlapped_loop_equals_synchronous(tiny_llama_dir):
    reqs = {"a": (PROMPTS[0], _params(json=SCHEMA)), "p1": (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24)),
            "b": (PROMPTS[2], _params(choice=CHOICES)),
            "p2": (PROMPTS[0] + [3], SamplingParams(temperature=0.9, seed=1, max_tokens=24)),
            "c": (PROMPTS[1], SamplingParams(n=2, seed=5, max_tokens=MAX, structured_outputs=StructuredOutputs(
                regex=REGEX)))}
    sync = _run(_engine(tiny_llama_dir, async_scheduling=False), reqs)
    overlapped = _run(_engine(tiny_llama_dir, async_scheduling=True), reqs)
    assert overlapped == sync


@pytest.mark.parametrize("so, param", [
    (dict(json={"type": "frobnicate"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "structured_outputs.json"),
    (dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "structured_outputs.json"),
    (dict(json={"if": {"type": "string"}, "then": {"maxLength": 2}}), "structured_outputs.json"),
    (dict(json={"type": "object", "patternProperties": {"^x": {"type": "integer"}}}), "structured_outputs.json"),
    (dict(regex="a("), "structured_outputs.regex"),
    (dict(grammar="root ::= ("), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["b"]), "structured_outputs"),
    (dict(), "structured_outputs"),
])
def test_bad_specs_are_refused_naming_the_field(llm, so, param):
    with pytest.raises(ParamError) as e:
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputs(**so)))
    assert e.value.param == param and param in str(e.value)
    assert "bad" not in llm.engine.requests


def test_unsupported_keyword_named_and_property_names_are_not_keywords(llm):
    with pytest.raises(ParamError, match="uniqueItems"):
        SamplingParams(structured_outputs=StructuredOutputs(json={"uniqueItems": True})).validate()
    ok = {"type": "object", "properties": {"not": {"type": "integer", "minimum": 0, "maximum": 9}, "if": {"enum": [1]}}, "required": ["not"]}
    out = llm.generate([PROMPTS[0]], _params(json=ok))[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["not"], int)


def test_beam_search_refused():
    with pytest.raises(ParamError) as e:
        SamplingParams(use_beam_search=True, n=2, temperature=0.0,
                       structured_outputs=StructuredOutputs(regex="a")).validate()
    assert e.value.param == "structured_outputs"


def test_spec_crosses_the_wire():
    for so in (StructuredOutputs(json=SCHEMA), StructuredOutputs(choice=CHOICES), StructuredOutputs(json_object=True),
               StructuredOutputs(regex=REGEX), StructuredOutputs(grammar='root ::= "a"')):
        p = SamplingParams(max_tokens=5, structured_outputs=so).validate()
        wire = msgspec.msgpack.encode(protocol.GenerateRequest("r", [1], protocol.sampling_options(p)))
        back = msgspec.msgpack.decode(wire, type=protocol.GenerateRequest)
        assert SamplingParams(**msgspec.structs.asdict(back.sampling)) == p
    # given as a dict, as vLLM takes it
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputs(regex="a+")


def test_grammars_compile_once_per_spec(llm):
    g = llm.engine.grammars
    a = g.compile(StructuredOutputs(json=SCHEMA))
    assert g.compile(StructuredOutputs(json=json.dumps(SCHEMA))) is a


def test_smollm2_gguf_json_schema():
    """A real tokenizer (a GGUF's own vocabulary, 49,152 tokens) and a model that writes text."""
    from radixkv.models.smollm2 import INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct's GGUF is not installed ({INSTALL})")
    llm = LLM(path, device="cpu")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    out = llm.generate([list(prompt)], _params(json=SCHEMA))[0].outputs[0]
    assert out.finish_reason == "stop" and _valid(json.loads(out.text), SCHEMA), out.text
    out = llm.generate([list(prompt)], _params(choice=CHOICES))[0].outputs[0]
    assert out.text in CHOICES


def test_a_dict_with_unknown_keys_is_refused():
    with pytest.raises(ParamError) as e:
        SamplingParams(structured_outputs={"regexp": "a"}).validate()
    assert e.value.param == "structured_outputs"
