"""One HTTP request's generation: engine requests in, per-choice text events out.

A request with P prompts and n samples is P engine requests (the engine forks the n
samples itself); choice i*n + j is sample j of prompt i. Each choice has its own
OutputProcessor (radixkv/output_processor.py, the offline LLM's too): incremental
detokenizer and stop strings, read from the request's SamplingOptions. A choice ended
by a stop string ignores its later tokens; once every choice of an engine request has
ended here, the engine request is aborted so its blocks go back at once.

The group is its own sink: the engine client's reader hands it each delta as the step's message
is read, and the text is made right then (detokenizer, stop strings, usage, metrics), so a stop
string ends a choice at once. The HTTP side waits in next_events(), woken only when there is
something to send: with stream_interval N, when a choice has N tokens not yet handed out, when a
choice ends or the engine request finishes, at an engine request's first output (so that a
stream commits to 200 as before), and for every error. One event carries up to N tokens of a
choice; next_events() hands out all that is ready, so a stream that fell behind writes once.
"""

import asyncio
import collections
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
    stream_interval: int = 1  # an event carries up to this many tokens of a choice

    def __post_init__(self):
        self._ready: collections.deque = collections.deque()  # lists of events to hand out, or errors
        self._held: dict[int, ChoiceEvent] = {}  # choice -> tokens not yet handed out (stream_interval)
        self._waiter: asyncio.Future | None = None
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
                    P.GenerateRequest(r.request_id, r.prompt_token_ids, self.sampling, self.cache_salt), self
                )
        except WorkerUnavailable as e:
            self.close()
            raise _unavailable(e) from e

    @property
    def finished(self) -> bool:
        """Every choice has ended and every event was handed out."""
        return not self._ready and not self._held and all(r.done_here for r in self._requests.values())

    async def next_events(self) -> list[ChoiceEvent]:
        """The events ready to send (may be empty), in order; raises the error that ends the group."""
        while not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if isinstance(self._ready[0], BaseException):
            raise self._ready.popleft()
        events = self._ready.popleft()
        while self._ready and not isinstance(self._ready[0], BaseException):
            events += self._ready.popleft()
        return events

    # ---- the sink: called by the engine client's reader ---------------------------------------

    def put_nowait(self, item) -> None:
        """A RequestDelta, RequestRejected or WorkerUnavailable of one of the group's requests, or a
        _Cancelled; never raises (the reader goes on with the step's other requests)."""
        try:
            if isinstance(item, P.RequestDelta):
                self._take_delta(item)
                return
            if isinstance(item, WorkerUnavailable):
                raise _unavailable(item)
            if isinstance(item, _Cancelled):
                raise APIError(499, f"request cancelled: {item.reason}")
            if isinstance(item, P.RequestRejected):
                self._requests[item.request_id].engine_finished = True
                self.close()
                raise APIError(400, item.message, param=item.param)
            raise TypeError(f"unexpected item for a generation group: {type(item).__name__}")
        except Exception as e:  # the group ends with it, after what was made before it
            self._release(news=False)
            self._ready.append(e)
            self._wake()

    def _take_delta(self, d: P.RequestDelta) -> None:
        r = self._requests[d.request_id]
        if len(d.choices) == 1 and r.started and not d.finished:  # the common step: one choice's next tokens
            c = d.choices[0]
            if c.finish_reason is None and c.logprobs is None and c.new_token_ids:
                ch = r.choices[c.index]
                if ch.text.finish_reason is None:
                    self._hold(self._on_token(r, ch, c, d.num_cached_tokens), False, False)
                    return
        if any(c.finish_reason == "error" for c in d.choices):
            self._on_engine_error(d)
        first = not r.started
        self._hold(self._on_delta(d), d.finished, first)

    def _hold(self, events: list[ChoiceEvent], due: bool, news: bool) -> None:
        """Events join what each choice holds; what is due goes out. news: wake the reader even
        if nothing is due (an engine request's first output: the stream may commit to 200)."""
        n, held = self.stream_interval, self._held
        for ev in events:
            h = held.get(ev.index)
            if h is None:
                held[ev.index] = ev
            elif len(h.token_ids) + len(ev.token_ids) > n:  # the chunk would carry more than n tokens
                self._ready.append([h])
                held[ev.index] = ev
            else:
                h.text += ev.text
                h.token_ids += ev.token_ids
                if h.logprobs is not None and ev.logprobs is not None:
                    h.logprobs = h.logprobs + ev.logprobs
                if h.top_logprobs is not None and ev.top_logprobs is not None:
                    h.top_logprobs = h.top_logprobs + ev.top_logprobs
                h.finish_reason = ev.finish_reason
            h = held[ev.index]
            if h.finish_reason is not None or len(h.token_ids) >= n:
                due = True
        if due:
            self._release(news=True)
            self._wake()
        elif self._ready or news:  # full chunks, while what is held waits for more
            if not self._ready:
                self._ready.append([])
            self._wake()

    def _release(self, news: bool) -> None:
        """What is held goes out now; news: wake the reader even with no event (an engine
        request's first output)."""
        if self._held:
            self._ready.append(list(self._held.values()))
            self._held.clear()
        elif news and not self._ready:
            self._ready.append([])

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait_started(self) -> list[ChoiceEvent]:
        """Wait until every engine request produced output (or failed): errors surface before
        a streamed response commits to status 200. Returns the events seen meanwhile."""
        events: list[ChoiceEvent] = []
        while not all(r.started for r in self._requests.values()):
            events.extend(await self.next_events())
        return events

    def cancel(self, reason: str) -> None:
        """Wake a waiting next_events() with an error (e.g. the client hung up)."""
        self.put_nowait(_Cancelled(reason))

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
            self._observe_token_time(r, now)
        events = [ev for c in d.choices if (ev := self._on_choice(r.choices[c.index], c)) is not None]
        if d.finished:
            r.engine_finished = True
        if r.done_here and not r.engine_finished:
            self.client.abort([r.request_id])  # every choice met a stop string
            r.engine_finished = True
        if r.done_here and r.last_token_time is not None:
            self.metrics.e2e.observe(now - self.arrival)
        return events

    def _on_token(self, r: _EngineRequest, ch: _Choice, c: P.ChoiceDelta, num_cached: int) -> list[ChoiceEvent]:
        """_on_delta for one running choice's new tokens, without logprobs: the same accounting."""
        now = time.monotonic()
        r.num_cached_tokens = num_cached
        self._observe_token_time(r, now)
        ids = c.new_token_ids
        ch.num_tokens += len(ids)
        text = ch.text.process(ids)
        reason = ch.text.finish_reason
        if reason is not None:  # a stop string
            self.metrics.requests.labels(reason).inc()
            if r.done_here:
                self.client.abort([r.request_id])  # every choice met a stop string
                r.engine_finished = True
                self.metrics.e2e.observe(now - self.arrival)
        return [ChoiceEvent(ch.index, text, list(ids), None, None, reason)]

    def _observe_token_time(self, r: _EngineRequest, now: float) -> None:
        """Tokens of `r` arrived at `now`: time to first token, or the gap since the last."""
        if r.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - r.last_token_time)
        r.last_token_time = now

    def _on_choice(self, ch: _Choice, c: P.ChoiceDelta) -> ChoiceEvent | None:
        if ch.finish_reason is not None:
            return None  # ended here by a stop string; the engine ran on
        ch.num_tokens += len(c.new_token_ids)
        text = ch.text.process(c.new_token_ids, c.finish_reason)
        if ch.finish_reason is not None:
            self.metrics.requests.labels(ch.finish_reason).inc()
        if not text and not c.new_token_ids and ch.finish_reason is None:
            return None
        return ChoiceEvent(ch.index, text, list(c.new_token_ids), c.logprobs and list(c.logprobs),
                           c.top_logprobs and list(c.top_logprobs), ch.finish_reason)


def _unavailable(e: WorkerUnavailable) -> APIError:
    # the reason is a short phrase from the client ("engine worker died"); details are in the log
    return APIError(503, f"the engine is unavailable: {e}", code="engine_unavailable")
