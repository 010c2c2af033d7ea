"""The engine worker's fault handling, over real ZeroMQ PUSH/PULL sockets on ipc:// (tiny
Llama, CPU): a refused request gets RequestRejected naming the field; an internal failure of
one request ends that request with "error" while the others finish normally; heartbeats come
at the configured interval, idle or busy; a message that does not decode is skipped. The
Worker class runs in a thread (so faults can be injected), and once as the real process."""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import pytest
import zmq

from radixkv import protocol as P
from radixkv.engine import worker as worker_module
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.worker import Worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE_ARGS = dict(device="cpu", block_size=4, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=32)


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _generate(rid, prompt, **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return P.GenerateRequest(rid, prompt, P.SamplingOptions(**sampling))


class Front:
    """The front's side of the two pipes: PUSH requests, PULL what the worker sends."""

    def __init__(self):
        # ipc paths must stay under ~100 characters: a short folder under /tmp
        self.dir = tempfile.mkdtemp(prefix="rkvw-", dir="/tmp")
        self.ctx = zmq.Context()
        self.request_addr, self.output_addr = f"ipc://{self.dir}/req", f"ipc://{self.dir}/out"
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.push.bind(self.request_addr)
        self.pull.bind(self.output_addr)
        self.enc, self.dec = P.make_encoder(), P.make_decoder("from_worker")

    def config(self, heartbeat_interval_s=1.0, parent_pid=None, torch_threads=None, **engine_args) -> P.WorkerConfig:
        # in a thread of this process, the worker's parent is this process's parent
        return P.WorkerConfig(self.request_addr, self.output_addr, os.getppid() if parent_pid is None else parent_pid,
                              {**ENGINE_ARGS, **engine_args}, heartbeat_interval_s=heartbeat_interval_s,
                              torch_threads=torch_threads)

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def recv(self, timeout_s: float):
        if not self.pull.poll(int(timeout_s * 1000)):
            return None
        return self.dec.decode(self.pull.recv())

    def collect(self, request_ids, timeout_s=20.0) -> dict:
        """Until each request has its end (a finished delta or a rejection): {id: [deltas] or rejection}."""
        got, done, deadline = {}, set(), time.monotonic() + timeout_s
        while done != set(request_ids):
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            assert msg is not None, f"no end for {set(request_ids) - done} within {timeout_s} s"
            if isinstance(msg, P.StepOutput):
                for d in msg.outputs:
                    got.setdefault(d.request_id, []).append(d)
                    if d.finished:
                        done.add(d.request_id)
            elif isinstance(msg, P.RequestRejected):
                got[msg.request_id] = msg
                done.add(msg.request_id)
            assert not isinstance(msg, P.WorkerFatal), msg.message
        return got

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


class ThreadWorker:
    """The real Worker class on a real engine, in a thread of the test process."""

    def __init__(self, front: Front, model_dir, **config):
        self.cfg = front.config(**config)
        self.req, self.out = front.ctx.socket(zmq.PULL), front.ctx.socket(zmq.PUSH)
        self.req.connect(self.cfg.request_addr)
        self.out.connect(self.cfg.output_addr)
        engine = Engine(EngineConfig(model_dir=str(model_dir), check_invariants=False, **self.cfg.engine_args))
        self.worker = Worker(self.cfg, engine, self.req, self.out)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def engine(self) -> Engine:
        return self.worker.engine

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            self.error = e

    def start(self) -> "ThreadWorker":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.worker.stop = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.req.close(linger=0)
        self.out.close(linger=0)


@pytest.fixture
def front():
    f = Front()
    yield f
    f.close()


@pytest.fixture
def start_worker(front, tiny_llama_dir):
    started = []

    def start(**config) -> ThreadWorker:
        w = ThreadWorker(front, tiny_llama_dir, **config).start()
        started.append(w)
        assert isinstance(front.recv(20), P.WorkerReady)
        return w

    yield start
    for w in started:
        w.stop()


def _tokens(deltas) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in deltas:
        for c in d.choices:
            out.setdefault(c.index, []).extend(c.new_token_ids)
    return out


def _finishes(deltas) -> dict[int, str]:
    return {c.index: c.finish_reason for d in deltas for c in d.choices if c.finish_reason is not None}


def _reference(model_dir, requests) -> dict[str, dict[int, list[int]]]:
    e = Engine(EngineConfig(model_dir=str(model_dir), **ENGINE_ARGS))
    for r in requests:
        e.add_request(r.request_id, r.prompt_token_ids, worker_module.to_sampling_params(r.sampling))
    final = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                final[o.request_id] = {c.index: c.token_ids for c in o.outputs}
    return final


OTHERS = [_generate("ok", _prompt(9, 2), max_tokens=8), _generate("pair", _prompt(7, 3), max_tokens=6, n=2)]


def test_a_refused_request_is_rejected_naming_the_field(front, start_worker):
    start_worker()
    bad = [(_generate("vocab", [5, 99999], max_tokens=4), "prompt_token_ids"),
           (_generate("top_p", [5, 6], top_p=2.0), "top_p"),
           (_generate("wide", [5, 6], n=50), "n"),
           (_generate("long", [5, 6], max_tokens=10**6), "max_tokens")]
    for msg, _ in bad:
        front.send(msg)
    front.send(OTHERS[0])
    got = front.collect([m.request_id for m, _ in bad] + ["ok"])
    for msg, param in bad:
        rejection = got[msg.request_id]
        assert isinstance(rejection, P.RequestRejected) and rejection.param == param
        assert param in rejection.message
    assert _finishes(got["ok"]) == {0: "length"}


def _fail_forward_of(engine, request_id, after_tokens):
    execute = engine.runner.execute

    def execute_or_fail(scheduled, block_table, copy_ops):
        if any(s.request.request_id == request_id and s.num_output_tokens >= after_tokens for s, _ in scheduled):
            raise RuntimeError("injected: the forward failed")
        return execute(scheduled, block_table, copy_ops)

    engine.runner.execute = execute_or_fail


def _fail_add_of(engine, request_id):
    add = engine.add_request

    def add_or_fail(rid, *args):
        if rid == request_id:
            raise RuntimeError("injected: add_request failed")
        return add(rid, *args)

    engine.add_request = add_or_fail


def _fail_delta_of(monkeypatch, request_id):
    to_delta, fired = worker_module.to_delta, []

    def to_delta_or_fail(out):
        if out.request_id == request_id and not out.finished and not fired:
            fired.append(True)
            raise KeyError("injected: the output does not convert")
        return to_delta(out)

    monkeypatch.setattr(worker_module, "to_delta", to_delta_or_fail)


@pytest.mark.parametrize("where", ["step", "add", "delta"])
def test_an_internal_failure_ends_its_request_with_error_only(front, start_worker, tiny_llama_dir, monkeypatch,
                                                              where):
    w = start_worker()
    if where == "step":
        _fail_forward_of(w.engine, "bad", after_tokens=2)
    elif where == "add":
        _fail_add_of(w.engine, "bad")
    else:
        _fail_delta_of(monkeypatch, "bad")
    bad = _generate("bad", _prompt(8, 1), max_tokens=10, n=2, temperature=1.0, seed=3)
    for msg in [OTHERS[0], bad, OTHERS[1]]:
        front.send(msg)
    got = front.collect(["ok", "bad", "pair"])
    assert _finishes(got["bad"]) == {0: "error", 1: "error"}
    ref = _reference(tiny_llama_dir, OTHERS)
    assert {rid: _tokens(got[rid]) for rid in ("ok", "pair")} == ref
    assert _finishes(got["ok"]) == {0: "length"} and _finishes(got["pair"]) == {0: "length", 1: "length"}
    # the worker lives on, with every block back
    front.send(_generate("after", _prompt(6, 4), max_tokens=3))
    after = front.collect(["after"])
    assert _finishes(after["after"]) == {0: "length"}
    assert "bad" not in after  # one end per request
    assert w.error is None and w.thread.is_alive()
    assert w.engine.cache.stats().in_use_blocks == 0


def test_a_device_error_ends_the_worker(front, start_worker):
    w = start_worker()

    def execute_or_crash(scheduled, block_table, copy_ops):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    w.engine.runner.execute = execute_or_crash
    front.send(OTHERS[0])
    w.thread.join(timeout=10)
    assert not w.thread.is_alive() and "illegal memory access" in str(w.error)


def _heartbeats(front, seconds):
    """(arrival time, steps) of each heartbeat over `seconds`; everything else is dropped."""
    beats, end = [], time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        msg = front.recv(left)
        if isinstance(msg, P.Heartbeat):
            beats.append((time.monotonic(), msg.steps))
    return beats


def _check_interval(beats, interval, seconds):
    gaps = [b[0] - a[0] for a, b in zip(beats, beats[1:])]
    assert seconds / interval * 0.7 <= len(beats) <= seconds / interval + 1, gaps
    assert max(gaps) < interval * 2 + 0.1, gaps  # a loaded machine delays one, but skips none


def test_heartbeats_come_at_the_interval_idle_and_busy(front, start_worker):
    interval = 0.1
    start_worker(heartbeat_interval_s=interval)
    idle = _heartbeats(front, 1.0)
    _check_interval(idle, interval, 1.0)
    assert len({steps for _, steps in idle}) == 1  # idle: no steps run
    front.send(_generate("long", _prompt(8, 5), max_tokens=400))
    busy = _heartbeats(front, 1.0)
    _check_interval(busy, interval, 1.0)
    assert busy[-1][1] > busy[0][1]  # steps ran between them


def test_a_message_that_does_not_decode_is_skipped(front, start_worker):
    w = start_worker()
    front.push.send(b"\xc1 not msgpack")
    front.push.send(msgspec.msgpack.encode({"type": "no-such-message"}))
    front.push.send(msgspec.msgpack.encode(["generate", "x", "not a token list"]))
    front.send(OTHERS[0])
    assert _finishes(front.collect(["ok"])["ok"]) == {0: "length"}
    assert w.error is None and w.thread.is_alive()


def test_the_worker_process_rejects_skips_beats_and_serves(front, tiny_llama_dir):
    """`python -m radixkv.engine.worker CONFIG_JSON`, as the front starts it."""
    cfg = front.config(heartbeat_interval_s=0.2, parent_pid=os.getpid(), torch_threads=1,
                       model_dir=str(tiny_llama_dir))
    cmd = [sys.executable, "-m", "radixkv.engine.worker", msgspec.json.encode(cfg).decode()]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ready = front.recv(60)
        assert isinstance(ready, P.WorkerReady), ready
        front.push.send(b"\x00\x01 garbage")
        front.send(_generate("bad", [5, 6], top_p=0.0))
        front.send(OTHERS[0])
        got = front.collect(["bad", "ok"])
        assert isinstance(got["bad"], P.RequestRejected) and got["bad"].param == "top_p"
        assert _finishes(got["ok"]) == {0: "length"}
        beats = _heartbeats(front, 1.0)
        _check_interval(beats, 0.2, 1.0)
        assert beats[-1][1] >= 8  # the steps of "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "does not decode" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

