"""Bad input gets its status code and an OpenAI-style error naming the field, never a 500,
and the server keeps serving; bearer auth; per-key cache salts. One real server with two
API keys for the whole module."""

import httpx
import pytest
from test_server_harness import running_server

KEY_A, KEY_B = "key-alpha", "key-beta"
LONG_PROMPT = " ".join(f"entry {i} of the ledger reads {i * 31 % 97} coins;" for i in range(25))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    extra = ["--api-key", KEY_A, "--api-key", KEY_B, "--served-model-name", "tiny", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "512"]
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("api"), *extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.api, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as c:
        yield c


def completion(**kw):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in ((param,) if param else ()) + words:
        assert w in err["message"], err
    return err


BAD_COMPLETIONS = [
    (completion(max_tokens="5"), "max_tokens", "integer"),
    (completion(max_tokens=0), "max_tokens", "greater than"),
    (completion(max_tokens=1600), "max_tokens", "context"),
    (completion(n=0), "n", "greater than"),
    (completion(n=129), "n", "less than"),
    (completion(n=True), "n", "integer"),
    (completion(temperature="hot"), "temperature", "number"),
    (completion(temperature=2.5), "temperature", "less than"),
    (completion(top_p=0), "top_p", "greater than"),
    (completion(top_k=-2), "top_k", "greater than"),
    (completion(min_p=1.5), "min_p", "less than"),
    (completion(repetition_penalty=0), "repetition_penalty", "greater than"),
    (completion(presence_penalty=3), "presence_penalty", "less than"),
    (completion(seed=-1), "seed", "greater than"),
    (completion(stream="yes"), "stream", "boolean"),
    (completion(stop=""), "stop", "non-empty"),
    (completion(stop=["a"] * 17), "stop", "at most"),
    (completion(logprobs=21), "logprobs", "less than"),
    (completion(echo=True, logprobs=1), "echo", "not supported"),
    (completion(min_tokens=5, max_tokens=2), "min_tokens", "max_tokens"),
    (completion(best_of=1, n=2), "best_of", ">= n"),
    (completion(best_of=3, n=1, stream=True), "best_of", "streaming"),
    (completion(cache_salt=""), "cache_salt", "at least 1"),
    (completion(ignore_eos="true"), "ignore_eos", "boolean"),
    (completion(logit_bias={"5": 1.0}), "logit_bias", "not supported"),
    (completion(prompt={"text": "x"}), "prompt", "must be a string"),
    (completion(prompt=[]), "prompt", "must be a string"),
    (completion(prompt=[1, -2]), "prompt.1", "greater than or equal to 0"),
    (completion(prompt=[5000]), "prompt", "vocabulary"),
    (completion(stop_token_ids=[5000]), "stop_token_ids", "vocabulary"),
    (completion(prompt=["ok", ""]), "prompt.1", "empty"),
    (completion(prompt=" word" * 1600), "prompt", "context"),
    ({"prompt": "x"}, "model", "required"),
]


@pytest.mark.parametrize("body,param,word", BAD_COMPLETIONS, ids=[f"{p}-{w}" for _, p, w in BAD_COMPLETIONS])
def test_bad_completion_fields(http, body, param, word):
    assert_error(http.post("/completions", json=body), 400, param, word)


BAD_CHATS = [
    (chat(messages=[]), "messages", "at least 1"),
    (chat(messages="hi"), "messages", "list"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role", "user"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content.0.type", "'text'"),
    (chat(top_logprobs=2), "top_logprobs", "logprobs"),
    (chat(max_tokens=2, max_completion_tokens=2), "max_completion_tokens", "not both"),
    (chat(max_tokens=None, max_completion_tokens=2000), "max_completion_tokens", "context"),
    (chat(tools=[{"type": "function"}]), "tools", "not supported"),
    (chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage", "boolean"),
]


@pytest.mark.parametrize("body,param,word", BAD_CHATS, ids=[f"{p}-{w}" for _, p, w in BAD_CHATS])
def test_bad_chat_fields(http, body, param, word):
    assert_error(http.post("/chat/completions", json=body), 400, param, word)


def test_malformed_json_and_non_object_bodies(http):
    headers = {"content-type": "application/json"}
    assert_error(http.post("/completions", content=b'{"model": "tiny", "prompt": ', headers=headers), 400, None,
                 "malformed JSON")
    assert_error(http.post("/completions", content=b"[1, 2]", headers=headers), 400, None, "JSON object")
    assert_error(http.post("/chat/completions", content=b"", headers=headers), 400, None, "required")


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/completions", json=completion(model="gpt-9")), 404, "model", "gpt-9")
    assert err["code"] == "model_not_found"
    assert_error(http.post("/chat/completions", json=chat(model="nope")), 404, "model", "nope")


def test_engine_side_rejections_are_400(http):
    """Checks only the engine can make (its sequence limit) come back from the worker as 400
    with the engine's message and the field it names."""
    assert_error(http.post("/completions", json=completion(n=9)), 400, "n", "max_num_seqs")
    assert_error(http.post("/completions", json=completion(n=9, stream=True)), 400, "n", "max_num_seqs")


def test_oversized_body_is_413(http):
    r = http.post("/completions", content=b"x" * (33 * 1024 * 1024), headers={"content-type": "application/json"})
    assert_error(r, 413, None, "larger than")


def test_wrong_method_and_path(http):
    assert_error(http.get("/completions"), 405, None, "Method Not Allowed")
    assert_error(http.get("/nothing-here"), 404, None, "Not Found")


def test_auth(server):
    url = server.api + "/completions"
    assert_error(httpx.post(url, json=completion()), 401, None, "API key")
    assert_error(httpx.post(url, json=completion(), headers={"Authorization": "Bearer wrong"}), 401, None)
    assert_error(httpx.post(url, json=completion(), headers={"Authorization": KEY_A}), 401, None)  # no scheme
    # auth comes before parsing: no key + bad body is still 401
    assert_error(httpx.post(url, content=b"{", headers={"content-type": "application/json"}), 401, None)
    assert httpx.get(server.api + "/models").status_code == 401
    assert httpx.get(server.api + "/models", headers={"Authorization": f"Bearer {KEY_B}"}).json()["data"][0][
        "id"] == "tiny"
    # health and metrics stay open for probes and scrapers
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_each_key_gets_its_own_cache_even_with_the_same_salt(server):
    def cached(key, **kw):
        r = httpx.post(server.api + "/completions", json=completion(prompt=LONG_PROMPT, **kw),
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY_A) == 0
    assert cached(KEY_A) > 0  # same tenant: hit
    assert cached(KEY_B) == 0  # other tenant, same prompt: no hit
    assert cached(KEY_B, cache_salt="shared-room") == 0
    assert cached(KEY_B, cache_salt="shared-room") > 0
    # the same explicit salt from another key is another tenant's (--cache-salt-scope key)
    assert cached(KEY_A, cache_salt="shared-room") == 0


def test_still_serving_after_bad_input(server, http):
    r = http.post("/completions", json=completion(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/chat/completions", json=chat(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()  # nothing above raised inside the server
