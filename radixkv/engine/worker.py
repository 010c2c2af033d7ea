"""The engine worker process: `python -m radixkv.engine.worker CONFIG_JSON`.

Started by the front (tokenizer_server). Connects a PULL socket for requests and a
PUSH socket for outputs, builds the Engine, says hello (WorkerReady) and loops:
drain the request socket without blocking while requests run (block, with a
timeout, when idle), run one step, send one StepOutput for everything that step
produced, and a Heartbeat whenever heartbeat_interval_s has passed since the last one,
busy or idle. Each time the engine goes idle it checks the cache invariants and sends a
stats snapshot, so the front's /metrics shows the settled pool.

A request's failure stays that request's: add_request's ValueError becomes a
RequestRejected naming the field; any other exception while adding it, stepping it or
converting its output is logged with its traceback and the request finishes with
finish_reason "error" (the engine isolates the step, see engine.py). A message that does
not decode is logged and skipped.

It exits on SIGTERM (the front stopping it), when its parent dies, or when the engine
cannot go on (a device-level error, a broken cache invariant: Engine.step raises only
those); in the last case it first sends WorkerFatal with the error and exits with 1. Parent
death arrives as SIGUSR1 (PR_SET_PDEATHSIG), a signal of its own, because a killed
front's threads die one by one and the worker may hear of it while getppid() still
names the front; a getppid check in the loop covers the moment before prctl. An
orphaned worker removes the front's ipc files, which nobody else will. SIGINT is
ignored: a Ctrl-C in the terminal reaches the whole process group, and the front,
not the worker, decides the order of shutdown.
"""

import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from radixkv import protocol as P
from radixkv.engine.errors import is_device_error
from radixkv.engine.metrics import to_engine_stats
from radixkv.engine.outputs import to_delta

logger = logging.getLogger("radixkv.engine")

IDLE_POLL_MS = 200  # how often an idle worker looks at the stop flag and its parent
PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGUSR1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
    except (OSError, AttributeError):
        pass  # not Linux: the getppid check in the loop still notices


def _remove_orphaned_ipc(cfg: P.WorkerConfig) -> None:
    """The front died without cleaning up (SIGKILL): remove its socket files and folder."""
    paths = [a.removeprefix("ipc://") for a in (cfg.request_addr, cfg.output_addr) if a.startswith("ipc://")]
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if paths:
        try:
            os.rmdir(os.path.dirname(paths[0]))
        except OSError:
            pass  # not empty or gone: not ours to force


def _set_torch_threads(requested: int | None) -> None:
    """CPU inference shares the machine with the front process: by default leave it a
    core. Oversubscribed intra-op threads spin at their barriers, and on a busy 2-core
    machine a step takes 10x longer with 2 threads than with 1."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(requested if requested is not None else max(1, cores - 1))


# NOTE: no garbage collection in the decode steady state. A step allocates a few container
# objects per running sequence (scheduled pairs, outputs, deltas) that reference counting frees
# when the step is done, but with the default young threshold (700 net allocations) a step of
# 256 sequences ran a young collection every step; its survivors (the step's outputs, still
# alive) were promoted until a full collection ran, traversing everything the process holds:
# torch, the model, every running sequence's token list (`radixkv bench host --gc default`
# before this change, 127 decode steps: 112/10/1 collections of generations 0/1/2 at 256
# sequences, 325/30/2 at 512). So once the engine is up (model loaded, warmed up) the worker
# freezes what start-up made (never garbage: gc.freeze keeps it out of every later
# collection) and raises the young threshold well above what a step allocates at
# max_num_seqs: decode steps then run no collection at all (`--gc worker`: 0/0/0).
# Collections still run as requests come and go (a request holds some 20 tracked objects: a
# young collection per ~2.5 * max_num_seqs new requests), and they free finished requests,
# which are reference cycles (Request <-> Sequence); the thresholds of the older generations
# stay the default. The front freezes its start-up objects too (tokenizer_server/serve.py).
GC_YOUNG_OBJECTS_PER_SEQ = 50


def settle_gc(max_num_seqs: int = 256) -> None:
    """After start-up: freeze what exists, no collection during decode steps (the NOTE above)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(max(10_000, GC_YOUNG_OBJECTS_PER_SEQ * max_num_seqs), middle, old)


def to_sampling_params(opts: P.SamplingOptions):
    from radixkv.engine.sampling_params import SamplingParams

    return SamplingParams(**msgspec.structs.asdict(opts))


def error_delta(request_id: str, indices, num_prompt_tokens: int, num_cached_tokens: int = 0) -> P.RequestDelta:
    """The end of a request that failed: every choice finishes with "error", no tokens."""
    choices = [P.ChoiceDelta(i, [], finish_reason="error") for i in indices]
    return P.RequestDelta(request_id, choices, num_prompt_tokens, num_cached_tokens, True)


class Worker:
    def __init__(self, cfg: P.WorkerConfig, engine, req_sock, out_sock):
        self.cfg, self.engine, self.req, self.out = cfg, engine, req_sock, out_sock
        self.enc = P.make_encoder()
        self.dec = P.make_decoder("to_worker")
        self.stop = False
        self.invariant_checks = 0
        self.steps = 0
        self.last_stats = 0.0
        self.last_heartbeat = time.monotonic()

    def stats(self) -> P.EngineStats:
        stats = to_engine_stats(self.engine.metrics(), self.invariant_checks)
        self.last_stats = time.monotonic()
        return stats

    def ready_message(self) -> P.WorkerReady:
        e = self.engine
        return P.WorkerReady(os.getpid(), P.PROTOCOL_VERSION, e.num_blocks, e.block_size, e.max_model_len,
                             e.model_config.vocab_size, self.stats())

    def send(self, msg) -> None:
        self.out.send(self.enc.encode(msg))

    # ---- requests in --------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, P.GenerateRequest):
            self.add(msg)
        elif isinstance(msg, P.AbortRequest):
            for rid in msg.request_ids:
                self.abort(rid)

    def add(self, msg: P.GenerateRequest) -> None:
        try:
            params = to_sampling_params(msg.sampling)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.cache_salt)
        except ValueError as e:  # bad input the front could not judge
            self.send(P.RequestRejected(msg.request_id, str(e), getattr(e, "param", None)))
        except Exception as e:
            if is_device_error(e):
                raise
            logger.exception("request %s could not be added; it fails", msg.request_id)
            n = msg.sampling.n if 1 <= msg.sampling.n <= self.engine.config.max_num_seqs else 1  # maybe unchecked
            self.send(P.StepOutput([error_delta(msg.request_id, range(n), len(msg.prompt_token_ids))]))

    def abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception as e:
            if is_device_error(e):
                raise
            logger.exception("abort of request %s failed; failing the request instead", request_id)
            self.engine.fail_request(request_id)

    def drain(self, timeout_ms: int) -> None:
        if not self.req.poll(timeout_ms, zmq.POLLIN):
            return
        while True:
            try:
                buf = self.req.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.dec.decode(buf)
            except msgspec.DecodeError as e:  # ValidationError included
                logger.warning("skipped a message of %d bytes that does not decode: %s", len(buf), e)
                continue
            self.handle(msg)

    # ---- outputs ----------------------------------------------------------------------
    def deltas(self, outputs) -> list[P.RequestDelta]:
        """One delta per output; an output that does not convert fails its request only."""
        deltas = []
        for out in outputs:
            try:
                deltas.append(to_delta(out))
            except Exception as e:
                if is_device_error(e):
                    raise
                logger.exception("the output of request %s does not convert; the request fails", out.request_id)
                if out.finished:
                    deltas.append(error_delta(out.request_id, [c.index for c in out.outputs] or [0],
                                              len(out.prompt_token_ids), out.num_cached_tokens))
                else:  # the engine reports its end ("error") in the next step
                    self.engine.fail_request(out.request_id)
        return deltas

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat >= self.cfg.heartbeat_interval_s:
            self.last_heartbeat = now
            self.send(P.Heartbeat(self.steps))

    def idle_poll_ms(self) -> int:
        """Idle: wait for requests, but wake for the next heartbeat."""
        due = self.last_heartbeat + self.cfg.heartbeat_interval_s - time.monotonic()
        return max(0, min(IDLE_POLL_MS, int(due * 1000) + 1))

    def run(self) -> int:
        self.send(self.ready_message())
        self.last_heartbeat = time.monotonic()
        dirty = False  # something happened since the last idle check
        while not self.stop and os.getppid() == self.cfg.parent_pid:
            busy = self.engine.has_unfinished_requests()
            self.drain(0 if busy else self.idle_poll_ms())
            if self.engine.has_unfinished_requests():
                dirty = True
                outputs = self.engine.step()  # raises only what the worker cannot go on after
                self.steps += 1
                stats = None
                if time.monotonic() - self.last_stats >= self.cfg.stats_interval_s:
                    stats = self.stats()
                if outputs or stats is not None:
                    self.send(P.StepOutput(self.deltas(outputs), stats))
            if dirty and not self.engine.has_unfinished_requests():
                dirty = False
                self.engine.cache.check_invariants()  # AssertionError -> fatal
                self.invariant_checks += 1
                self.send(P.StepOutput([], self.stats()))
            self.heartbeat()
        return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m radixkv.engine.worker CONFIG_JSON (started by `radixkv serve`)", file=sys.stderr)
        return 2
    cfg = msgspec.json.decode(argv[0], type=P.WorkerConfig)
    worker, orphaned = None, False

    def on_stop_signal(signum, _frame):
        nonlocal orphaned
        orphaned = orphaned or signum == PARENT_DEATH_SIGNAL
        if worker is None:
            raise SystemExit(0)  # still loading the model: leave now
        worker.stop = True

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(PARENT_DEATH_SIGNAL, on_stop_signal)  # before prctl: its default action kills
    _die_with_parent()
    ctx = zmq.Context()
    req, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    req.setsockopt(zmq.RCVHWM, 0)
    out.setsockopt(zmq.SNDHWM, 0)  # the front reads all the time; never block a step on it
    req.connect(cfg.request_addr)
    out.connect(cfg.output_addr)
    try:
        from radixkv.engine.config import EngineConfig
        from radixkv.engine.engine import Engine

        _set_torch_threads(cfg.torch_threads)
        # The worker checks the invariants itself, once per idle transition, and counts them.
        engine = Engine(EngineConfig(**{"check_invariants": False, **cfg.engine_args}))
        settle_gc(engine.config.max_num_seqs)
        worker = Worker(cfg, engine, req, out)
        return worker.run()
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exc()
        out.send(P.make_encoder().encode(P.WorkerFatal(f"{type(e).__name__}: {e}")))
        return 1
    finally:
        orphaned = orphaned or os.getppid() != cfg.parent_pid
        if orphaned:
            _remove_orphaned_ipc(cfg)
        req.close(linger=0)
        out.close(linger=0 if orphaned else 1000)  # let a last WorkerFatal reach a live front
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
