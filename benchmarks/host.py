"""Host CPU time per engine step by phase, greedy decoding with a stub forward (CPU).

    radixkv bench host [MODEL_DIR] [--seqs 32 128 256 512] [--prompt 1152] [--shared 1024]
                       [--output 128] [--repeats 3] [--gc worker|default] [--out DIR]

The model's forward is replaced by fixed logits (seeded, one row per sampled sequence), so
what is timed is the Python a GPU waits for each step. Phases, each the thread CPU time of
its calls (other processes on the machine do not inflate it):

- schedule: Scheduler.schedule (continuous batching, reservations);
- block_tables: the runner's block-table mirror (BlockTables.sync_step, release of freed rows);
- batch: build_batch (input ids, positions, slot mapping, table gather);
- sampler: the engine's Sampler on the stub logits (all greedy); its tensor math is CPU work
  here and device work in a GPU engine, so totals are given with and without it;
- apply: Engine._apply (commit to the cache, appends, stop checks);
- outputs: Engine._outputs (RequestOutput per request with news);
- other: the rest of Engine.step (the engine's glue around the phases).

Only steps where every sequence decodes (all running, none waiting) are counted. Each size
runs `--repeats` times in a fresh engine; the figures are medians over the repeats of the
per-step means. `--gc worker` sets the garbage collector as the engine worker does after
start-up (radixkv/engine/worker.py, settle_gc); the collections seen while timing are
counted by generation (the most of any repeat). Without MODEL_DIR a tiny random model is built in a temporary folder (the vocab
size sets the sampler's tensor sizes: 2,048 there). `digest` hashes every generated token
id: equal digests, identical greedy ids.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date

from benchmarks.out_dir import OUT_HELP, out_dir

PHASES = ("schedule", "block_tables", "batch", "sampler", "apply", "outputs", "other")
GOAL_MS_AT_256 = 1.0


def settle_gc(max_num_seqs: int) -> None:
    """What the worker does once its engine is up (radixkv/engine/worker.py)."""
    from radixkv.engine.worker import settle_gc as worker_settle_gc

    worker_settle_gc(max_num_seqs)


def measure(model_dir: str, seqs: int = 256, prompt: int = 1152, shared: int = 1024, output: int = 128,
            gc_mode: str = "worker") -> dict:
    import torch

    from radixkv.engine.batch import build_batch
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling_params import SamplingParams

    e = Engine(EngineConfig(model_dir=model_dir, device="cpu", max_num_seqs=seqs,
                            max_num_batched_tokens=max(8192, seqs), check_invariants=False,
                            num_blocks=seqs * -(-(prompt + output) // 16) + 64))
    vocab = e.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(seqs, vocab, generator=gen)  # allocated once: a fresh one per step costs page faults
    phases = dict.fromkeys(PHASES, 0.0)
    clock = time.thread_time

    def timed(name, fn):
        def wrapper(*args):
            t = clock()
            try:
                return fn(*args)
            finally:
                phases[name] += clock() - t
        return wrapper

    tables = e.runner.block_tables
    sync_step = timed("block_tables", tables.sync_step)
    batch_of = timed("batch", build_batch)

    def stub_execute(scheduled, block_table, copy_ops, feed=None):
        batch = batch_of(scheduled, tables, sync_step(scheduled, block_table))
        return batch, logits[: len(batch.sample_seqs)]

    e.runner.execute = stub_execute
    e.runner.release_rows = timed("block_tables", e.runner.release_rows)
    e.scheduler.schedule = timed("schedule", e.scheduler.schedule)
    e.sampler = _TimedSampler(e.sampler, timed)
    e._apply = timed("apply", e._apply)
    e._outputs = timed("outputs", e._outputs)

    import random

    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(shared)]
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(seqs):
        e.add_request(f"r{i}", system + [rng.randrange(3, vocab) for _ in range(prompt - shared)], params)
    thresholds = gc.get_threshold()
    if gc_mode == "worker":
        settle_gc(seqs)
    collections = [0, 0, 0]  # by generation, while timing

    def on_gc(phase, info):
        if phase == "start" and measuring[0]:
            collections[info["generation"]] += 1

    measuring = [False]
    gc.callbacks.append(on_gc)
    digest = hashlib.sha256()
    totals, steps, step_times = dict.fromkeys(PHASES, 0.0), 0, []
    try:
        while e.has_unfinished_requests():
            full = len(e.scheduler.running) == seqs and not e.scheduler.waiting
            for k in phases:
                phases[k] = 0.0
            measuring[0] = full
            t = clock()
            outs = e.step()
            step = clock() - t
            for out in outs:
                if out.finished:
                    for c in out.outputs:
                        digest.update(f"{out.request_id}:{c.token_ids}\n".encode())
            if full:
                steps += 1
                phases["other"] = step - sum(phases.values())
                step_times.append(step)
                for k in phases:
                    totals[k] += phases[k]
    finally:
        gc.callbacks.remove(on_gc)
        if gc_mode == "worker":
            gc.unfreeze()
            gc.set_threshold(*thresholds)
    ms = {k: totals[k] / steps * 1e3 for k in PHASES}
    host = sum(ms.values())
    return {"seqs": seqs, "decode_steps": steps, "ms": ms, "host_ms": host,
            "host_ms_without_sampler": host - ms["sampler"],
            "step_ms_p90": sorted(step_times)[int(0.9 * (len(step_times) - 1))] * 1e3,
            "collections": collections, "digest": digest.hexdigest()[:16]}


class _TimedSampler:
    """The engine's sampler with its calls timed as "sampler": a call, or draw() and the
    output() of what it drew (the host copy), whichever the engine uses."""

    def __init__(self, inner, timed):
        self._inner, self._timed = inner, timed
        self._call = timed("sampler", inner)
        if hasattr(inner, "draw"):
            self._draw = timed("sampler", inner.draw)

    def __call__(self, *args):
        return self._call(*args)

    def draw(self, *args):
        drawn = self._draw(*args)
        if hasattr(drawn, "output"):
            try:
                drawn.output = self._timed("sampler", drawn.output)
            except AttributeError:  # slots: its host copy is timed where it is read
                pass
        return drawn

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _median_run(runs: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    digests = {r["digest"] for r in runs}
    assert len(digests) == 1, f"repeats generated different tokens: {digests}"
    return {"seqs": runs[0]["seqs"], "decode_steps": runs[0]["decode_steps"],
            "ms": {k: round(med([r["ms"][k] for r in runs]), 3) for k in PHASES},
            "host_ms": round(med([r["host_ms"] for r in runs]), 3),
            "host_ms_without_sampler": round(med([r["host_ms_without_sampler"] for r in runs]), 3),
            "step_ms_p90": round(med([r["step_ms_p90"] for r in runs]), 3),
            "collections": [max(r["collections"][g] for r in runs) for g in range(3)],
            "digest": runs[0]["digest"], "repeats_host_ms": [round(r["host_ms"], 3) for r in runs]}


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# Host CPU time per decode step (`{result['command']}`)", "",
             f"{result['machine']}, {result['date']}; load average before {result['load_avg_before']}. "
             f"Thread CPU ms per step with a stub forward, medians of {result['repeats']} runs; "
             f"greedy, prompt {result['prompt']} ({result['shared']} shared), {result['output']} output tokens; "
             f"gc: {result['gc']}.", "",
             "| seqs | " + " | ".join(PHASES) + " | host | without sampler | us/seq | p90 step | gc 0/1/2 |",
             "|---:|" + "---:|" * (len(PHASES) + 5)]
    for r in rows:
        lines.append(f"| {r['seqs']} | " + " | ".join(f"{r['ms'][k]:.3f}" for k in PHASES)
                     + f" | {r['host_ms']:.3f} | {r['host_ms_without_sampler']:.3f}"
                     f" | {r['host_ms'] / r['seqs'] * 1e3:.2f} | {r['step_ms_p90']:.3f} | {'/'.join(map(str, r['collections']))} |")
    at = {r["seqs"]: r for r in rows}
    if 256 in at:
        lines += ["", f"At 256 sequences: {at[256]['host_ms']:.3f} ms per step "
                      f"({at[256]['host_ms_without_sampler']:.3f} without the sampler); goal <= {GOAL_MS_AT_256} ms."]
    lines += ["", "Digests (sha256 of every generated token id, per size): "
              + ", ".join(f"{r['seqs']}: `{r['digest']}`" for r in rows)]
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", nargs="?", default=None,
                   help="HF model folder (default: a tiny random Llama built in a temporary folder)")
    p.add_argument("--seqs", type=int, nargs="+", default=[32, 128, 256, 512], help="running sequences per size")
    p.add_argument("--prompt", type=int, default=1152, help="prompt tokens per sequence")
    p.add_argument("--shared", type=int, default=1024, help="of which a prefix shared by all")
    p.add_argument("--output", type=int, default=128, help="output tokens per sequence (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3, help="runs per size (median reported)")
    p.add_argument("--gc", choices=["worker", "default"], default="worker",
                   help="worker: the collector as the engine worker sets it after start-up")
    p.add_argument("--out", default=None, help=OUT_HELP)


def main(args=None) -> int:
    """`args`: parsed arguments (radixkv bench host), or an argv list, or None (sys.argv)."""
    if not isinstance(args, argparse.Namespace):
        ap = argparse.ArgumentParser(prog="python -m benchmarks.host", description=__doc__.splitlines()[0])
        add_arguments(ap)
        argv = sys.argv[1:] if args is None else list(args)
        args, shown, prog = ap.parse_args(argv), argv, "python -m benchmarks.host"
    else:
        shown = sys.argv[3:] if sys.argv[1:3] == ["bench", "host"] else []
        prog = "radixkv bench host"
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread CPU time: the sampler's tensor math on this thread only
    load = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = args.model_dir
            if model_dir is None:
                from radixkv.models.tiny import build_tiny_model

                model_dir = str(build_tiny_model(tmp))
            rows = []
            for n in args.seqs:
                runs = [measure(model_dir, n, args.prompt, args.shared, args.output, args.gc)
                        for _ in range(args.repeats)]
                rows.append(_median_run(runs))
                print(f"{n} seqs: {rows[-1]['host_ms']:.3f} ms per step", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    result = {"command": prog + "".join(" " + a for a in shown), "machine": _machine(),
              "date": date.today().isoformat(), "load_avg_before": [round(x, 2) for x in load],
              "prompt": args.prompt, "shared": args.shared, "output": args.output, "repeats": args.repeats,
              "gc": args.gc, "rows": rows}
    md = to_markdown(result)
    print(md)
    out = out_dir(args.out, "host")
    (out / "host.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "host.md").write_text(md)
    print(f"results in {out}/host.*")
    return 0


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    raise SystemExit(main())
