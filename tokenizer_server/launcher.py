"""Starts, watches, restarts and stops the engine worker process.

The worker is `python -m radixkv.engine.worker CONFIG_JSON`, a child of the front.
A thread blocks in wait() on it, so its death reaches the event loop at once:
in-flight requests fail with 503 and, unless restarts are allowed, the server is
told to exit non-zero. The ipc sockets live in a private mkdtemp folder (short, for
the 107-character limit of ipc paths) that stop() removes.
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

import msgspec

from radixkv import protocol as P
from tokenizer_server.client import EngineClient

log = logging.getLogger("radixkv.server")

MAX_IPC_PATH = 100


def make_ipc_dir() -> str:
    path = tempfile.mkdtemp(prefix="rkv-")
    if len(path) + len("/out.sock") > MAX_IPC_PATH:  # a deep TMPDIR
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="rkv-", dir="/tmp")
    return path


class WorkerSupervisor:
    def __init__(self, engine_args: dict, *, restart: bool, on_fatal, ready_timeout: float = 600.0,
                 stats_interval_s: float = 0.5, torch_threads: int | None = None):
        self.engine_args = dict(engine_args)
        self.torch_threads = torch_threads
        self.restart = restart
        self.on_fatal = on_fatal  # called (exit code) when the worker died for good
        self.ready_timeout = ready_timeout
        self.stats_interval_s = stats_interval_s
        self.ipc_dir = make_ipc_dir()
        self.client = EngineClient(f"ipc://{self.ipc_dir}/req.sock", f"ipc://{self.ipc_dir}/out.sock")
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exited: asyncio.Future | None = None

    async def start(self) -> P.WorkerReady:
        self._loop = asyncio.get_running_loop()
        self.client.start_reader()
        return await self._spawn_and_wait()

    async def _spawn_and_wait(self) -> P.WorkerReady:
        cfg = P.WorkerConfig(
            request_addr=self.client.request_addr,
            output_addr=self.client.output_addr,
            parent_pid=os.getpid(),
            engine_args=self.engine_args,
            stats_interval_s=self.stats_interval_s,
            torch_threads=self.torch_threads,
        )
        cmd = [sys.executable, "-m", "radixkv.engine.worker", msgspec.json.encode(cfg).decode()]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.proc = proc
        self._exited = self._loop.create_future()
        threading.Thread(target=self._watch, args=(proc, self._exited), daemon=True, name="worker-watch").start()
        ready = await self.client.wait_ready(self._exited, self.ready_timeout)
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
        if self._stopping or proc is not self.proc:
            return
        why = self.client.fatal_message or f"exit code {code}"
        log.error("engine worker %d died (%s)", proc.pid, why)
        self.client.mark_dead(f"engine worker died ({why})")
        if self.restart:
            self._loop.create_task(self._restart())
        else:
            self.on_fatal(1)

    async def _restart(self) -> None:
        self.restarts += 1
        log.warning("restarting the engine worker (restart %d)", self.restarts)
        try:
            await self._spawn_and_wait()
        except Exception as e:  # a worker that cannot start again ends the server
            log.error("engine worker restart failed: %s", e)
            self.on_fatal(1)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.client.alive

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the worker, SIGKILL it if it lingers, close sockets, remove the ipc folder.
        Idempotent; blocking (the loop is shutting down anyway)."""
        if self._stopping:
            return
        self._stopping = True
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
