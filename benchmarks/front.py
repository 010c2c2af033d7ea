"""The front's CPU time per streamed token, with the engine's cost left out.

    radixkv bench front [--model DIR] [--streams 32,128,256] [--intervals 1,8] [--max-tokens 128]

The real front (`radixkv serve`'s process: uvicorn, FastAPI, the generation layer, the output
processor, the SSE chunks) runs in a process of its own; its worker is a stand-in (this module,
`_worker`) that speaks the real protocol on the real ZeroMQ pipes: it answers WorkerReady, and
at a fixed step rate sends one StepOutput per step with one new token per running request, ids
of an English passage in the model's own tokenizer, until max_tokens ("length"). The clients are
plain HTTP/1.1 connections in this process, one per stream, that read every SSE byte to
`data: [DONE]`. What is measured is the front process's CPU time (user + system, all its
threads, psutil) from the first request sent to the last stream's end, divided by the completion
tokens the streams' usage chunks report: request parsing, chat template and tokenization are
included, amortized over max_tokens.

Configurations: streams x {chat, completions} x {no stop strings, two stop strings that never
match} x each --stream-interval (a front started per interval). `front_util` is the front's CPU
time over the wall time: near 1.0 the front cannot keep up with the step rate (tokens/s falls
short of streams x --step-rate).

The CPU is shared with this process's clients and the stand-in worker; repeat (--repeats) and
read the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STOP = ["\n\nUser:", "###"]  # never in PASSAGE: the matcher runs on every token, nothing stops
PASSAGE = (
    "The library stood at the end of a narrow street, where the tram turned back toward the river. "
    "Its reading room was long and quiet, lit by tall windows that faced the old harbour; in winter "
    "the light came in low and yellow, and the readers moved their chairs to follow it. Nobody "
    "remembered who had founded it, only that the shelves had been built by a carpenter from the "
    "north, who carved a small fish into the end of every row. Students came in the mornings, "
    "sailors in the afternoons, and in the evenings an old man read the newspapers of five "
    "countries, one after another, folding each with great care before he took the next. "
)


# ---- the stand-in worker ---------------------------------------------------------------------


def worker_main(cfg_json: str) -> int:
    """Speaks the worker's side of radixkv/protocol.py; engine_args: model_dir, step_rate."""
    import msgspec
    import zmq

    from radixkv import protocol as P
    from radixkv.models.source import load_tokenizer

    cfg = msgspec.json.decode(cfg_json.encode(), type=P.WorkerConfig)
    args = cfg.engine_args
    tok = load_tokenizer(str(args["model_dir"]))
    ids = tok.encode(PASSAGE, add_special_tokens=False)
    step_s = 1.0 / float(args.get("step_rate", 40.0))
    ctx = zmq.Context()
    req = ctx.socket(zmq.PULL)
    req.connect(cfg.request_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(cfg.output_addr)
    enc, dec = P.make_encoder(), P.make_decoder("to_worker")
    stats = P.EngineStats(num_blocks=1 << 20, block_size=16, free_blocks=1 << 20, evictable_blocks=0,
                          in_use_blocks=0, running=0, waiting=0)
    out.send(enc.encode(P.WorkerReady(os.getpid(), P.PROTOCOL_VERSION, 1 << 20, 16, 1 << 20, len(tok), stats)))
    running: dict[str, list] = {}  # request id -> [generated, max_tokens, n, prompt length]
    steps, next_step, last_beat = 0, time.monotonic(), time.monotonic()
    while os.getppid() == cfg.parent_pid:
        timeout = max(0.0, next_step - time.monotonic()) if running else cfg.heartbeat_interval_s / 2
        if req.poll(int(timeout * 1000), zmq.POLLIN):
            while True:
                try:
                    msg = dec.decode(req.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, P.GenerateRequest):
                    running[msg.request_id] = [0, msg.sampling.max_tokens, msg.sampling.n, len(msg.prompt_token_ids)]
                elif isinstance(msg, P.AbortRequest):
                    for rid in msg.request_ids:
                        running.pop(rid, None)
        now = time.monotonic()
        if running and now >= next_step:
            next_step = max(next_step + step_s, now - step_s)
            deltas = []
            for rid, r in list(running.items()):
                tid = ids[r[0] % len(ids)]
                r[0] += 1
                done = r[0] >= r[1]
                choices = [P.ChoiceDelta(i, [tid], finish_reason="length" if done else None) for i in range(r[2])]
                deltas.append(P.RequestDelta(rid, choices, r[3], 0, done))
                if done:
                    del running[rid]
            steps += 1
            out.send(enc.encode(P.StepOutput(deltas)))
        if now - last_beat >= cfg.heartbeat_interval_s:
            last_beat = now
            out.send(enc.encode(P.Heartbeat(steps)))
    return 0


# ---- the front process -----------------------------------------------------------------------


def front_main(argv: list[str]) -> int:
    """The real front (tokenizer_server.serve.run) with the stand-in worker."""
    model_dir, port, interval, step_rate = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    from tokenizer_server.serve import run

    kwargs = dict(host="127.0.0.1", port=port, api_keys=[], served_model_names=["bench"], restart_worker=False,
                  worker_timeout=60.0, shutdown_timeout=5.0, salt_secret="bench", cache_salt_scope="key",
                  protect_metrics=False, torch_threads=None, worker_ready_timeout=120.0, log_level="warning",
                  access_log=False, stream_interval=interval,
                  worker_cmd=[sys.executable, "-m", "benchmarks.front", "_worker"])
    engine_args = {"model_dir": model_dir, "step_rate": step_rate}
    profile = os.environ.get("RADIXKV_FRONT_PROFILE")  # a cProfile stats file of the front, for digging
    if profile:
        import cProfile

        prof = cProfile.Profile()
        try:
            return prof.runcall(run, model_dir, engine_args, **kwargs)
        finally:
            prof.dump_stats(profile)
    return run(model_dir, engine_args, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Front:
    def __init__(self, model_dir: str, interval: int, step_rate: float):
        self.port = _free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.front", "_front", model_dir, str(self.port), str(interval),
             str(step_rate)], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the front did not start")
            time.sleep(0.2)
        import psutil

        self.ps = psutil.Process(self.proc.pid)

    def _healthy(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                return s.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    def cpu(self) -> tuple[float, float]:
        t = self.ps.cpu_times()
        return t.user, t.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- the clients -----------------------------------------------------------------------------


def _body(api: str, stop: bool, max_tokens: int, i: int) -> tuple[str, bytes]:
    req = {"model": "bench", "max_tokens": max_tokens, "stream": True, "temperature": 0,
           "stream_options": {"include_usage": True}}
    if stop:
        req["stop"] = STOP
    if api == "chat":
        req["messages"] = [{"role": "user", "content": f"Tell me about the library, reader {i}."}]
        return "/v1/chat/completions", json.dumps(req).encode()
    req["prompt"] = f"Reader {i} walked into the library and"
    return "/v1/completions", json.dumps(req).encode()


def _dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"stream failed: {raw[:300]!r}")
    out, pos = [], 0
    while True:
        eol = rest.index(b"\r\n", pos)
        size = int(rest[pos:eol], 16)
        if size == 0:
            return b"".join(out)
        out.append(rest[eol + 2 : eol + 2 + size])
        pos = eol + 4 + size


async def _stream(port: int, path: str, body: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(body), body))
    parts = []
    while chunk := await reader.read(1 << 16):
        parts.append(chunk)
    writer.close()
    return _dechunk(b"".join(parts))


def _parse(sse: bytes, api: str) -> tuple[int, int, str]:
    """(completion tokens from usage, chunks with choices, choice 0's text)."""
    events = [e[len(b"data: "):] for e in sse.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-1:]
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    text = []
    for c in chunks:
        for ch in c["choices"]:
            text.append(ch["delta"].get("content", "") if api == "chat" else ch["text"])
    return usage["completion_tokens"], sum(1 for c in chunks if c["choices"]), "".join(text)


def measure_one(front: Front, api: str, stop: bool, streams: int, max_tokens: int) -> dict:
    bodies = [_body(api, stop, max_tokens, i) for i in range(streams)]

    async def go():
        return await asyncio.gather(*[_stream(front.port, p, b) for p, b in bodies])

    time.sleep(0.3)  # let the last run's tail settle
    (user0, sys0), t0 = front.cpu(), time.perf_counter()
    raws = asyncio.run(go())
    wall, (user1, sys1) = time.perf_counter() - t0, front.cpu()
    user, system = user1 - user0, sys1 - sys0
    cpu = user + system
    parsed = [_parse(r, api) for r in raws]
    tokens = sum(p[0] for p in parsed)
    return {"api": api, "stop": stop, "streams": streams, "tokens": tokens, "chunks": sum(p[1] for p in parsed),
            "wall_s": round(wall, 3), "front_cpu_s": round(cpu, 3),
            "front_us_per_token": round(cpu / tokens * 1e6, 2),
            "front_sys_share": round(system / cpu, 3) if cpu else 0.0, "front_util": round(cpu / wall, 3),
            "tokens_per_s": round(tokens / wall), "text_sha": hashlib.sha256(parsed[0][2].encode()).hexdigest()[:16]}


def run_all(model_dir: str, streams: list[int], intervals: list[int], apis: list[str], stops: list[bool],
            max_tokens: int, step_rate: float, repeats: int) -> list[dict]:
    rows = []
    for interval in intervals:
        front = Front(model_dir, interval, step_rate)
        try:
            measure_one(front, apis[0], False, 8, 16)  # warm-up: imports, first template render
            for api in apis:
                for stop in stops:
                    for n in streams:
                        runs = [measure_one(front, api, stop, n, max_tokens) for _ in range(repeats)]
                        row = dict(runs[0], stream_interval=interval)
                        for k in ("wall_s", "front_cpu_s", "front_us_per_token", "front_sys_share", "front_util",
                                  "tokens_per_s"):
                            row[k] = statistics.median(r[k] for r in runs)
                        row["front_us_per_token_runs"] = [r["front_us_per_token"] for r in runs]
                        rows.append(row)
                        print(f"interval {interval} {api:11s} stop={'yes' if stop else 'no ':3s} streams {n:3d}: "
                              f"{row['front_us_per_token']:6.1f} us/token (runs {row['front_us_per_token_runs']}), "
                              f"system {row['front_sys_share']:.0%}, front util {row['front_util']:.2f}, {row['tokens_per_s']} tokens/s",
                              flush=True)
        finally:
            front.stop()
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Front CPU per streamed token",
        "",
        f"Stand-in worker at {meta['step_rate']} steps/s, {meta['max_tokens']} tokens per request, "
        f"median of {meta['repeats']}; front CPU = user + system of the front process. Machine: {meta['machine']}.",
        "",
        "| interval | api | stop strings | streams | front us/token | of it system | front util | tokens/s | chunks |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['stream_interval']} | {r['api']} | {'yes' if r['stop'] else 'no'} | {r['streams']} | "
                     f"{r['front_us_per_token']:.1f} | {r['front_sys_share']:.0%} | {r['front_util']:.2f} | {r['tokens_per_s']} | {r['chunks']} |")
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    from benchmarks.out_dir import OUT_HELP

    p.add_argument("--model", default=None, metavar="DIR",
                   help="model folder whose tokenizer the front uses (default: a tiny model made in a temp folder)")
    p.add_argument("--streams", default="32,128,256", help="concurrent streams, comma-separated")
    p.add_argument("--intervals", default="1,8", help="--stream-interval values, comma-separated")
    p.add_argument("--apis", default="chat,completions")
    p.add_argument("--stop", default="no,yes", help="without (no) and/or with (yes) stop strings")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--step-rate", type=float, default=40.0, help="the stand-in worker's steps per second")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help=OUT_HELP)


def main(args) -> int:
    if not isinstance(args, argparse.Namespace):
        ap = argparse.ArgumentParser(prog="radixkv bench front", description=__doc__.splitlines()[0])
        add_arguments(ap)
        args = ap.parse_args(args)
    from benchmarks.out_dir import out_dir

    import shutil
    import tempfile

    model_dir, made = args.model, None
    if model_dir is None:
        from radixkv.models.tiny import build_tiny_model

        made = tempfile.mkdtemp(prefix="radixkv-front-tiny-")
        model_dir = str(build_tiny_model(Path(made), arch="llama", seed=0))
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    stops = [{"no": False, "yes": True}[x] for x in args.stop.split(",") if x]
    try:
        rows = run_all(model_dir, ints(args.streams), ints(args.intervals), args.apis.split(","), stops,
                       args.max_tokens, args.step_rate, args.repeats)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
    meta = {"model": model_dir, "step_rate": args.step_rate, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
            "command": "radixkv bench front " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "front"] else [])}
    out = out_dir(args.out, "front")
    (out / "front.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "front.md").write_text(markdown(rows, meta))
    print(out)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        raise SystemExit(worker_main(sys.argv[2]))
    if sys.argv[1:2] == ["_front"]:
        raise SystemExit(front_main(sys.argv[2:]))
    raise SystemExit(main(sys.argv[1:]))
