"""`radixkv serve --stream-interval N`: a streamed chunk carries the text of up to N tokens of a
choice, the last chunk (finish_reason) goes out at once, and the streamed text is the text of the
same request not streamed, stop strings included. Plus the front's fast forms: the SSE bytes of
a text chunk equal the encoder's for the same dict, and the detokenizer's piece table gives what
decoding the window gives."""

import json
import math

import httpx
import msgspec
import pytest
from test_server_harness import running_server

from radixkv.output_processor import IncrementalDetokenizer, token_pieces

PROMPT = "The quick brown fox jumps over the lazy dog because"
MODEL = "tiny"
MAX_TOKENS = 21  # not a multiple of 3 or 8: the last chunk is a short one


@pytest.fixture(scope="module", params=[1, 3, 8])
def server(request, tiny_llama_dir, tmp_path_factory):
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("interval"), "--served-model-name", MODEL,
                        "--stream-interval", str(request.param)) as srv:
        srv.interval = request.param
        yield srv


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.api + path, json=dict(body, stream=True,
                                                          stream_options={"include_usage": True}), timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def body_of(api: str, **kw) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}
    if api == "chat":
        return "/chat/completions", dict(body, messages=[{"role": "user", "content": PROMPT}])
    return "/completions", dict(body, prompt=PROMPT)


def counts(usage: dict) -> tuple:
    """The token counts of a usage (the cached ones depend on what ran before)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def whole(server, api: str, **kw) -> dict:
    path, body = body_of(api, **kw)
    r = httpx.post(server.api + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if api == "chat" else choice["text"]
    return {"text": text, "finish_reason": choice["finish_reason"], "usage": out["usage"]}


def streamed(server, api: str, **kw) -> dict:
    path, body = body_of(api, **kw)
    chunks = events(server, path, body)
    with_choices = [c for c in chunks if c["choices"]]
    if api == "chat":
        assert with_choices[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        with_choices = with_choices[1:]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices)
    else:
        text = "".join(c["choices"][0]["text"] for c in with_choices)
    reasons = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert all(r is None for r in reasons[:-1])
    return {"text": text, "finish_reason": reasons[-1], "usage": chunks[-1]["usage"], "chunks": len(with_choices)}


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_streamed_text_equals_the_whole_and_chunks_carry_up_to_n_tokens(server, api):
    full, st = whole(server, api), streamed(server, api)
    assert st["text"] == full["text"] and st["finish_reason"] == full["finish_reason"] == "length"
    assert counts(st["usage"]) == counts(full["usage"]) and full["usage"]["completion_tokens"] == MAX_TOKENS
    assert st["chunks"] == math.ceil(MAX_TOKENS / server.interval)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_with_a_stop_string_the_streamed_text_equals_the_whole(server, api):
    text = whole(server, api)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    full, st = whole(server, api, stop=[stop]), streamed(server, api, stop=[stop])
    assert st["text"] == full["text"] == text[: text.index(stop)]
    assert st["finish_reason"] == full["finish_reason"] == "stop"
    assert counts(st["usage"]) == counts(full["usage"])
    assert st["chunks"] <= math.ceil(full["usage"]["completion_tokens"] / server.interval)


def test_n_samples_each_stream_their_whole_text(server):
    path, body = body_of("completions", n=2, temperature=1.0, seed=7)
    chunks = events(server, path, body)
    texts, counts = ["", ""], [0, 0]
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            counts[ch["index"]] += 1
    r = httpx.post(server.api + path, json=body, timeout=60).json()
    assert texts == [ch["text"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]
    assert counts == [math.ceil(MAX_TOKENS / server.interval)] * 2


# ---- the fast forms, without a server ------------------------------------------------------------


def test_a_text_chunk_s_bytes_equal_the_encoders():
    from types import SimpleNamespace

    from tokenizer_server.serving_chat import CONTENT_KEY, CONTENT_TAIL
    from tokenizer_server.serving_common import ChunkMaker, sse
    from tokenizer_server.serving_completions import TEXT_KEY, TEXT_TAIL

    group = SimpleNamespace(request_id="cmpl-\"x\"\\")
    req = SimpleNamespace(model="m\u00e9\"\n", stream_options=None)
    for text in ["", "plain", " \"quoted\"\\ \n\t\u0001", "\u00e9\u4e2d\U0001f600\ufffd", "</script>"]:
        for index in (0, 7, 123):
            chat = ChunkMaker(group, "chat.completion.chunk", 1700000000, req)
            assert chat.text_event(index, CONTENT_KEY, text, CONTENT_TAIL) == sse(chat([
                {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]))
            cmpl = ChunkMaker(group, "text_completion", 1700000000, req)
            assert cmpl.text_event(index, TEXT_KEY, text, TEXT_TAIL) == sse(cmpl([
                {"index": index, "text": text, "logprobs": None, "finish_reason": None}]))
    assert msgspec.json.decode(chat.text_event(1, CONTENT_KEY, "a", CONTENT_TAIL)[len(b"data: "):])


class _NoPieces:
    """The tokenizer, seen as one the piece table does not apply to: the decoding window only."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids, **kw):
        return self._tokenizer.decode(ids, **kw)


def test_the_piece_table_gives_what_the_window_gives(tiny_llama_dir):
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    assert token_pieces(tok) is not None and token_pieces(_NoPieces(tok)) is None
    text = "Caf\u00e9 \u4e2d\u6587 \U0001f600 emoji, plain words; \u00fcber  double  spaces\n\nnew lines \u2014 dash"
    rng = random.Random(0)
    ids = tok.encode(text, add_special_tokens=False)
    cases = [ids, [rng.randrange(len(tok)) for _ in range(200)], ids + [0, 1, 2] + ids]
    for case in cases:
        for skip in (True, False):
            for prompt in ([], ids[:7], [rng.randrange(len(tok)) for _ in range(9)]):
                fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
                slow = IncrementalDetokenizer(_NoPieces(tok), prompt, skip_special_tokens=skip)
                assert slow._pieces is None
                pos = 0
                while pos < len(case):
                    step = rng.choice([1, 1, 1, 2, 3])
                    assert fast.push(case[pos : pos + step]) == slow.push(case[pos : pos + step])
                    pos += step
                assert fast.flush() == slow.flush()
