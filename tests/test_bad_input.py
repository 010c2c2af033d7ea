"""Hostile and malformed bodies get a 400 (or 404) in the OpenAI error shape, naming the field at
fault, and never reach the engine: after each one a valid request still succeeds, the engine
worker is the one the server started with, and an idle pool holds no block. Bodies go out as
raw JSON text, so NaN and Infinity literals, lone-surrogate escapes and ints past int64 arrive
exactly as a hostile client writes them. One real server for the whole module; beside it, what
the front makes of the engine's answers (a rejection naming a field, a failed request, a dead
worker), with a stand-in for the engine client."""

import asyncio
import json
from dataclasses import dataclass

import httpx
import psutil
import pytest
from test_server_harness import running_server, wait_for

from radixkv import protocol as P
from tokenizer_server.api_models import MAX_SEED
from tokenizer_server.client import WorkerUnavailable
from tokenizer_server.errors import APIError
from tokenizer_server.generation import GenerationGroup
from tokenizer_server.metrics import ServerMetrics
from tokenizer_server.serving_common import stream

MODEL = "tiny"
VOCAB = 2048  # the tiny model's
NAN, INF = float("nan"), float("inf")
BIG = 10**30  # past int64 and uint64
INT64_OVER = 2**63


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    extra = ["--served-model-name", MODEL, "--max-num-seqs", "8"]
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("bad-input"), *extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.api, timeout=60, headers={"content-type": "application/json"}) as c:
        yield c


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


def drop(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


@dataclass
class Case:
    path: str  # "/completions" or "/chat/completions"
    body: object  # dumped with Python's json (NaN literals, \\u escapes); bytes go out as they are
    param: str | None
    status: int = 400

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def both(param: str, *fields: dict, status: int = 400) -> list[Case]:
    """The same bad sampling fields on both endpoints."""
    return [Case(p, make(**f), param, status) for f in fields for p, make in
            (("/completions", cmpl), ("/chat/completions", chat))]


def completions(param: str, *bodies: dict) -> list[Case]:
    return [Case("/completions", b, param) for b in bodies]


def chats(param: str, *bodies: dict) -> list[Case]:
    return [Case("/chat/completions", b, param) for b in bodies]


BEAM = dict(use_beam_search=True, n=2)

CASES = [
    # the two crashes this suite was written for: top_k past int64, as a hostile client sent it
    *both("top_k", dict(max_tokens=4, temperature=1.0, top_p=0.5, top_k=INT64_OVER),
          dict(max_tokens=4, temperature=1.0, top_p=0.5, top_k=BIG), dict(top_k=-2), dict(top_k=1.5),
          dict(top_k="5"), dict(top_k=True)),
    *both("stop_token_ids.0", dict(stop_token_ids=[BIG]), dict(stop_token_ids=[INT64_OVER]),
          dict(stop_token_ids=[-1]), dict(stop_token_ids=[1.5]), dict(stop_token_ids=[True])),
    *both("stop_token_ids", dict(stop_token_ids=[VOCAB]), dict(stop_token_ids=list(range(257))),
          dict(stop_token_ids="5")),
    # ints: past int64, past their caps, wrong types
    *both("n", dict(n=0), dict(n=129), dict(n=BIG), dict(n=INT64_OVER), dict(n="2"), dict(n=1.5), dict(n=True),
          dict(n=None)),
    *both("max_tokens", dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=BIG), dict(max_tokens=2**31),
          dict(max_tokens="5"), dict(max_tokens=2.0), dict(max_tokens=True), dict(max_tokens=1600)),
    *both("seed", dict(seed=-1), dict(seed=MAX_SEED), dict(seed=INT64_OVER), dict(seed=BIG), dict(seed="1")),
    *both("min_tokens", dict(min_tokens=-1), dict(min_tokens=2**31), dict(min_tokens=BIG),
          dict(min_tokens=5, max_tokens=2)),
    # floats: out of range, NaN and infinities (JSON literals Python's parser accepts), wrong types
    *both("temperature", dict(temperature=-0.1), dict(temperature=2.5), dict(temperature=NAN), dict(temperature=INF),
          dict(temperature=-INF), dict(temperature="hot"), dict(temperature=True), dict(temperature=BIG)),
    *both("top_p", dict(top_p=0), dict(top_p=1.5), dict(top_p=NAN), dict(top_p=-INF)),
    *both("min_p", dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=NAN)),
    *both("presence_penalty", dict(presence_penalty=2.5), dict(presence_penalty=NAN)),
    *both("frequency_penalty", dict(frequency_penalty=-3), dict(frequency_penalty=INF)),
    *both("repetition_penalty", dict(repetition_penalty=0), dict(repetition_penalty=11), dict(repetition_penalty=NAN)),
    # stop strings: empty, too many, too long, not strings, invalid text
    *both("stop", dict(stop=""), dict(stop=["a"] * 17), dict(stop="x" * 257), dict(stop=5), dict(stop={"a": 1}),
          dict(stop="\ud800")),
    *both("stop.1", dict(stop=["a", ""]), dict(stop=["ok", "\udfff"])),
    *both("stop.0", dict(stop=[5])),
    # strings beside the prompt
    *both("user", dict(user=5), dict(user="x" * 257), dict(user="a\ud800b")),
    *both("cache_salt", dict(cache_salt=""), dict(cache_salt=5), dict(cache_salt="x" * 257),
          dict(cache_salt="\udbff")),
    *both("model", dict(model=5), dict(model="x" * 1025), dict(model="\ud800")),
    *both("model", dict(model="nope"), status=404),
    *both("stream", dict(stream="yes"), dict(stream=1)),
    *both("stream_options", dict(stream_options={"include_usage": True}), dict(stream=True, stream_options="x")),
    *both("stream_options.bogus", dict(stream=True, stream_options={"bogus": 1})),
    *both("stream_options.include_usage", dict(stream=True, stream_options={"include_usage": "yes"})),
    *both("ignore_eos", dict(ignore_eos="true"), dict(ignore_eos=1)),
    *both("skip_special_tokens", dict(skip_special_tokens=0)),
    # fields that would change the answer, not implemented: refused by name
    *both("logit_bias", dict(logit_bias={"5": 1.0}), dict(logit_bias={"abc": 1}), dict(logit_bias=[1]),
          dict(logit_bias={"5": NAN})),
    *both("response_format", dict(response_format={"type": "json_object"}), dict(response_format="json"),
          dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})),
    *both("guided_json", dict(guided_json={"type": "object"})),
    *both("guided_regex", dict(guided_regex="a+")),
    *both("guided_choice", dict(guided_choice=["a", "b"])),
    *both("guided_grammar", dict(guided_grammar="root ::= 'a'")),
    *both("structured_outputs", dict(structured_outputs={"regex": "a+"})),
    *both("prompt_logprobs", dict(prompt_logprobs=1)),
    *both("include_stop_str_in_output", dict(include_stop_str_in_output=True)),
    # completions: the prompt's shapes, token ids, counts, text, context
    *completions("prompt", drop(cmpl(), "prompt"), cmpl(prompt=None), cmpl(prompt=5), cmpl(prompt={"text": "x"}),
                 cmpl(prompt=[]), cmpl(prompt=[VOCAB]), cmpl(prompt=" word" * 1600), cmpl(prompt=[" word" * 1600]),
                 cmpl(prompt="\ud800"), cmpl(prompt=[[1]] * 1025), cmpl(prompt=["a"] * 1025),
                 cmpl(prompt=[0] * (2**20 + 1))),
    *completions("prompt.1", cmpl(prompt=[1, -2]), cmpl(prompt=[1, INT64_OVER]), cmpl(prompt=[1, BIG]),
                 cmpl(prompt=[1, 1.5]), cmpl(prompt=[1, True]), cmpl(prompt=[[1], []]), cmpl(prompt=["a", 3]),
                 cmpl(prompt=["ok", ""]), cmpl(prompt=["ok", "\ud800"]), cmpl(prompt=[[1], [VOCAB]])),
    *completions("prompt.0", cmpl(prompt=[[]]), cmpl(prompt=[True])),
    *completions("prompt.1.1", cmpl(prompt=[[1], [2, "x"]])),
    *completions("echo", cmpl(echo="yes"), cmpl(echo=True, logprobs=1)),
    *completions("logprobs", cmpl(logprobs=-1), cmpl(logprobs=21), cmpl(logprobs=True), cmpl(logprobs=1.5),
                 cmpl(logprobs=BIG)),
    *completions("suffix", cmpl(suffix="and then")),
    *completions("best_of", cmpl(best_of=0), cmpl(best_of=129), cmpl(best_of=1, n=2), cmpl(best_of="2"),
                 cmpl(best_of=3, stream=True)),
    # completions: beam search and the fields that only mean something with it
    *completions("use_beam_search", cmpl(use_beam_search="yes"), cmpl(**BEAM, stream=True),
                 cmpl(use_beam_search=True)),
    *completions("top_p", cmpl(**BEAM, top_p=0.5)),
    *completions("top_k", cmpl(**BEAM, top_k=5)),
    *completions("min_p", cmpl(**BEAM, min_p=0.1)),
    *completions("repetition_penalty", cmpl(**BEAM, repetition_penalty=1.2)),
    *completions("presence_penalty", cmpl(**BEAM, presence_penalty=0.5)),
    *completions("n", cmpl(use_beam_search=True, n=3, beam_width=2)),
    *completions("best_of", cmpl(**BEAM, best_of=3, beam_width=2)),
    *completions("beam_width", cmpl(**BEAM, beam_width=1), cmpl(**BEAM, beam_width=129), cmpl(beam_width=2)),
    *completions("length_penalty", cmpl(**BEAM, length_penalty=NAN), cmpl(**BEAM, length_penalty=11),
                 cmpl(**BEAM, length_penalty=-INF), cmpl(**BEAM, length_penalty="x"), cmpl(length_penalty=0.5)),
    *completions("early_stopping", cmpl(**BEAM, early_stopping="always"), cmpl(**BEAM, early_stopping=1),
                 cmpl(early_stopping=True), cmpl(early_stopping="never")),
    # chat: messages, their content and parts
    *chats("messages", drop(chat(), "messages"), chat(messages=[]), chat(messages="hi"),
           chat(messages=[{"role": "user", "content": "hi"}] * 1025), chat(**user(" word" * 1600))),
    *chats("messages.0", chat(messages=[5])),
    *chats("messages.0.role", chat(messages=[{"role": "wizard", "content": "x"}]), chat(messages=[{"content": "x"}]),
           chat(messages=[{"role": "function", "content": "x"}])),
    *chats("messages.0.content", chat(**user(5)), chat(**user("\ud800")), chat(**user({"text": "x"})),
           chat(**user([{"type": "text", "text": "x"}] * 257))),
    *chats("messages.0.content.0.type", chat(**user([{"type": "image_url", "image_url": {"url": "x"}}])),
           chat(**user([{"text": "x"}]))),
    *chats("messages.0.content.0.text", chat(**user([{"type": "text"}])), chat(**user([{"type": "text", "text": 5}])),
           chat(**user([{"type": "text", "text": "ok\udc00"}]))),
    *chats("messages.0.name", chat(messages=[{"role": "user", "content": "x", "name": "\ud800"}]),
           chat(messages=[{"role": "user", "content": "x", "name": 5}]),
           chat(messages=[{"role": "user", "content": "x", "name": "n" * 257}])),
    *chats("messages.0.tool_calls",
           chat(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}])),
    # chat: its own numbers and switches
    *chats("max_completion_tokens", chat(max_tokens=None, max_completion_tokens=0),
           chat(max_tokens=None, max_completion_tokens=BIG), chat(max_tokens=None, max_completion_tokens=2000),
           chat(max_completion_tokens=2)),
    *chats("logprobs", chat(logprobs="yes"), chat(logprobs=1)),
    *chats("top_logprobs", chat(logprobs=True, top_logprobs=21), chat(logprobs=True, top_logprobs=-1),
           chat(top_logprobs=2)),
    *chats("add_generation_prompt", chat(add_generation_prompt="yes")),
    # chat: fields it does not implement, refused by name
    *chats("tools", chat(tools=[{"type": "function", "function": {"name": "f"}}]), chat(tools="x")),
    *chats("tool_choice", chat(tool_choice="auto"), chat(tool_choice={"type": "function", "function": {"name": "f"}})),
    *chats("parallel_tool_calls", chat(parallel_tool_calls=True), chat(parallel_tool_calls=False)),
    *chats("functions", chat(functions=[{"name": "f"}])),
    *chats("function_call", chat(function_call="auto")),
    *chats("best_of", chat(best_of=2)),
    *chats("use_beam_search", chat(use_beam_search=True)),
    *chats("echo", chat(echo=True)),
    *chats("audio", chat(audio={"voice": "alloy", "format": "wav"})),
    *chats("modalities", chat(modalities=["text", "audio"])),
    *chats("prediction", chat(prediction={"type": "content", "content": "x"})),
    *chats("web_search_options", chat(web_search_options={})),
    *chats("chat_template", chat(chat_template="{{ messages }}")),
    *chats("chat_template_kwargs", chat(chat_template_kwargs={"enable_thinking": True})),
    *chats("continue_final_message", chat(continue_final_message=True)),
    *chats("documents", chat(documents=[{"text": "x"}])),
    # bodies that are not a JSON object, or not JSON at all: no field to name
    Case("/completions", b'{"model": "tiny", "prompt": ', None),
    Case("/completions", b"[1, 2]", None),
    Case("/chat/completions", b"", None),
    Case("/chat/completions", b'"hi"', None),
    Case("/completions", b'{"model": "tiny", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", None),
    Case("/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}', "max_tokens"),
    Case("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
]

# After each bad request, one of these must succeed: edge values that are in range, cheap.
VALID = [
    ("/completions", cmpl(max_tokens=1)),
    ("/chat/completions", chat(max_tokens=1)),
    ("/completions", cmpl(top_k=2**63 - 1)),  # at least the vocabulary: off
    ("/chat/completions", chat(top_k=VOCAB, top_p=1e-9, min_p=1.0)),
    ("/completions", cmpl(top_k=0, seed=MAX_SEED - 1, temperature=2.0)),
    ("/chat/completions", chat(stop=["x" * 256] * 16, stop_token_ids=[VOCAB - 1], min_tokens=1)),
    ("/completions", cmpl(prompt=[[1, 2], [VOCAB - 1]], max_tokens=1, n=2)),
    ("/chat/completions", chat(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={},
                               modalities=["text"], user="u" * 256, cache_salt="s" * 256)),
    ("/completions", cmpl(use_beam_search=True, n=2, beam_width=2, length_penalty=10.0, early_stopping="never")),
    ("/completions", cmpl(use_beam_search=True, best_of=2, length_penalty=-10.0, early_stopping=True,
                          top_k=VOCAB)),
    ("/chat/completions", chat(**user([{"type": "text", "text": "h\u00e9 \u4e2d \U0001f600"}] * 3))),
    ("/completions", cmpl(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=10.0, min_p=0.0)),
    ("/completions", cmpl(logprobs=20, max_tokens=1, echo=False)),
    ("/chat/completions", chat(logprobs=True, top_logprobs=20, max_tokens=None, max_completion_tokens=1)),
    ("/completions", cmpl(stream=True, stream_options={"include_usage": True}, best_of=1)),
    ("/chat/completions", chat(stream=True, n=2, temperature=0)),
]


def case_id(i: int, c: Case) -> str:
    return f"{i:03d}-{'chat' if c.path.startswith('/chat') else 'cmpl'}-{c.param}"


def assert_error(r: httpx.Response, case: Case) -> dict:
    assert r.status_code == case.status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == case.param, err
    assert err["type"] == ("not_found_error" if case.status == 404 else "invalid_request_error"), err
    assert isinstance(err["message"], str) and err["message"], err
    if case.param is not None:
        assert err["message"].startswith(case.param), err
    return err


def assert_serves(http: httpx.Client, path: str, body: dict) -> None:
    if not body.get("stream"):
        r = http.post(path, content=json.dumps(body).encode())
        assert r.status_code == 200, (body, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1, r.text
        return
    with http.stream("POST", path, content=json.dumps(body).encode()) as r:
        assert r.status_code == 200, (body, r.read())
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines), lines[-3:]


def test_there_are_enough_cases():
    assert len(CASES) >= 150, len(CASES)
    assert {c.path for c in CASES} == {"/completions", "/chat/completions"}


@pytest.mark.parametrize("i,case", list(enumerate(CASES)), ids=[case_id(i, c) for i, c in enumerate(CASES)])
def test_bad_input_is_refused_by_name_and_the_server_still_serves(http, i, case):
    assert_error(http.post(case.path, content=case.content()), case)
    assert_serves(http, *VALID[i % len(VALID)])


# ---- what the engine answers: a rejection names its field, a failure is a generic 500 -------------


class FakeClient:
    """An EngineClient that keeps what the group sends; deltas are put on its queue by hand."""

    def __init__(self, unavailable: str | None = None):
        self.unavailable, self.sinks, self.aborted = unavailable, {}, []

    def add_request(self, req, sink) -> None:
        if self.unavailable is not None:
            raise WorkerUnavailable(self.unavailable)
        self.sinks[req.request_id] = sink

    def abort(self, request_ids) -> None:
        self.aborted += list(request_ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)


def group_of(tokenizer, client, n: int = 1) -> GenerationGroup:
    metrics = ServerMetrics(lambda: None, lambda: True)
    group = GenerationGroup(client, tokenizer, metrics, "cmpl-x", [[1, 2, 3]], P.SamplingOptions(n=n, max_tokens=4))
    group.start()
    return group


def delta(*finish_reasons, finished=False) -> P.RequestDelta:
    choices = [P.ChoiceDelta(i, [5], finish_reason=f) for i, f in enumerate(finish_reasons)]
    return P.RequestDelta("cmpl-x", choices, 3, 0, finished)


def test_a_worker_rejection_is_a_400_naming_its_field(tokenizer):
    client = FakeClient()
    group = group_of(tokenizer, client)
    client.sinks["cmpl-x"].put_nowait(P.RequestRejected("cmpl-x", "n: 9 sequences exceed max_num_seqs (8)", "n"))
    with pytest.raises(APIError) as e:
        asyncio.run(group.next_events())
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "n"


def test_an_engine_failure_is_a_generic_500_and_aborts_the_rest(tokenizer):
    client = FakeClient()
    group = group_of(tokenizer, client, n=2)
    client.sinks["cmpl-x"].put_nowait(delta("error", None))
    with pytest.raises(APIError) as e:
        asyncio.run(group.next_events())
    assert e.value.status == 500
    assert e.value.body()["error"] == {"message": "the engine failed while generating this request",
                                       "type": "server_error", "param": None, "code": "engine_error"}
    assert client.aborted == ["cmpl-x"]  # the sample still running is stopped


def test_an_engine_failure_mid_stream_is_an_error_event_then_done(tokenizer):
    client = FakeClient()
    group = group_of(tokenizer, client)

    async def body() -> list[bytes]:
        client.sinks["cmpl-x"].put_nowait(delta(None))
        first = await group.wait_started()  # here the response commits to 200
        client.sinks["cmpl-x"].put_nowait(delta("error", finished=True))
        response = stream(group, first, lambda events: [{"text": ev.text} for ev in events], lambda: [])
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(body())
    assert chunks[0].startswith(b"data: {") and b"error" not in chunks[0]
    error = json.loads(chunks[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    assert chunks[-1] == b"data: [DONE]\n\n"


def test_a_dead_worker_is_a_503_with_the_short_reason_only(tokenizer):
    with pytest.raises(APIError) as e:
        group_of(tokenizer, FakeClient(unavailable="engine worker died"))
    assert e.value.status == 503
    assert e.value.body()["error"]["message"] == "the engine is unavailable: engine worker died"


def test_the_crash_cases_never_reached_the_engine(server):
    """Last: the worker is the one started with the server, and the pool is clean once idle."""
    children = psutil.Process(server.proc.pid).children()
    assert [c.pid for c in children] == [server.worker_pid]
    m = wait_for(lambda: (m := server.metrics())["radixkv_num_requests_running"] == 0
                 and m["radixkv_num_requests_waiting"] == 0 and m, what="an idle engine")
    assert m["radixkv_worker_up"] == 1
    assert m["radixkv_kv_blocks_in_use"] == 0
    assert "Traceback" not in server.log()
