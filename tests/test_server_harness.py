"""Starts the real `radixkv serve` (front + engine worker) on the tiny model, on a free
loopback port, for the server and API tests. Holds no tests of its own but two checks
of its helpers."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import psutil
import pytest

NUM_BLOCKS = 96  # x 16 = 1,536 tokens: the context limit of the tiny server
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    worker_pid: int
    ipc_dir: str
    log_path: str

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored {sig!r} for {timeout} s; log:\n{self.log()}")


    def kill(self) -> None:
        """Leave nothing running, whatever state a failed test left the server in."""
        for pid in (self.proc.pid, self.worker_pid):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


@contextlib.contextmanager
def running_server(model_dir, tmp_path, *extra):
    """A server for a block of tests; on leaving it must stop cleanly on SIGTERM, and
    whatever a failure left running is killed."""
    srv = start_server(model_dir, tmp_path, *extra)
    try:
        yield srv
        assert_clean_exit(srv, srv.stop())
    finally:
        srv.kill()


@pytest.fixture
def server_factory(tmp_path):
    """start(model_dir, *extra_args) -> Server; whatever is still running at teardown is killed."""
    started = []

    def start(model_dir, *extra):
        started.append(start_server(model_dir, tmp_path, *extra))
        return started[-1]

    yield start
    for srv in started:
        srv.kill()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def start_server(model_dir, tmp_path, *extra, timeout: float = 120.0) -> Server:
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), *map(str, extra)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}; log:\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server not healthy after {timeout} s; log:\n{open(log_path).read()}")
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 1, children
    worker = children[0]
    cfg = json.loads(worker.cmdline()[-1])
    ipc_dir = os.path.dirname(cfg["request_addr"].removeprefix("ipc://"))
    assert os.path.isdir(ipc_dir)
    return Server(proc, url, str(model_dir), worker.pid, ipc_dir, log_path)


def process_gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_clean_exit(server: Server, code: int, expected_code: int = 0) -> None:
    """Exit code as expected, no child process left, no ipc files left."""
    assert code == expected_code, f"exit code {code}; log:\n{server.log()}"
    assert process_gone(server.worker_pid), f"worker {server.worker_pid} still running"
    assert not os.path.exists(server.ipc_dir), os.listdir(server.ipc_dir)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s (last value {value!r})")
        time.sleep(interval)


def test_parse_metrics_reads_names_labels_and_values():
    text = '# HELP x y\nradixkv_a_total 3.0\nradixkv_b{finish_reason="stop"} 2\nradixkv_c 1.5e-3\n'
    assert parse_metrics(text) == {"radixkv_a_total": 3.0, 'radixkv_b{finish_reason="stop"}': 2.0,
                                   "radixkv_c": 0.0015}


def test_wait_for_times_out():
    with pytest.raises(AssertionError, match="not met"):
        wait_for(lambda: 0, timeout=0.2)
