"""What /v1/completions and /v1/chat/completions share: the server state, checks that need
the model (context length, vocabulary) or look at several fields at once, SamplingOptions,
and the two ways a group's events leave: collected into one JSON body, or streamed as
server-sent events."""

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


# Beam search ranks the model's raw log-probabilities: fields that would reshape them must stay at
# their defaults. And the beam-only fields mean nothing without it.
_BEAM_NEUTRAL = (("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                 ("presence_penalty", 0.0))


def _check_best_of(req, best_of: int | None) -> None:
    if best_of is None:
        return
    if best_of < req.n:
        raise bad_request("best_of", f"must be >= n ({req.n}), got {best_of}")
    if req.stream and best_of > req.n:
        raise bad_request("best_of", "streaming is not supported when best_of > n")


def _check_beam_only_fields(req) -> None:
    if getattr(req, "beam_width", None) is not None:
        raise bad_request("beam_width", "applies to beam search only (set use_beam_search: true)")
    if getattr(req, "length_penalty", 1.0) != 1.0:
        raise bad_request("length_penalty", "applies to beam search only (set use_beam_search: true)")
    if getattr(req, "early_stopping", False) is not False:
        raise bad_request("early_stopping", "applies to beam search only (set use_beam_search: true)")


def _check_beam_search(req, top_k: int) -> None:
    if req.stream:
        raise bad_request("use_beam_search",
                          "streaming is not supported with beam search (beams are ranked at the end)")
    for name, default in _BEAM_NEUTRAL:
        value = getattr(req, name)
        if value is not None and value != default:
            raise bad_request(name, f"must be {default} with use_beam_search (beams rank the raw log-probabilities)")
    if top_k != -1:
        raise bad_request("top_k", "must be off (-1) with use_beam_search")
    if req.beam_width is not None and req.best_of is not None and req.best_of != req.beam_width:
        raise bad_request("best_of", f"must equal beam_width ({req.beam_width}) with beam search")
    width = req.beam_width or req.best_of or req.n
    if width < 2:
        raise bad_request("use_beam_search", "needs at least 2 beams (beam_width, or best_of / n); "
                                             "for one, use greedy sampling (temperature 0)")
    if req.n > width:
        raise bad_request("n", f"{req.n} is more than the beam width ({width})")


def build_sampling(req, info: P.WorkerReady, max_tokens: int, logprobs: int | None,
                   logprobs_param: str = "logprobs") -> P.SamplingOptions:
    if req.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"{req.min_tokens} is more than max_tokens ({max_tokens})")
    if logprobs is not None and logprobs > info.vocab_size:
        raise bad_request(logprobs_param, f"{logprobs} is more than the vocabulary ({info.vocab_size})")
    check_token_ids(info, req.stop_token_ids or [], "stop_token_ids")
    best_of = getattr(req, "best_of", None)
    _check_best_of(req, best_of)
    top_k = effective_top_k(req.top_k, info.vocab_size)
    beam = getattr(req, "use_beam_search", False)
    if beam:
        _check_beam_search(req, top_k)
    else:
        _check_beam_only_fields(req)
    beam_fields = dict(use_beam_search=True, beam_width=req.beam_width, length_penalty=req.length_penalty,
                       early_stopping=req.early_stopping) if beam else {}
    return P.SamplingOptions(
        n=req.n,
        best_of=best_of,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        **beam_fields,
    )


def effective_salt(request: Request, cache_salt: str | None) -> str | None:
    """The salt the engine sees: derived from the request's API key (set by the auth middleware)
    and its cache_salt, so that no tenant can name another's (tenants.py)."""
    return request.app.state.radixkv.salts.salt(request.scope.get("radixkv.api_key"), cache_salt)


_encoder = msgspec.json.Encoder()


def sse(obj) -> bytes:
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
        try:
            for chunk in to_chunks(first_events):
                yield sse(chunk)
            while not group.finished:
                for chunk in to_chunks(await group.next_events()):
                    yield sse(chunk)
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
