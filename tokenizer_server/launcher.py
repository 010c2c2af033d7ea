"""Starts, watches, restarts and stops the engine worker process.

The worker is `python -m radixkv.engine.worker CONFIG_JSON`, a child of the front.
A thread blocks in wait() on it, so its death reaches the event loop at once:
in-flight requests fail with 503 and, unless restarts are allowed, the server is
told to exit non-zero. With restarts allowed, a restart loop spawns replacements until
one is ready, waiting between attempts with bounded exponential backoff (a worker that
dies while loading is just a failed attempt). A watchdog kills a worker that has sent
nothing, not even its heartbeat, for `worker_timeout` seconds: a frozen worker is then
handled like a dead one instead of keeping its clients waiting forever. The ipc sockets
live in a private mkdtemp folder (short, for the 107-character limit of ipc paths) that
stop() removes.
"""
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import msgspec

from radixkv import protocol as P
from tokenizer_server.client import EngineClient

log = logging.getLogger("radixkv.server")

MAX_IPC_PATH = 100
WATCHDOG_PERIOD_S = 0.5


def make_ipc_dir() -> str:
    path = tempfile.mkdtemp(prefix="rkv-")
    if len(path) + len("/out.sock") > MAX_IPC_PATH:  # a deep TMPDIR
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="rkv-", dir="/tmp")
    return path


@dataclass
class RestartPolicy:
    """Backoff between restart attempts: `first_delay_s`, doubling per failed attempt up to
    `max_delay_s`; a worker that stayed up `reset_after_s` starts the next series afresh."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2 ** attempt)


class WorkerSupervisor:
    def __init__(self, engine_args: dict, *, restart: bool, on_fatal, ready_timeout: float = 600.0,
                 stats_interval_s: float = 0.5, torch_threads: int | None = None,
                 worker_timeout: float = 60.0, heartbeat_interval_s: float = 1.0,
                 restart_policy: RestartPolicy | None = None, worker_cmd: list[str] | None = None):
        assert worker_timeout > heartbeat_interval_s > 0, "the watchdog must allow several heartbeats"
        self.engine_args = dict(engine_args)
        self.torch_threads = torch_threads
        self.restart = restart
        self.restart_policy = restart_policy or RestartPolicy()
        self.on_fatal = on_fatal  # called (exit code) when the worker died for good
        self.ready_timeout = ready_timeout
        self.stats_interval_s = stats_interval_s
        self.worker_timeout = worker_timeout
        self.heartbeat_interval_s = heartbeat_interval_s
        # the worker's command line, before its config JSON; another one stands in for the engine
        # in the front's benchmark (benchmarks/front.py)
        self.worker_cmd = list(worker_cmd) if worker_cmd else [sys.executable, "-m", "radixkv.engine.worker"]
        self.ipc_dir = make_ipc_dir()
        self.client = EngineClient(f"ipc://{self.ipc_dir}/req.sock", f"ipc://{self.ipc_dir}/out.sock")
        self.proc: subprocess.Popen | None = None
        self.restarts = 0  # restart attempts made
        self._stopping = False
        self._restarting = False  # the restart loop runs: a death while loading is its business
        self._ready_since = 0.0
        self._attempt = 0  # restart attempts in the current series: the backoff's exponent
        self._unresponsive: subprocess.Popen | None = None  # killed by the watchdog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exited: asyncio.Future | None = None
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> P.WorkerReady:
        self._loop = asyncio.get_running_loop()
        self.client.start_reader()
        ready = await self._spawn_and_wait()
        self._watchdog = self._loop.create_task(self._watch_heartbeat(), name="worker-watchdog")
        return ready

    async def _spawn_and_wait(self) -> P.WorkerReady:
        cfg = P.WorkerConfig(
            request_addr=self.client.request_addr,
            output_addr=self.client.output_addr,
            parent_pid=os.getpid(),
            engine_args=self.engine_args,
            stats_interval_s=self.stats_interval_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            torch_threads=self.torch_threads,
        )
        cmd = [*self.worker_cmd, msgspec.json.encode(cfg).decode()]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.proc = proc
        self._exited = self._loop.create_future()
        threading.Thread(target=self._watch, args=(proc, self._exited), daemon=True, name="worker-watch").start()
        try:
            ready = await self.client.wait_ready(self._exited, self.ready_timeout)
        except BaseException:
            _kill(proc)  # silent or cancelled: never leave a half-started worker behind
            raise
        self._ready_since = time.monotonic()
        log.info("engine worker %d ready", proc.pid)
        return ready

    def _watch(self, proc: subprocess.Popen, exited: asyncio.Future) -> None:
        code = proc.wait()
        try:
            self._loop.call_soon_threadsafe(self._on_exit, proc, exited, code)
        except RuntimeError:
            pass  # the loop is closed: the server is gone already

    def _on_exit(self, proc: subprocess.Popen, exited: asyncio.Future, code: int) -> None:
        if not exited.done():
            exited.set_result(code)
        if self._stopping or proc is not self.proc or self._restarting:
            return
        if proc is self._unresponsive:
            reason = "engine worker not responding"
            log.error("engine worker %d killed: no heartbeat for %.0f s", proc.pid, self.worker_timeout)
        else:
            reason = "engine worker died"
            log.error("engine worker %d died (%s)", proc.pid, self.client.fatal_message or f"exit code {code}")
        self.client.mark_dead(reason)
        if self.restart:
            self._loop.create_task(self._restart_loop())
        else:
            self.on_fatal(1)

    async def _restart_loop(self) -> None:
        """Spawn replacements until one is ready, backing off between attempts."""
        self._restarting = True
        lived = time.monotonic() - self._ready_since
        attempt = 0 if lived >= self.restart_policy.reset_after_s else self._attempt
        try:
            while not self._stopping:
                delay = self.restart_policy.delay(attempt)
                attempt += 1
                self.restarts += 1
                log.warning("restarting the engine worker in %.1f s (restart %d)", delay, self.restarts)
                self.client.down_reason = "engine worker restarting"
                await asyncio.sleep(delay)
                if self._stopping:
                    return
                try:
                    await self._spawn_and_wait()
                    return
                except Exception as e:  # died or stayed silent while loading: try again, later
                    log.error("engine worker restart %d failed: %s", self.restarts, e)
        finally:
            self._attempt = attempt
            self._restarting = False

    async def _watch_heartbeat(self) -> None:
        """Kill a ready worker that has been silent for worker_timeout seconds."""
        while not self._stopping:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            proc = self.proc
            if proc is None or not self.client.alive or proc is self._unresponsive:
                continue
            silent = time.monotonic() - self.client.last_heard
            if silent > self.worker_timeout and proc.poll() is None:
                log.error("engine worker %d sent nothing for %.1f s (heartbeat every %.1f s): killing it",
                          proc.pid, silent, self.heartbeat_interval_s)
                self._unresponsive = proc
                proc.kill()  # works on a stopped (SIGSTOP) process too; _on_exit takes it from here

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.client.alive

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the worker, SIGKILL it if it lingers, close sockets, remove the ipc folder.
        Idempotent; blocking (the loop is shutting down anyway)."""
        if self._stopping:
            return
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine worker %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()
        self.client.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
