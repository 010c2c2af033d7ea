"""One HTTP request's generation: engine requests in, per-choice text events out.

A request with P prompts and n samples is P engine requests (the engine forks the n
samples itself); choice i*n + j is sample j of prompt i. Each choice has its own
OutputProcessor (radixkv/output_processor.py, the offline LLM's too): incremental
detokenizer and stop strings, read from the request's SamplingOptions. A choice ended
by a stop string ignores its later tokens; once every choice of an engine request has
ended here, the engine request is aborted so its blocks go back at once.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field

from radixkv import protocol as P
from radixkv.output_processor import OutputProcessor
from tokenizer_server.client import EngineClient, WorkerUnavailable
from tokenizer_server.errors import APIError, engine_failed

log = logging.getLogger("radixkv.server")


@dataclass
class _Cancelled:
    reason: str


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None


@dataclass
class _Choice:
    index: int
    text: OutputProcessor
    num_tokens: int = 0  # usage: the tokens of every delta it took, the one with the stop string included

    @property
    def finish_reason(self) -> str | None:
        return self.text.finish_reason


@dataclass
class _EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[_Choice]
    num_cached_tokens: int = 0
    started: bool = False  # first output or rejection seen
    engine_finished: bool = False
    last_token_time: float | None = None

    @property
    def done_here(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class GenerationGroup:
    client: EngineClient
    tokenizer: object
    metrics: object  # ServerMetrics
    request_id: str
    prompts: list[list[int]]
    sampling: P.SamplingOptions  # stop strings and the text fields included
    cache_salt: str | None = None
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._requests: dict[str, _EngineRequest] = {}
        n = self.sampling.n
        for i, prompt in enumerate(self.prompts):
            rid = self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{i}"
            choices = [_Choice(i * n + j, OutputProcessor(self.tokenizer, prompt, self.sampling)) for j in range(n)]
            self._requests[rid] = _EngineRequest(rid, prompt, choices)

    # ---- driving -----------------------------------------------------------------------------

    def start(self) -> None:
        """Send every engine request; WorkerUnavailable -> 503."""
        try:
            for r in self._requests.values():
                self.client.add_request(
                    P.GenerateRequest(r.request_id, r.prompt_token_ids, self.sampling, self.cache_salt), self._queue
                )
        except WorkerUnavailable as e:
            self.close()
            raise _unavailable(e) from e

    @property
    def finished(self) -> bool:
        return all(r.done_here for r in self._requests.values())

    async def next_events(self) -> list[ChoiceEvent]:
        """Events of the next engine step that concerns this group (may be empty)."""
        item = await self._queue.get()
        if isinstance(item, WorkerUnavailable):
            raise _unavailable(item)
        if isinstance(item, _Cancelled):
            raise APIError(499, f"request cancelled: {item.reason}")
        if isinstance(item, P.RequestRejected):
            self._requests[item.request_id].engine_finished = True
            self.close()
            raise APIError(400, item.message, param=item.param)
        if any(c.finish_reason == "error" for c in item.choices):
            self._on_engine_error(item)
        return self._on_delta(item)

    async def wait_started(self) -> list[ChoiceEvent]:
        """Wait until every engine request produced output (or failed): errors surface before
        a streamed response commits to status 200. Returns the events seen meanwhile."""
        events: list[ChoiceEvent] = []
        while not all(r.started for r in self._requests.values()):
            events.extend(await self.next_events())
        return events

    def cancel(self, reason: str) -> None:
        """Wake a waiting next_events() with an error (e.g. the client hung up)."""
        self._queue.put_nowait(_Cancelled(reason))

    def close(self) -> None:
        """Abort what is still running in the engine (client gone, stop string, error)."""
        live = [rid for rid, r in self._requests.items() if not r.engine_finished]
        for rid in live:
            self._requests[rid].engine_finished = True
        self.client.abort(live)

    def _on_engine_error(self, d: P.RequestDelta) -> None:
        """The engine failed one of the group's requests: the whole response fails (the others are
        aborted), with a generic 500 or, once streaming, an error event."""
        for c in d.choices:
            if c.finish_reason == "error":
                self.metrics.requests.labels("error").inc()
        self.close()
        log.warning("request %s: the engine failed it (the worker's log says why)", d.request_id)
        raise engine_failed()

    # ---- accounting --------------------------------------------------------------------------

    def usage(self) -> Usage:
        u = Usage()
        for r in self._requests.values():
            u.prompt_tokens += len(r.prompt_token_ids)
            u.cached_tokens += r.num_cached_tokens
            u.completion_tokens += sum(c.num_tokens for c in r.choices)
        return u

    # ---- one delta ---------------------------------------------------------------------------

    def _on_delta(self, d: P.RequestDelta) -> list[ChoiceEvent]:
        r = self._requests[d.request_id]
        now = time.monotonic()
        r.started = True
        r.num_cached_tokens = d.num_cached_tokens
        if any(c.new_token_ids for c in d.choices):
            if r.last_token_time is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - r.last_token_time)
            r.last_token_time = now
        events = [ev for c in d.choices if (ev := self._on_choice(r.choices[c.index], c)) is not None]
        if d.finished:
            r.engine_finished = True
        if r.done_here and not r.engine_finished:
            self.client.abort([r.request_id])  # every choice met a stop string
            r.engine_finished = True
        if r.done_here and r.last_token_time is not None:
            self.metrics.e2e.observe(now - self.arrival)
        return events

    def _on_choice(self, ch: _Choice, c: P.ChoiceDelta) -> ChoiceEvent | None:
        if ch.finish_reason is not None:
            return None  # ended here by a stop string; the engine ran on
        ch.num_tokens += len(c.new_token_ids)
        text = ch.text.process(c.new_token_ids, c.finish_reason)
        if ch.finish_reason is not None:
            self.metrics.requests.labels(ch.finish_reason).inc()
        if not text and not c.new_token_ids and ch.finish_reason is None:
            return None
        return ChoiceEvent(ch.index, text, list(c.new_token_ids), c.logprobs, c.top_logprobs, ch.finish_reason)


def _unavailable(e: WorkerUnavailable) -> APIError:
    # the reason is a short phrase from the client ("engine worker died"); details are in the log
    return APIError(503, f"the engine is unavailable: {e}", code="engine_unavailable")
