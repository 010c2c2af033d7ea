"""What /v1/completions and /v1/chat/completions share: the server state, checks that need
the model (context length, vocabulary), the request's SamplingParams (build_sampling), and the
two ways a group's events leave: collected into one JSON body, or streamed as server-sent
events."""

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from radixkv import protocol as P
from radixkv.engine.errors import ParamError
from radixkv.sampling_params import FIELDS as SAMPLING_FIELDS
from radixkv.sampling_params import SamplingParams
from tokenizer_server.async_tokenizer import AsyncTokenizer
from tokenizer_server.errors import APIError, bad_request, internal_error
from tokenizer_server.generation import GenerationGroup

log = logging.getLogger("radixkv.server")


@dataclass
class ServerState:
    tokenizer: object
    supervisor: object  # WorkerSupervisor
    metrics: object  # ServerMetrics
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    salts: object = None  # TenantSalts: how a request's cache salt is derived
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # shutting down: in-flight requests finish, new ones get 503
    stream_interval: int = 1  # a streamed chunk carries up to this many tokens of a choice
    async_tokenizer: AsyncTokenizer = field(init=False)

    def __post_init__(self):
        self.async_tokenizer = AsyncTokenizer(self.tokenizer)

    @property
    def model_info(self) -> P.WorkerReady:
        ready = self.supervisor.client.ready
        if ready is None:
            why = self.supervisor.client.down_reason
            raise APIError(503, f"the engine is unavailable: {why}", code="engine_unavailable")
        return ready


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str) -> None:
    if model not in state.served_model_names:
        raise APIError(404, f"model: the model `{model}` does not exist; served: {state.served_model_names}",
                       param="model", code="model_not_found")


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "only allowed with stream: true")


def check_prompt_length(info: P.WorkerReady, num_tokens: int, param: str) -> None:
    if num_tokens == 0:
        raise bad_request(param, "the prompt is empty (no tokens)")
    if num_tokens >= info.max_model_len:
        raise bad_request(
            param,
            f"the prompt has {num_tokens} tokens; this model's context is {info.max_model_len} tokens "
            "and at least one must be left for output",
            code="context_length_exceeded",
        )


def check_token_ids(info: P.WorkerReady, ids: list[int], param: str) -> None:
    """Token ids from the client (a prompt, stop_token_ids) must be in the vocabulary."""
    bad = next((t for t in ids if t >= info.vocab_size), None)
    if bad is not None:
        raise bad_request(param, f"token id {bad} is out of the vocabulary (size {info.vocab_size})")


def resolve_max_tokens(info: P.WorkerReady, prompt_lens: list[int], requested: int | None, default: int | None,
                       param: str = "max_tokens") -> int:
    """requested: what the client asked for; default: None means "up to the context limit"."""
    longest = max(prompt_lens)
    limit = info.max_model_len - longest
    if requested is None:
        return limit if default is None else min(default, limit)
    if requested > limit:
        raise bad_request(
            param,
            f"{requested} output tokens do not fit: the prompt has {longest} tokens "
            f"and this model's context is {info.max_model_len}",
            code="context_length_exceeded",
        )
    return requested


def effective_top_k(top_k: int | None, vocab_size: int) -> int:
    """-1 for off: unset, 0, or at least the vocabulary (keeping every token, as vLLM reads it)."""
    if top_k is None or top_k == 0 or top_k >= vocab_size:
        return -1
    return top_k


def check_streamable(req, params: SamplingParams) -> None:
    """Streaming sends tokens as they come: not possible when the outputs are chosen at the end."""
    if not req.stream:
        return
    if params.best_of is not None and params.best_of > params.n:
        raise bad_request("best_of", "streaming is not supported when best_of > n")
    if params.use_beam_search:
        raise bad_request("use_beam_search",
                          "streaming is not supported with beam search (beams are ranked at the end)")


def build_sampling(req, info: P.WorkerReady, max_tokens: int, logprobs: int | None,
                   logprobs_param: str = "logprobs") -> P.SamplingOptions:
    """The request's SamplingParams, checked (its rules: SamplingParams.validate), as it goes on
    the wire. The request's fields carry SamplingParams' names; unset (None) means its default.

    NOTE: only the mapping and the API's own rules are here: the OpenAI aliases (max_tokens
    resolved against the context, chat's top_logprobs as logprobs, stop as a list, top_k off at
    the vocabulary), what needs the model (the vocabulary), and streaming. Every other rule is
    SamplingParams', whose messages name the field as the API's always did."""
    if logprobs is not None and logprobs > info.vocab_size:
        raise bad_request(logprobs_param, f"{logprobs} is more than the vocabulary ({info.vocab_size})")
    check_token_ids(info, req.stop_token_ids or [], "stop_token_ids")
    fields = {name: v for name in SAMPLING_FIELDS if (v := getattr(req, name, None)) is not None}
    fields.update(max_tokens=max_tokens, logprobs=logprobs, top_k=effective_top_k(req.top_k, info.vocab_size),
                  stop=req.stop_strings(), stop_token_ids=list(req.stop_token_ids or []))
    params = SamplingParams(**fields)
    check_streamable(req, params)
    try:
        params.validate()
    except ParamError as e:
        raise APIError(400, str(e), param=e.param) from None
    return P.sampling_options(params)


def effective_salt(request: Request, cache_salt: str | None) -> str | None:
    """The salt the engine sees: derived from the request's API key (set by the auth middleware)
    and its cache_salt, so that no tenant can name another's (tenants.py)."""
    return request.app.state.radixkv.salts.salt(request.scope.get("radixkv.api_key"), cache_salt)


_encoder = msgspec.json.Encoder()


def sse(obj) -> bytes:
    """One server-sent event; bytes are an event made already (ChunkMaker's fast forms)."""
    if type(obj) is bytes:
        return obj
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def abort_on_disconnect(group: GenerationGroup, request: Request):
    """While inside, a client that hangs up aborts the group and wakes its reader. Leave it
    before a StreamingResponse starts: that one listens for the disconnect itself."""

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        group.close()
        group.cancel("client disconnected")

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def collect(group: GenerationGroup, request: Request) -> list:
    """All events of a non-streamed request."""
    events = []
    try:
        async with abort_on_disconnect(group, request):
            while not group.finished:
                events.extend(await group.next_events())
    finally:
        group.close()
    return events


async def start_stream(group: GenerationGroup, request: Request) -> list:
    """Wait for the first output of every engine request before the response commits to
    200, so a rejection is a 400 and a dead worker a 503. Returns the events seen."""
    try:
        async with abort_on_disconnect(group, request):
            return await group.wait_started()
    except BaseException:
        group.close()
        raise


class ChunkMaker:
    """Builds the chunks of one streamed response: chunk(choices), and tail() for the final
    usage chunk when the client asked for it (stream_options.include_usage)."""

    def __init__(self, group: GenerationGroup, obj: str, created: int, req):
        self.group, self.obj, self.created, self.model = group, obj, created, req.model
        self.include_usage = req.stream_options is not None and req.stream_options.include_usage
        # sse(self([choice])) for a choice whose only variable part is its text, in pieces: the
        # same bytes the encoder writes for the dict, without building it
        head = _encoder.encode(self([]))
        assert head.endswith(b'"choices":[]}')
        self._head = b"data: " + head[:-2]
        self._tails: dict[int, bytes] = {}

    def text_event(self, index: int, key: bytes, text: str, tail: bytes) -> bytes:
        """sse(self([{"index": index, key: text, ...}])) where tail is the rest of the choice,
        encoded; key is a JSON object's opening up to the text (b'"text":' or b'"delta":{"content":')."""
        return b"".join((self._head, b'{"index":', str(index).encode(), b",", key, _encoder.encode(text), tail,
                         b"]}\n\n"))

    def __call__(self, choices: list, usage: dict | None = None) -> dict:
        c = {"id": self.group.request_id, "object": self.obj, "created": self.created, "model": self.model,
             "choices": choices}
        if usage is not None:
            c["usage"] = usage
        return c

    def tail(self) -> list[dict]:
        return [self([], self.group.usage().to_dict())] if self.include_usage else []


def stream(group: GenerationGroup, first_events: list, to_chunks, tail) -> StreamingResponse:
    """Server-sent events: to_chunks(events) -> chunk dicts; tail() -> final chunks (usage).
    A client that disconnects cancels the generator, whose finally aborts the request."""

    async def body():
        try:  # one write for all that is ready: a stream that fell behind catches up at once
            if out := b"".join(map(sse, to_chunks(first_events))):
                yield out
            while not group.finished:
                if out := b"".join(map(sse, to_chunks(await group.next_events()))):
                    yield out
            for chunk in tail():
                yield sse(chunk)
        except APIError as e:  # the worker died or the engine failed mid-stream: the status line is sent
            yield sse(e.body())
        except Exception:  # a bug here: end the stream as an error, not a cut connection
            log.exception("stream %s failed", group.request_id)
            yield sse(internal_error().body())
        finally:
            group.close()
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
