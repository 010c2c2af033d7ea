"""Serving vs offline: the same model, prompts and engine options, once through the offline
engine and once through `radixkv serve` over HTTP, on one machine in one run.

(a) offline: an Engine (radixkv/engine/engine.py) in a process of its own, every request
    added at once, stepped until all finish: output tok/s, TTFT (time to the step that
    reports a request's first token), prefix-cache hit rate;
(b) served: a fresh `python -m radixkv.cli serve MODEL ...` process (front + engine worker),
    driven by benchmarks/serve.py (`radixkv bench serve --workload generated_shared_prefix
    --num-requests N`, all at once, streamed): output tok/s, TTFT, hit rate;
(c) the ratio of (b)'s output tok/s to (a)'s.

Workload: generated_shared_prefix (benchmarks/workloads.py): N/16 groups x 16 prompts, a
2,048-token prefix per group + a 128-token question, 256 output tokens, token ids only, EOS
ignored, greedy. Both sides build their prompts with serve.py's build_requests from the same
arguments and seed. Engine options given here (every one `radixkv serve` takes, see
radixkv/cli/serve.py's ENGINE_OPTIONS) go to both sides; the offline engine is built the way the
server's worker builds its own (check_invariants off, the worker's torch thread count and gc
settings), and the server's engine arguments, read from its worker's command line, are
recorded next to the offline ones. Each side first serves `--warmup` requests of another
seed (kernels compiled, graphs captured, outside the timing); they leave no prefix the
measured prompts can hit.

Model: `--model DIR` (an HF folder with a tokenizer), or by default a folder written here: a
Llama-3-8B-shaped config.json (benchmarks/throughput.py's LLAMA3_8B) loaded with
load_format=dummy (seeded random weights, no weight files) and a byte-level tokenizer with one
token per id (" t0", " t1", ...; BOS/EOS special), so the front can detokenize any id on its
fast path, as it does a real byte-level BPE's. Default device cuda, dtype bfloat16.
`--tiny`: a tiny shape on the CPU (float32) and the workload scaled (64 requests, scale 1/16),
under a minute on a laptop-class CPU.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.out_dir import OUT_HELP, out_dir

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = "generated_shared_prefix"
TINY_SHAPE = dict(vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                  dtype="float32", rope_parameters=dict(rope_type="default", rope_theta=10000.0))
TINY_NUM_REQUESTS, TINY_SCALE = 64, 1 / 16
BOS_TEXT, EOS_TEXT = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
FLAGS = {"enforce_eager": ("--enforce-eager", True), "enable_prefix_caching": ("--no-prefix-caching", False)}


def _engine_options() -> dict:
    from radixkv.cli.serve import ENGINE_OPTIONS  # light: no torch, no transformers

    return ENGINE_OPTIONS


# ---- the model folder ----------------------------------------------------------------------
def model_config(tiny: bool) -> dict:
    from benchmarks.throughput import LLAMA3_8B

    return {**LLAMA3_8B, **(TINY_SHAPE if tiny else {})}


def write_tokenizer(path: Path, vocab_size: int, bos_id: int, eos_id: int, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json: one token per id, " t{id}", BOS and EOS special;
    a BPE without merges under a byte-level decoder (the front's per-token fast path)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = {bos_id: BOS_TEXT, eos_id: EOS_TEXT}
    vocab = {specials.get(i, f"\u0120t{i}"): i for i in range(vocab_size)}  # \u0120: a space, byte-level
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials.values()])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TEXT, "eos_token": EOS_TEXT,
           "pad_token": EOS_TEXT, "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": max_len, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def write_model_folder(path: Path, tiny: bool) -> Path:
    """config.json, generation_config.json and the tokenizer; no weights (load with load_format=dummy)."""
    cfg = model_config(tiny)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(path, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"])
    return path


# ---- arguments -----------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="HF model folder with a tokenizer (default: a Llama-3-8B-shaped folder written to a temp "
                        "folder, dummy weights)")
    p.add_argument("--tiny", action="store_true",
                   help=f"a tiny model shape on the CPU, float32, and the workload scaled ({TINY_NUM_REQUESTS} "
                        f"requests, scale {TINY_SCALE})")
    p.add_argument("--num-requests", type=int, default=None, help="requests, 16 per group (default 1024)")
    p.add_argument("--scale", type=float, default=None, help="shrink prompt and output lengths (default 1)")
    p.add_argument("--vocab", type=int, default=2048, help="prompt ids are drawn from [3, VOCAB) (serve.py's)")
    p.add_argument("--workload-seed", type=int, default=0, help="the workload's seed (serve.py's --seed); --seed is "
                   "the engine's (dummy weights)")
    p.add_argument("--warmup", type=int, default=16,
                   help="requests of another seed each side serves first, untimed (0: none)")
    g = p.add_argument_group("engine options, the same on both sides (default: the engine's)")
    for name, typ in _engine_options().items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=f"engine option {name}")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of both engines (default: the server worker's, all cores but one)")
    p.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for the server's /health")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--no-progress", action="store_true")


def resolve(args) -> None:
    """Fill the defaults that depend on --tiny and --model."""
    if args.num_requests is None:
        args.num_requests = TINY_NUM_REQUESTS if args.tiny else 1024
    if args.scale is None:
        args.scale = TINY_SCALE if args.tiny else 1.0
    if args.device is None:
        args.device = "cpu" if args.tiny else "cuda"
    if args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    if args.load_format is None and args.model is None:
        args.load_format = "dummy"


def engine_args(args) -> dict:
    """EngineConfig fields both sides get (the server's worker gets exactly these, plus model_dir)."""
    out = {name: getattr(args, name) for name in _engine_options() if getattr(args, name) is not None}
    if args.enforce_eager:
        out["enforce_eager"] = True
    if args.no_prefix_caching:
        out["enable_prefix_caching"] = False
    return out


def serve_flags(engine: dict) -> list[str]:
    """`radixkv serve` options for engine_args()'s dict."""
    options = _engine_options()
    flags = []
    for name, value in engine.items():
        if name in options:
            flags += ["--" + name.replace("_", "-"), str(value)]
        elif name in FLAGS and value == FLAGS[name][1]:
            flags.append(FLAGS[name][0])
        else:
            raise ValueError(f"engine option {name}={value!r} has no `radixkv serve` flag")
    return flags


def workload_args(args, seed: int, num_requests: int) -> argparse.Namespace:
    """The arguments serve.py's build_requests reads."""
    return argparse.Namespace(workload=WORKLOAD, num_requests=num_requests, scale=args.scale, vocab=args.vocab,
                              seed=seed)


def fingerprint(requests) -> str:
    """sha256 of the prompts and their output lengths, in order: both sides' must be equal."""
    import hashlib

    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.prompt, r.max_tokens]).encode())
    return h.hexdigest()


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


# ---- (a) offline ---------------------------------------------------------------------------
def _pcts(xs: list[float]) -> dict:
    import statistics

    from benchmarks.serve import _pct

    return {"mean": statistics.fmean(xs) if xs else float("nan"), **{f"p{q}": _pct(xs, q) for q in (50, 90, 99)}}


def run_engine(engine, requests, tag: str) -> dict:
    """Every request added at once, stepped to the end; output tokens, seconds, TTFT, hit rate."""
    from radixkv.engine.sampling_params import SamplingParams

    stats0 = engine.cache.stats()
    first: dict[str, float] = {}
    produced = 0
    t = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"{tag}-{i}", r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                                  ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and any(len(c.token_ids) for c in out.outputs):
                first[out.request_id] = time.perf_counter()
            if out.finished:
                produced += sum(len(c.token_ids) for c in out.outputs)
        steps += 1
    seconds = time.perf_counter() - t
    stats = engine.cache.stats()
    queries = stats.prefix_query_tokens - stats0.prefix_query_tokens
    hits = stats.prefix_hit_tokens - stats0.prefix_hit_tokens
    return {"requests": len(requests), "seconds": seconds, "output_tokens": produced, "steps": steps,
            "output_tok_per_s": produced / seconds, "request_per_s": len(requests) / seconds,
            "hit_rate": hits / queries if queries else None, "ttft": _pcts([v - t for v in first.values()])}


def offline_main(config_path: str) -> int:
    """The offline side, in a process of its own: the engine built as the server's worker builds it."""
    from dataclasses import asdict

    from benchmarks.serve import build_requests
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.engine.worker import _set_torch_threads, settle_gc

    job = json.loads(Path(config_path).read_text())
    _set_torch_threads(job["torch_threads"])
    t = time.perf_counter()
    engine = Engine(EngineConfig(**{"check_invariants": False, "model_dir": job["model_dir"], **job["engine_args"]}))
    settle_gc(engine.config.max_num_seqs)
    ready_s = time.perf_counter() - t
    wl = argparse.Namespace(**job["workload"])
    warm = None
    if job["warmup"]:
        warm = run_engine(engine, build_requests(argparse.Namespace(**{**job["workload"], "seed": job["warmup_seed"],
                                                                       "num_requests": job["warmup"]})), "warmup")
        print(f"offline: warm-up {warm['requests']} requests in {warm['seconds']:.1f} s", file=sys.stderr, flush=True)
    requests = build_requests(wl)
    print(f"offline: {len(requests)} requests", file=sys.stderr, flush=True)
    result = run_engine(engine, requests, "r")
    import torch

    result.update(engine_ready_s=ready_s, warmup=warm, num_blocks=engine.num_blocks,
                  expected_output_tokens=sum(r.max_tokens for r in requests), prompts_sha256=fingerprint(requests),
                  prompt_tokens=sum(len(r.prompt) for r in requests), torch_threads=torch.get_num_threads(),
                  engine_config=asdict(engine.config), async_scheduling=engine.async_scheduling,
                  device_name=torch.cuda.get_device_name() if engine.device.startswith("cuda") else "cpu")
    Path(job["result"]).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def run_offline(args, model_dir: str, engine: dict, out: Path) -> dict:
    job = {"model_dir": model_dir, "engine_args": engine, "torch_threads": args.torch_threads,
           "workload": vars(workload_args(args, args.workload_seed, args.num_requests)), "warmup": args.warmup,
           "warmup_seed": args.workload_seed + 1000, "result": str(out / "offline_result.json")}
    config = out / "offline_job.json"
    config.write_text(json.dumps(job, indent=1) + "\n")
    r = subprocess.run([sys.executable, "-m", "benchmarks.serve_vs_offline", "_offline", str(config)], cwd=REPO,
                       env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"the offline run exited with {r.returncode}")
    return json.loads(Path(job["result"]).read_text())


# ---- (b) served ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_server(model_dir: str, engine: dict, args, log_path: Path, name: str):
    """A fresh `radixkv serve` process; returns (proc, url) once /health answers 200."""
    import httpx

    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", name, *serve_flags(engine)]
    if args.torch_threads is not None:
        cmd += ["--torch-threads", str(args.torch_threads)]
    print("server: " + " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.server_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; log:\n{_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server was not healthy after {args.server_timeout} s; log:\n{_tail(log_path)}")
        time.sleep(0.5)


def server_engine_args(proc) -> dict | None:
    """The engine arguments the server's worker was started with (the JSON last on its command line)."""
    try:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                cfg = json.loads(child.cmdline()[-1])
            except (ValueError, IndexError, psutil.Error):
                continue
            if isinstance(cfg, dict) and "engine_args" in cfg:
                return {"torch_threads": cfg.get("torch_threads"), **cfg["engine_args"]}
    except Exception:  # noqa: BLE001 - a record, not a requirement
        return None
    return None


def stop_server(proc, timeout: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def run_served(args, model_dir: str, engine: dict, out: Path) -> dict:
    import asyncio

    from benchmarks import serve

    name = "serve-vs-offline"
    t = time.perf_counter()
    proc, url = start_server(model_dir, engine, args, out / "server.log", name)
    try:
        ready_s = time.perf_counter() - t
        worker_args = server_engine_args(proc)
        warm = None
        if args.warmup:
            reqs = serve.build_requests(workload_args(args, args.workload_seed + 1000, args.warmup))
            t = time.perf_counter()
            res = asyncio.run(serve.run_load(url, name, reqs, 0, 0.0, 0, args.workload_seed, progress=False))
            warm = {"requests": len(res), "failed": sum(not r.ok for r in res), "seconds": time.perf_counter() - t}
            print(f"served: warm-up {warm['requests']} requests in {warm['seconds']:.1f} s", flush=True)
        ap = argparse.ArgumentParser()
        serve.add_arguments(ap)
        argv = ["--url", url, "--model", name, "--workload", WORKLOAD, "--num-requests", str(args.num_requests),
                "--scale", str(args.scale), "--vocab", str(args.vocab), "--seed", str(args.workload_seed),
                "--out", str(out / "serve")] + (["--no-progress"] if args.no_progress else [])
        print("client: radixkv bench serve " + " ".join(argv), flush=True)
        client_args = ap.parse_args(argv)
        prompts_sha256 = fingerprint(serve.build_requests(client_args))  # what serve.main sends
        rc = serve.main(client_args)
        data = json.loads((out / "serve" / f"serve_{WORKLOAD}.json").read_text())
    finally:
        code = stop_server(proc)
    summary = data["summary"]
    summary.update(exit_code=rc, server_exit_code=code, server_ready_s=ready_s, warmup=warm,
                   output_tokens=sum(r["output_tokens"] for r in data["requests"] if r["ok"]),
                   worker_engine_args=worker_args, client_argv=argv, prompts_sha256=prompts_sha256)
    return summary


# ---- report --------------------------------------------------------------------------------
def same_engine_args(worker: dict | None, engine: dict) -> bool | None:
    """Whether the server's worker got exactly the engine arguments the offline engine was built
    from (None: its command line could not be read)."""
    if worker is None:
        return None
    return {k: v for k, v in worker.items() if k not in ("torch_threads", "model_dir")} == engine


def markdown(result: dict) -> str:
    o, s, m = result["offline"], result["served"], result["meta"]
    ms = lambda d, k: d["ttft"][k] * 1e3  # noqa: E731
    rows = [
        "| side | output tok/s | seconds | output tokens | TTFT mean / p50 / p90 / p99 (ms) | hit rate |",
        "|---|---:|---:|---:|---|---:|",
        f"| offline engine | {o['output_tok_per_s']:,.0f} | {o['seconds']:.2f} | {o['output_tokens']:,} | "
        f"{ms(o, 'mean'):.0f} / {ms(o, 'p50'):.0f} / {ms(o, 'p90'):.0f} / {ms(o, 'p99'):.0f} | "
        f"{(o['hit_rate'] or 0):.1%} |",
        f"| `radixkv serve` (HTTP, streamed) | {s['output_tok_per_s']:,.0f} | {s['seconds']:.2f} | "
        f"{s['output_tokens']:,} | {ms(s, 'mean'):.0f} / {ms(s, 'p50'):.0f} / {ms(s, 'p90'):.0f} / {ms(s, 'p99'):.0f} "
        f"| {(s['server_hit_rate'] or 0):.1%} |",
    ]
    return (f"# Serving vs offline: {WORKLOAD}\n\n{m['date']}, {m['device_name']}, model {m['model']}; "
            f"{m['num_requests']} requests (scale {m['scale']}), all at once, greedy, EOS ignored; warm-up "
            f"{m['warmup']} requests each side; engine options {json.dumps(m['engine_args'])}; the server's worker "
            f"got the same: {m['same_engine_args']}; same prompts: {result['same_prompts']}.\n\n`{m['command']}`\n\n" + "\n".join(rows) +
            f"\n\nHTTP / offline output tok/s: **{result['ratio_http_over_offline']:.3f}**; "
            f"failed requests: {s['failed']}.\n")


def main(args=None) -> int:
    """`args`: parsed arguments (radixkv bench serve-vs-offline), or an argv list, or None (sys.argv)."""
    if not isinstance(args, argparse.Namespace):
        ap = argparse.ArgumentParser(prog="radixkv bench serve-vs-offline", description=__doc__.splitlines()[0])
        add_arguments(ap)
        args = ap.parse_args(sys.argv[1:] if args is None else list(args))
    resolve(args)
    out = out_dir(args.out, "serve-vs-offline")
    engine = engine_args(args)
    made = None
    model_dir = args.model
    if model_dir is None:
        made = tempfile.mkdtemp(prefix="radixkv-serve-vs-offline-model-")
        model_dir = str(write_model_folder(Path(made), args.tiny))
    try:
        print(f"offline: engine {json.dumps(engine)}", flush=True)
        offline = run_offline(args, model_dir, engine, out)
        print(f"offline: {offline['output_tok_per_s']:,.0f} output tok/s ({offline['output_tokens']:,} tokens in "
              f"{offline['seconds']:.2f} s)", flush=True)
        served = run_served(args, model_dir, engine, out)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
    ratio = served["output_tok_per_s"] / offline["output_tok_per_s"]
    shape = "tiny" if args.tiny else "Llama-3-8B shape"
    meta = {"date": time.strftime("%Y-%m-%d"), "workload": WORKLOAD, "num_requests": args.num_requests,
            "scale": args.scale, "vocab": args.vocab, "workload_seed": args.workload_seed, "warmup": args.warmup,
            "model": args.model or f"{shape}, dummy weights", "device_name": offline["device_name"],
            "engine_args": engine, "torch_threads": args.torch_threads,
            "same_engine_args": same_engine_args(served.get("worker_engine_args"), engine),
            "command": "radixkv bench serve-vs-offline " + " ".join(
                sys.argv[3:] if sys.argv[1:3] == ["bench", "serve-vs-offline"] else sys.argv[1:])}
    result = {"meta": meta, "offline": offline, "served": served, "ratio_http_over_offline": ratio,
              "same_output_tokens": offline["output_tokens"] == served["output_tokens"],
              "same_prompts": offline["prompts_sha256"] == served["prompts_sha256"]}
    (out / "serve_vs_offline.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "serve_vs_offline.md").write_text(markdown(result))
    print(markdown(result))
    print(f"results in {out}/serve_vs_offline.*")
    ok = served["failed"] == 0 and result["same_output_tokens"] and result["same_prompts"] \
        and served["server_exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["_offline"]:
        raise SystemExit(offline_main(sys.argv[2]))
    raise SystemExit(main(sys.argv[1:]))
