"""Property: no request body a client can send gets a 5xx or takes the engine worker down.

Bodies are drawn from the API's own JSON schema (the pydantic models' model_json_schema(), read
by a small schema-to-strategy function: hypothesis-jsonschema 0.23.1 does not run on the pinned
hypothesis), then a few fields are overwritten with hostile values (ints past int64, NaN and
Infinity, lone surrogates, wrong types, fields the server refuses, unknown extras). Each example
must get a 2xx, or a 4xx in the OpenAI error shape; a stream must end with `data: [DONE]`.
Afterwards the worker is the one the server started with and an idle pool holds no block."""

import json

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_harness import running_server, wait_for

from tokenizer_server.api_models import ChatCompletionRequest, CompletionRequest

MODEL = "tiny"
MAX_LIST_ITEMS = 4  # drawn lists stay short: the caps themselves are test_bad_input's business
MAX_TEXT_CHARS = 40
EXAMPLES_PER_ENDPOINT = 100


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    extra = ["--served-model-name", MODEL, "--max-num-seqs", "8"]
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("property"), *extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.api, timeout=120, headers={"content-type": "application/json"}) as c:
        yield c


# ---- strategies from the JSON schema ----------------------------------------------------------------


def _bounds(schema: dict, lo=None, hi=None) -> tuple:
    """(low, high, low excluded, high excluded) as the schema says, else the given defaults."""
    lo = schema.get("minimum", schema.get("exclusiveMinimum", lo))
    hi = schema.get("maximum", schema.get("exclusiveMaximum", hi))
    return lo, hi, "exclusiveMinimum" in schema, "exclusiveMaximum" in schema


def _integers(schema: dict) -> st.SearchStrategy:
    lo, hi, open_lo, open_hi = _bounds(schema, -(2**63), 2**63 - 1)
    lo, hi = lo + open_lo, hi - open_hi
    # the small end of a wide range is where requests succeed: draw it as often as the rest
    return st.one_of(st.integers(lo, min(hi, lo + 64)), st.integers(lo, hi))


def _numbers(schema: dict) -> st.SearchStrategy:
    lo, hi, open_lo, open_hi = _bounds(schema)
    return st.floats(lo, hi, exclude_min=open_lo, exclude_max=open_hi, allow_nan=False, allow_infinity=False)


def _objects(schema: dict, defs: dict) -> st.SearchStrategy:
    # untyped properties (pydantic's Any) are the refused fields: they come in as mutations
    props = {k: v for k, v in schema.get("properties", {}).items() if _typed(v)}
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries({k: from_schema(v, defs) for k, v in props.items() if k in required},
                                 optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})


def _typed(schema: dict) -> bool:
    return bool({"type", "anyOf", "oneOf", "$ref", "enum", "const"} & set(schema))


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """A strategy for the values `schema` admits, for the subset of JSON schema pydantic writes."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", MAX_TEXT_CHARS), MAX_TEXT_CHARS))
    if kind == "integer":
        return _integers(schema)
    if kind == "number":
        return _numbers(schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", MAX_LIST_ITEMS), MAX_LIST_ITEMS))
    if kind == "object":
        return _objects(schema, defs)
    raise ValueError(f"no strategy for {schema}")


def schema_bodies(model) -> st.SearchStrategy:
    schema = model.model_json_schema()
    return _objects(schema, schema.get("$defs", {}))


COMPLETION_BODIES = schema_bodies(CompletionRequest)
CHAT_BODIES = schema_bodies(ChatCompletionRequest)


# ---- hostile values, and keeping valid requests cheap -----------------------------------------------

HOSTILE = st.one_of(
    st.sampled_from([2**63, -(2**63) - 1, 10**30, -(10**30), 2**64, float("nan"), float("inf"), float("-inf"),
                     "\ud800", "ok\udfff", [2**63], ["\ud800"], {"\udc00": 1}, True, None, "", [], {}]),
    st.integers(), st.floats(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
REFUSED = ["logit_bias", "response_format", "suffix", "tools", "tool_choice", "functions", "guided_json",
           "prompt_logprobs", "best_of", "use_beam_search", "echo", "length_penalty", "early_stopping",
           "beam_width", "chat_template", "an_unknown_extra"]


@st.composite
def request_bodies(draw, bodies: st.SearchStrategy, model, path: str) -> dict:
    body = draw(bodies)
    if draw(st.integers(0, 9)) < 8:
        body["model"] = MODEL
    fields = sorted(model.model_fields) + REFUSED
    for key in draw(st.lists(st.sampled_from(fields), max_size=2, unique=True)):
        body[key] = draw(HOSTILE)
    return _cheap(body, path, draw(st.integers(1, 3)))


def _cheap(body: dict, path: str, max_tokens: int) -> dict:
    """An in-range max_tokens becomes 1-3 tokens; chat without one would run to the context."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            body[key] = max_tokens
    if path == "/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = max_tokens
    return body


# ---- the property --------------------------------------------------------------------------------


def assert_answered(http: httpx.Client, path: str, body: dict) -> None:
    content = json.dumps(body).encode()  # Python's json: NaN literals and \\u escapes, as a client may send
    with http.stream("POST", path, content=content) as r:
        raw = r.read()
    assert r.status_code < 500, (r.status_code, raw[:500], body)
    if r.status_code >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [ln for ln in raw.decode().splitlines() if ln]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert not any(ln.startswith('data: {"error"') for ln in lines), lines
    else:
        assert "choices" in json.loads(raw), raw[:500]


SETTINGS = settings(max_examples=EXAMPLES_PER_ENDPOINT, suppress_health_check=[HealthCheck.too_slow,
                                                                                HealthCheck.data_too_large])


@SETTINGS
@given(body=request_bodies(COMPLETION_BODIES, CompletionRequest, "/completions"))
def test_completions_never_5xx(http, body):
    assert_answered(http, "/completions", body)


@SETTINGS
@given(body=request_bodies(CHAT_BODIES, ChatCompletionRequest, "/chat/completions"))
def test_chat_completions_never_5xx(http, body):
    assert_answered(http, "/chat/completions", body)


def test_the_worker_survived_and_the_pool_is_clean(server):
    assert [c.pid for c in psutil.Process(server.proc.pid).children()] == [server.worker_pid]
    m = wait_for(lambda: (m := server.metrics())["radixkv_num_requests_running"] == 0
                 and m["radixkv_num_requests_waiting"] == 0 and m, what="an idle engine")
    assert m["radixkv_worker_up"] == 1 and m["radixkv_kv_blocks_in_use"] == 0
    assert "Traceback" not in server.log()
