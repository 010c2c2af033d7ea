"""POST /v1/chat/completions: the model's chat template, n, logprobs, streaming."""

import time

from fastapi import Request

from tokenizer_server.api_models import ChatCompletionRequest
from tokenizer_server.async_tokenizer import ChatTemplateError
from tokenizer_server.errors import bad_request
from tokenizer_server.generation import GenerationGroup
from tokenizer_server.serving_common import (
    ChunkMaker,
    ServerState,
    build_sampling,
    check_model,
    check_prompt_length,
    check_stream_options,
    collect,
    effective_salt,
    new_id,
    resolve_max_tokens,
    start_stream,
    stream,
)


CONTENT_KEY, CONTENT_TAIL = b'"delta":{"content":', b'},"logprobs":null,"finish_reason":null}'


def conversation(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template reads them."""
    return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]


async def render_chat(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The conversation's token ids through the model's chat template, checked against the context."""
    if getattr(state.tokenizer, "chat_template", None) is None:
        raise bad_request("messages", "this model has no chat template; use /v1/completions")
    info = state.model_info
    try:
        enc = await state.async_tokenizer.encode_chat(
            conversation(req), add_generation_prompt=req.add_generation_prompt, max_tokens=info.max_model_len - 1)
    except ChatTemplateError as e:  # the template itself rejects the conversation (e.g. role order)
        raise bad_request("messages", f"the chat template rejected the messages: {e}") from e
    check_prompt_length(info, enc.num_tokens, "messages")
    return enc.token_ids


def _logprob_entry(tokenizer, tid: int, lp: float) -> dict:
    s = tokenizer.decode([tid])
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tokenizer, ev) -> dict | None:
    if ev.logprobs is None:
        return None
    content = []
    for k, (tid, lp) in enumerate(zip(ev.token_ids, ev.logprobs)):
        entry = _logprob_entry(tokenizer, tid, lp)
        top = ev.top_logprobs[k] if ev.top_logprobs is not None else {}
        entry["top_logprobs"] = [_logprob_entry(tokenizer, t, v) for t, v in top.items()]
        content.append(entry)
    return {"content": content}


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    check_model(state, req.model)
    tok = state.tokenizer
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs", "requires logprobs: true")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
    check_stream_options(req)
    ids = await render_chat(state, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    info = state.model_info
    max_tokens = resolve_max_tokens(info, [len(ids)], requested, None, param)
    sampling = build_sampling(req, info, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                              logprobs_param="top_logprobs")
    group = GenerationGroup(
        state.supervisor.client, tok, state.metrics, new_id("chatcmpl"), [ids], sampling,
        cache_salt=effective_salt(request, req.cache_salt), stream_interval=state.stream_interval if req.stream else 1,
    )
    created = int(time.time())
    group.start()
    if req.stream:
        first = await start_stream(group, request)

        chunk = ChunkMaker(group, "chat.completion.chunk", created, req)

        # The first chunk of every choice names the role, as OpenAI's do.
        head = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]) for i in range(req.n)]

        def to_chunks(events):
            out, head[:] = list(head), []
            for ev in events:
                if ev.logprobs is None and ev.finish_reason is None:  # the common chunk, its bytes at once
                    out.append(chunk.text_event(ev.index, CONTENT_KEY, ev.text, CONTENT_TAIL))
                    continue
                delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
                out.append(chunk([{"index": ev.index, "delta": delta, "logprobs": chat_logprobs(tok, ev),
                                   "finish_reason": ev.finish_reason}]))
            return out

        return stream(group, first, to_chunks, chunk.tail)

    events = await collect(group, request)
    texts = [""] * req.n
    logprobs: list[list[dict] | None] = [[] if req.logprobs else None for _ in range(req.n)]
    finish = [None] * req.n
    for ev in events:
        texts[ev.index] += ev.text
        if (lp := chat_logprobs(tok, ev)) is not None:
            logprobs[ev.index] += lp["content"]
        finish[ev.index] = ev.finish_reason or finish[ev.index]
    choices = [
        {"index": i, "message": {"role": "assistant", "content": texts[i]},
         "logprobs": {"content": logprobs[i]} if logprobs[i] is not None else None, "finish_reason": finish[i]}
        for i in range(req.n)
    ]
    return {"id": group.request_id, "object": "chat.completion", "created": created, "model": req.model,
            "choices": choices, "usage": group.usage().to_dict()}
