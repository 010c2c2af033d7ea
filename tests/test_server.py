"""The real server (front + engine worker over ZeroMQ) on the tiny Llama, through the
official `openai` client and httpx: outputs equal the offline LLM, streaming equals
non-streaming, the prefix cache shows in usage and is salted, load and aborts leave
the pool clean."""

import asyncio
import json

import httpx
import openai
import pytest
from openai import OpenAI
from test_server_harness import running_server, wait_for

PROMPT = "The quick brown fox jumps over the lazy dog because"
LONG_PROMPT = " ".join(f"item {i} is the {i * 7 % 13}th colour of the rainbow;" for i in range(30))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from radixkv.engine.llm import LLM

    return LLM(str(tiny_llama_dir), device="cpu", num_blocks=96)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


def greedy(llm, prompt, max_tokens, **kw):
    from radixkv.engine.sampling_params import SamplingParams

    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_equals_offline_llm(server, client, llm, tokenizer):
    ref = greedy(llm, PROMPT, 12)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == tokenizer.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_token_id_prompts_and_several_prompts(server, client, llm, tokenizer):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=server.model, prompt=[ids, ids[:5]], max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, [ids, ids[:5]]):
        assert c.text == tokenizer.decode(greedy(llm, p, 6).outputs[0].token_ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) + 5


def test_chat_equals_offline_llm_on_the_template(server, client, llm, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
    ref = greedy(llm, ids, 10)
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tokenizer.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_equals_non_streaming(server, client):
    kw = dict(model=server.model, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.api + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert all("choices" in json.loads(ln[6:]) for ln in lines[:-1])


def test_n2_greedy_and_seeded(server, client, llm, tokenizer):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    # seeded sampling: sample i of a request with seed s equals a lone request with seed s + i
    kw = dict(model=server.model, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    pair = client.completions.create(prompt=PROMPT, n=2, seed=11, **kw)
    lone = [client.completions.create(prompt=PROMPT, seed=s, **kw).choices[0].text for s in (11, 12)]
    assert [c.text for c in pair.choices] == lone
    assert pair.usage.completion_tokens == 16
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=4, temperature=0, stream=True)
    texts = ["", ""]
    for c in r:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1]


def test_beam_search_equals_offline_llm(server, client, llm, tokenizer):
    from radixkv.engine.sampling_params import SamplingParams

    params = SamplingParams(n=2, use_beam_search=True, beam_width=3, length_penalty=0.7, max_tokens=6)
    ref = llm.generate(PROMPT, params)[0]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=2,
                                  extra_body={"use_beam_search": True, "beam_width": 3, "length_penalty": 0.7})
    want = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in ref.outputs]
    assert [c.text for c in r.choices] == want
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})


def test_prefix_cache_hits_show_in_usage_and_are_salted(server, client):
    kw = dict(model=server.model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    first = client.completions.create(**kw, extra_body={"cache_salt": "salt-a"})
    second = client.completions.create(**kw, extra_body={"cache_salt": "salt-a"})
    other = client.completions.create(**kw, extra_body={"cache_salt": "salt-b"})
    n = first.usage.prompt_tokens
    assert n > 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].text == first.choices[0].text == other.choices[0].text


def test_stop_strings_cut_output(server, client):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:8]
    assert len(stop) == 3 and stop not in full[:5]
    r = client.completions.create(stop=[stop, "@@never@@"], **kw)
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_echo_and_logprobs(server, client, tokenizer):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    if "\ufffd" not in "".join(lp.tokens):  # tokens that split a character do not add up
        assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(val)  # greedy: the sampled token is the most likely
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) >= 3 and c.logprob <= 0 for c in content)


async def _stream_one(client, url, body):
    usage, text = None, ""
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                text += c["text"]
    return usage, text


def test_200_concurrent_streams_then_clean_pool(server):
    checks_before = server.metrics()["radixkv_cache_invariant_checks_total"]

    async def run():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:
            bodies = [{"model": server.model, "prompt": f"Request {i}: count", "max_tokens": 4, "temperature": 0,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
                      for i in range(200)]
            return await asyncio.gather(*(_stream_one(c, server.api + "/completions", b) for b in bodies))

    results = asyncio.run(run())
    assert len(results) == 200
    for usage, _ in results:
        assert usage["completion_tokens"] == 4
    m = wait_for(lambda: (m := server.metrics())["radixkv_num_requests_running"] == 0 and m)
    assert m["radixkv_kv_blocks_in_use"] == 0 and m["radixkv_num_requests_waiting"] == 0
    assert m["radixkv_cache_invariant_checks_total"] > checks_before  # the worker checked at idle
    assert m["radixkv_kv_blocks_free"] + m["radixkv_kv_blocks_evictable"] == m["radixkv_kv_blocks_total"]


def test_100_aborted_streams_leave_no_block_in_use(server, client):
    async def one(c, i):
        body = {"model": server.model, "prompt": f"Abort me {i} please", "max_tokens": 200, "temperature": 0,
                "stream": i % 3 != 2, "ignore_eos": True}
        if i % 3:  # hang up before the first token (possibly still queued), or during a non-streamed request
            task = asyncio.ensure_future(c.post(server.api + "/completions", json=body))
            await asyncio.sleep(0.05 * (i % 7))
            task.cancel()
            return
        async with c.stream("POST", server.api + "/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # hang up after the first token

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=150)) as c:
            await asyncio.gather(*(one(c, i) for i in range(100)))

    generated_before = server.metrics()["radixkv_generation_tokens_total"]
    asyncio.run(run())
    m = wait_for(lambda: (m := server.metrics())["radixkv_num_requests_running"] == 0
                 and m["radixkv_num_requests_waiting"] == 0 and m)
    assert m["radixkv_kv_blocks_in_use"] == 0
    # the hang-ups stopped them: run to the end, they would make 100 x 200 = 20,000 tokens
    assert m["radixkv_generation_tokens_total"] - generated_before < 10_000
    # and the server still answers
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_metrics_exposition(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("radixkv_kv_cache_usage_fraction", "radixkv_kv_blocks_free", "radixkv_kv_blocks_evictable",
                 "radixkv_kv_blocks_in_use", "radixkv_prefix_cache_queries_tokens_total",
                 "radixkv_prefix_cache_hits_tokens_total", "radixkv_num_requests_running",
                 "radixkv_num_requests_waiting", "radixkv_num_preemptions_total", "radixkv_prompt_tokens_total",
                 "radixkv_generation_tokens_total", "radixkv_time_to_first_token_seconds_bucket",
                 "radixkv_inter_token_latency_seconds_bucket", "radixkv_worker_up 1.0"):
        assert name in text, name
    m = server.metrics()
    assert m["radixkv_prefix_cache_hits_tokens_total"] > 0  # the salted test above hit
    assert m["radixkv_time_to_first_token_seconds_count"] > 0
