"""The front's ZeroMQ client of the engine worker.

Two PUSH/PULL pipes on ipc:// sockets that the front binds and the worker connects
to. One reader task drains the output pipe the whole time and routes each request's
deltas to the asyncio queue (the "sink") of the HTTP request that owns it, so the
worker's sends never back up. Requests go out on a plain socket with NOBLOCK and no
high-water mark: a send never blocks the event loop, and the worker drains its
pipe every step, so the queue stays short.

Every message from the worker (a heartbeat at least once a second) stamps `last_heard`,
which the supervisor's watchdog reads to tell a frozen worker from a busy one.
"""

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from radixkv import protocol as P

log = logging.getLogger("radixkv.server")

OUTPUT_RCVHWM = 100_000  # step messages; the reader drains them at once


class WorkerUnavailable(Exception):
    """The worker is dead, restarting or not started: requests get 503."""


class EngineClient:
    def __init__(self, request_addr: str, output_addr: str):
        self.request_addr, self.output_addr = request_addr, output_addr
        self._ctx = zmq.asyncio.Context()
        self._req = zmq.Socket(self._ctx, zmq.PUSH)  # plain socket: sends never await
        self._req.setsockopt(zmq.SNDHWM, 0)
        self._req.setsockopt(zmq.LINGER, 0)
        self._req.bind(request_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, OUTPUT_RCVHWM)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(output_addr)
        self._enc = P.make_encoder()
        self._dec = P.make_decoder("from_worker")
        self._sinks: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._ready_event: asyncio.Event | None = None
        self.ready: P.WorkerReady | None = None  # set while a worker is up
        self.stats: P.EngineStats | None = None
        self.fatal_message: str | None = None
        self.last_heard = time.monotonic()  # when the worker last sent anything
        self.down_reason = "engine worker is not running"  # what a 503 says while no worker is ready

    # ---- lifecycle ---------------------------------------------------------------------------

    def start_reader(self) -> None:
        assert self._reader is None, "reader already started"
        self._ready_event = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(), name="engine-output-reader")

    async def wait_ready(self, worker_exited: asyncio.Future, timeout: float) -> P.WorkerReady:
        """Wait for the worker's hello; fail if it exits or stays silent for `timeout` s."""
        ready = asyncio.ensure_future(self._ready_event.wait())
        done, _ = await asyncio.wait({ready, worker_exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            why = self.fatal_message or "no message"
            if worker_exited in done:
                raise RuntimeError(f"engine worker exited during start-up (code {worker_exited.result()}): {why}")
            raise RuntimeError(f"engine worker not ready after {timeout:.0f} s")
        return self.ready

    def mark_dead(self, reason: str) -> None:
        """The worker is gone: every in-flight request fails now, new ones get 503. `reason` is a
        short phrase clients may see ("engine worker died"); details go to the log only."""
        self.ready = None
        self.down_reason = reason
        if self._ready_event is not None:
            self._ready_event.clear()
        self.fail_in_flight(reason)

    def fail_in_flight(self, reason: str) -> None:
        """Every request still waiting for output gets WorkerUnavailable(reason): a 503, or an
        error event and [DONE] on a stream that has started."""
        err = WorkerUnavailable(reason)
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.put_nowait(err)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self.mark_dead("server shutting down")
        self._req.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self.ready is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, req: P.GenerateRequest, sink: asyncio.Queue) -> None:
        """Send a request; its RequestDelta / RequestRejected / WorkerUnavailable go to `sink`."""
        if not self.alive:
            raise WorkerUnavailable(self.down_reason)
        assert req.request_id not in self._sinks, f"request id {req.request_id} in use"
        self._sinks[req.request_id] = sink
        try:
            self._req.send(self._enc.encode(req), flags=zmq.NOBLOCK)
        except zmq.Again as e:  # no worker connected
            del self._sinks[req.request_id]
            raise WorkerUnavailable("engine worker is not connected") from e

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests the client no longer wants; synchronous, so it is safe in a finally
        block of a cancelled task. Unknown or finished ids are ignored."""
        live = [rid for rid in request_ids if self._sinks.pop(rid, None) is not None]
        if live and self.alive:
            try:
                self._req.send(self._enc.encode(P.AbortRequest(live)), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # worker gone: nothing left to abort

    # ---- output reader -----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            buf = await self._out.recv()
            self.last_heard = time.monotonic()
            try:
                msg = self._dec.decode(buf)
            except Exception:  # a malformed message must not kill the reader
                log.exception("undecodable message from the engine worker")
                continue
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, P.StepOutput):
            for delta in msg.outputs:
                sink = self._sinks.get(delta.request_id)
                if sink is None:
                    continue  # aborted here already
                if delta.finished:
                    del self._sinks[delta.request_id]
                sink.put_nowait(delta)
            if msg.stats is not None:
                self.stats = msg.stats
        elif isinstance(msg, P.RequestRejected):
            sink = self._sinks.pop(msg.request_id, None)
            if sink is not None:
                sink.put_nowait(msg)
        elif isinstance(msg, P.Heartbeat):
            pass  # its arrival is the news (last_heard)
        elif isinstance(msg, P.WorkerReady):
            self.ready, self.stats, self.fatal_message = msg, msg.stats, None
            self._ready_event.set()
        elif isinstance(msg, P.WorkerFatal):
            self.fatal_message = msg.message
            log.error("engine worker failed: %s", msg.message)
