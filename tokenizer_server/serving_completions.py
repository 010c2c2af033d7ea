"""POST /v1/completions: text or token-id prompts (one or many), n, echo, logprobs, streaming."""

import time

from fastapi import Request

from tokenizer_server.api_models import CompletionRequest
from tokenizer_server.errors import bad_request
from tokenizer_server.generation import GenerationGroup
from tokenizer_server.serving_common import (
    ChunkMaker,
    ServerState,
    build_sampling,
    check_model,
    check_prompt_length,
    check_stream_options,
    check_token_ids,
    collect,
    effective_salt,
    new_id,
    resolve_max_tokens,
    start_stream,
    stream,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
TEXT_KEY, TEXT_TAIL = b'"text":', b',"logprobs":null,"finish_reason":null}'


def token_strings(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


class _CompletionLogprobs:
    """The legacy completions logprobs object, built per choice, chunk by chunk."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offsets: dict[int, int] = {}  # choice -> text offset of its next token

    def part(self, ev) -> dict | None:
        if ev.logprobs is None:
            return None
        toks = token_strings(self.tokenizer, ev.token_ids)
        offsets, pos = [], self.offsets.get(ev.index, 0)
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        self.offsets[ev.index] = pos
        top = None
        if ev.top_logprobs is not None:
            top = [{self.tokenizer.decode([tid]): lp for tid, lp in d.items()} for d in ev.top_logprobs]
        return {"tokens": toks, "token_logprobs": list(ev.logprobs), "top_logprobs": top, "text_offset": offsets}


def _merge_logprobs(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
    for p in parts:
        out["tokens"] += p["tokens"]
        out["token_logprobs"] += p["token_logprobs"]
        out["text_offset"] += p["text_offset"]
        if p["top_logprobs"] is not None:
            out["top_logprobs"] = (out["top_logprobs"] or []) + p["top_logprobs"]
    return out


async def tokenize_prompts(state: ServerState, raw: list) -> list[list[int]]:
    """Token ids of every prompt (text or ids), each checked against the model; text prompts are
    encoded together, off the event loop when long."""
    info = state.model_info
    params = ["prompt"] if len(raw) == 1 else [f"prompt.{i}" for i in range(len(raw))]
    for p, param in zip(raw, params):
        if not isinstance(p, str):
            check_prompt_length(info, len(p), param)  # first: it bounds the vocabulary scan
            check_token_ids(info, p, param)
    texts = [(i, p) for i, p in enumerate(raw) if isinstance(p, str)]
    encoded = await state.async_tokenizer.encode([p for _, p in texts], max_tokens=info.max_model_len - 1)
    prompts = list(raw)
    for (i, _), enc in zip(texts, encoded):
        check_prompt_length(info, enc.num_tokens, params[i])
        prompts[i] = enc.token_ids
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    check_model(state, req.model)
    tok = state.tokenizer
    if req.echo and req.logprobs is not None:
        raise bad_request("echo", "echo together with logprobs is not supported (prompt logprobs are not computed)")
    check_stream_options(req)
    raw = req.prompts()
    prompts = await tokenize_prompts(state, raw)
    info = state.model_info
    max_tokens = resolve_max_tokens(info, [len(p) for p in prompts], req.max_tokens, DEFAULT_MAX_TOKENS)
    sampling = build_sampling(req, info, max_tokens, req.logprobs)
    group = GenerationGroup(
        state.supervisor.client, tok, state.metrics, new_id("cmpl"), prompts, sampling,
        cache_salt=effective_salt(request, req.cache_salt), stream_interval=state.stream_interval if req.stream else 1,
    )
    created = int(time.time())
    echo_texts = [(p if isinstance(p, str) else tok.decode(ids)) for p, ids in zip(raw, prompts)] if req.echo else None
    echoed: set[int] = set()
    logprobs = _CompletionLogprobs(tok)

    def text_of(ev) -> str:
        if echo_texts is not None and ev.index not in echoed:
            echoed.add(ev.index)
            return echo_texts[ev.index // req.n] + ev.text
        return ev.text

    group.start()
    if req.stream:
        first = await start_stream(group, request)

        chunk = ChunkMaker(group, "text_completion", created, req)

        def to_chunks(events):
            return [
                chunk.text_event(ev.index, TEXT_KEY, text_of(ev), TEXT_TAIL)  # the common chunk, its bytes at once
                if ev.logprobs is None and ev.finish_reason is None else
                chunk([{"index": ev.index, "text": text_of(ev), "logprobs": logprobs.part(ev),
                        "finish_reason": ev.finish_reason}])
                for ev in events
            ]

        return stream(group, first, to_chunks, chunk.tail)

    events = await collect(group, request)
    num_choices = len(prompts) * req.n
    texts = [""] * num_choices
    parts: list[list[dict]] = [[] for _ in range(num_choices)]
    finish = [None] * num_choices
    for ev in events:
        texts[ev.index] += text_of(ev)
        if (p := logprobs.part(ev)) is not None:
            parts[ev.index].append(p)
        finish[ev.index] = ev.finish_reason or finish[ev.index]
    choices = [
        {"index": i, "text": texts[i], "logprobs": _merge_logprobs(parts[i]) if req.logprobs is not None else None,
         "finish_reason": finish[i]}
        for i in range(num_choices)
    ]
    return {"id": group.request_id, "object": "text_completion", "created": created, "model": req.model,
            "choices": choices, "usage": group.usage().to_dict()}
