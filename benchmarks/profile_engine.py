"""Where a GPU engine step's time goes, and the shared-prompt workload with the plain paged
kernel and with shared-prefix attention (Llama-3-8B shape, bf16, dummy weights).

    radixkv bench profile-engine [--out DIR] [--budget-s 130] [--requests 256]

Parts, each guarded (a failure is reported and the next part runs), in order of value, each
skipped when the time budget is spent:
  workloads  N x (1,024 shared + 128 unique) prompt tokens, 128 output tokens, greedy, EOS
             ignored: shared-prefix attention on, then off; per-step wall times by kind
  steps      one full-batch decode step: host time by phase (synchronised), GPU time of the
             plain and the shared-prefix graph replays, top CUDA kernels (torch.profiler) of a
             decode step (graph and eager) and of a mixed prefill + decode step
  unfused    the plain workload again with the fused element-wise kernels off (graphs recaptured)
Writes profile.json and profile.md (and the logs it prints) under --out (default: a new temp folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.out_dir import OUT_HELP
from benchmarks.out_dir import out_dir as make_out_dir
from benchmarks.throughput import LLAMA3_8B, make_requests

RESULTS: dict = {}
LOG: list[str] = []
SHARED, UNIQUE, OUTPUT = 1024, 128, 128  # the workload: prompt tokens shared and unique, output tokens


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LOG.append(line)
    print(line, flush=True)


def guarded(name, fn, *args):
    t = time.perf_counter()
    try:
        RESULTS[name] = fn(*args)
    except Exception as e:  # one part failing must not lose the others
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        say(f"[{name}] FAILED:", traceback.format_exc()[-3000:])
    say(f"[{name}] {time.perf_counter() - t:.1f} s: {json.dumps(RESULTS[name], default=str)[:3000]}")


# ---- engine -----------------------------------------------------------------------------
def build_engine(model_dir: str):
    import torch

    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine

    t = time.perf_counter()
    e = Engine(EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16", load_format="dummy",
                            enable_shared_prefix_attention=True))
    g = e.runner.graphs
    info = {"seconds": time.perf_counter() - t, "num_blocks": e.num_blocks, "graphs": len(g.graphs),
            "shared_graphs": g.num_shared_captures, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "mem_gib": torch.cuda.memory_allocated() / 2**30}
    from radixkv.engine.sampling_params import SamplingParams  # warm-up, as benchmarks/throughput.py

    for i, p in enumerate(make_requests(8, 256, 32, LLAMA3_8B["vocab_size"], seed=99)):
        e.add_request(f"warm{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    return e, info


class StepLog:
    """Records each executed batch: rows, tokens, decode or not, shared-prefix or not."""

    def __init__(self, e):
        self.e, self.rows = e, []
        inner = e.runner.execute

        def execute(*args):
            batch, logits = inner(*args)
            self.rows.append((len(batch.seq_lens), len(batch.input_ids), batch.is_decode, e.runner.last_step_shared))
            return batch, logits

        e.runner.execute = execute


def run_workload(e, n: int, tag: str, shared: bool, seed: int) -> dict:
    """A fresh system prompt per seed: no run is served from another's cache."""
    import torch

    from radixkv.engine.sampling_params import SamplingParams

    saved = e.runner.prefix_groups
    e.runner.prefix_groups = saved if shared else None
    derive0 = getattr(saved, "derive_seconds", 0.0)
    log = StepLog(e)
    try:
        prompts = make_requests(n, SHARED, UNIQUE, LLAMA3_8B["vocab_size"], seed=seed)
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            e.add_request(f"{tag}-{i}", p, params)
        walls, produced = [], 0
        while e.has_unfinished_requests():
            ts = time.perf_counter()
            for out in e.step():
                if out.finished:
                    produced += len(out.outputs[0].token_ids)
            walls.append(time.perf_counter() - ts)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        e.runner.prefix_groups = saved
        del e.runner.execute  # back to the class method
    steps = list(zip(walls, log.rows))
    mixed = [w for w, r in steps if not r[2]]
    full = [w for w, r in steps if r[2] and r[0] == n]
    derive = getattr(saved, "derive_seconds", 0.0) - derive0 if shared else None
    return {"seconds": total, "output_tokens": produced, "tok_per_s": produced / total, "steps": len(steps),
            "mixed_steps": len(mixed), "mixed_s": sum(mixed), "decode_steps": len(steps) - len(mixed),
            "decode_s": sum(w for w, r in steps if r[2]), "full_batch_steps": len(full),
            "full_batch_ms_median": 1e3 * statistics.median(full) if full else None,
            "full_batch_ms_mean": 1e3 * statistics.mean(full) if full else None,
            "shared_steps": sum(r[3] for r in log.rows), "derive_s_total": derive,
            "mixed_step_ms": [round(1e3 * w) for w in mixed][:12]}


# ---- one decode step under the microscope -------------------------------------------------
def _to_full_decode(e, n: int, tag: str):
    from radixkv.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    for i, p in enumerate(make_requests(n, SHARED, UNIQUE, LLAMA3_8B["vocab_size"], seed=7)):
        e.add_request(f"{tag}-{i}", p, params)
    first_mixed = True
    prof_mixed = None
    while e.scheduler.waiting or any(s.num_output_tokens == 0 for s in e.scheduler.running):
        if first_mixed and len(e.scheduler.running) > 0:  # the second step: prefill chunks + decodes
            prof_mixed = _profile(e.step)
            first_mixed = False
        else:
            e.step()
    for _ in range(3):
        e.step()
    return prof_mixed


def _drain(e, tag, n):
    for i in range(n):
        e.abort_request(f"{tag}-{i}")
    while e.has_unfinished_requests():
        e.step()


def _profile(fn, reps: int = 1, top: int = 18) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / reps
    rows = []
    for ev in prof.key_averages():
        dev = getattr(ev, "self_device_time_total", None)
        if dev is None:
            dev = getattr(ev, "self_cuda_time_total", 0)
        if dev > 0:
            rows.append((dev / reps, ev.count // reps, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return {"wall_ms": wall * 1e3, "device_ms": total / 1e3,
            "top": [f"{us / 1e3:8.3f} ms {c:5d}x {name[:90]}" for us, c, name in rows[:top]]}


def _replay_ms(graph, reps: int = 20) -> float:
    import torch

    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _host_phases(e, steps: int = 6) -> dict:
    """Host time by phase of full-batch decode steps, with a sync after the graph launch."""
    import torch

    import radixkv.engine.model_runner as mr

    phases = dict.fromkeys(["schedule", "tables_sync", "build_batch", "groups", "launch", "gpu_wait", "sampler",
                            "step_total"], 0.0)
    saved = (e.scheduler.schedule, e.runner.block_tables.sync, mr.build_batch, e.runner.graphs.run, e.sampler,
             e.runner.prefix_groups)

    def timed(name, fn, sync=False):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            t1 = time.perf_counter()
            phases[name] += t1 - t
            if sync:
                torch.cuda.synchronize()
                phases["gpu_wait"] += time.perf_counter() - t1
            return out
        return wrapper

    e.scheduler.schedule = timed("schedule", saved[0])
    e.runner.block_tables.sync = timed("tables_sync", saved[1])
    mr.build_batch = timed("build_batch", saved[2])
    e.runner.graphs.run = timed("launch", saved[3], sync=True)
    e.sampler = timed("sampler", saved[4])
    pg = saved[5]
    if pg is not None:
        pg_get = pg.get
        pg.get = timed("groups", pg_get)
    try:
        for _ in range(steps):
            t = time.perf_counter()
            e.step()
            phases["step_total"] += time.perf_counter() - t
    finally:
        e.scheduler.schedule, e.runner.block_tables.sync, mr.build_batch, e.runner.graphs.run, e.sampler = saved[:5]
        if pg is not None:
            del pg.get
    out = {k: round(v / steps * 1e3, 3) for k, v in phases.items()}
    out["other_host"] = round(out["step_total"] - sum(v for k, v in out.items() if k != "step_total"), 3)
    return out


def step_profile(e, n: int) -> dict:
    import torch

    res = {}
    res["mixed_step"] = _to_full_decode(e, n, "prof")
    r = e.runner
    res["shared_decode_in_use"] = bool(r.last_step_shared)
    res["host_phases_shared"] = _host_phases(e)
    graphs = r.graphs
    bs = graphs.sizes[-1]
    from radixkv.engine.shared_prefix import GraphKey

    shared_keys = [k for k in graphs.graphs if k.shared and k.batch == bs]
    res["replay_ms_plain"] = _replay_ms(graphs.graphs[GraphKey(bs)])
    if r.last_step_shared and graphs._filled is not None:
        res["replay_key_shared"] = graphs._filled[2]
        res["replay_ms_shared"] = _replay_ms(graphs.graphs[graphs._filled[2]])
    res["shared_graph_keys"] = [list(k) for k in shared_keys]
    res["decode_shared_graph"] = _profile(e.step, reps=2)
    saved = r.prefix_groups
    r.prefix_groups = None
    try:
        res["host_phases_plain"] = _host_phases(e)
        res["decode_plain_graph"] = _profile(e.step, reps=2)
        r.graphs = None
        try:
            res["decode_plain_eager"] = _profile(e.step, reps=1)
        finally:
            r.graphs = graphs
    finally:
        r.prefix_groups = saved
    # the sampler alone on a full batch of logits
    logits = graphs.logits[: len(e.scheduler.running)]
    seqs = list(e.scheduler.running)
    res["sampler_only"] = _profile(lambda: e.sampler(logits, seqs), reps=3, top=6)
    _drain(e, "prof", n)
    torch.cuda.synchronize()
    return res


def unfused_workload(e, n: int) -> dict:
    """Plain kernel, element-wise steps unfused (the torch ops), graphs recaptured."""
    from radixkv.engine.cuda_graph import DecodeGraphs

    r = e.runner
    for layer in r.model.model.layers:
        layer.input_layernorm._add_norm = layer.post_attention_layernorm._add_norm = None
        layer.mlp._silu_mul = None
        layer.self_attn.fused_rope = False
    old = r.graphs
    t = time.perf_counter()
    r.graphs = DecodeGraphs(r.model, old.sizes[-1], old.max_blocks, r.device, shared_prefix=False)
    capture = time.perf_counter() - t
    del old
    out = run_workload(e, n, "unfused", shared=False, seed=3000 + n)
    out["recapture_s"] = capture
    return out


def write(out_dir: Path) -> None:
    (out_dir / "profile.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")
    lines = ["# Engine profile", ""]
    for name in ("engine", "workload_shared", "workload_plain", "workload_unfused"):
        r = RESULTS.get(name)
        if r:
            lines.append(f"- {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in r.items()))
    steps = RESULTS.get("steps") or {}
    for key in ("host_phases_shared", "host_phases_plain", "replay_ms_plain", "replay_ms_shared", "replay_key_shared"):
        if key in steps:
            lines.append(f"- {key}: {steps[key]}")
    for key in ("decode_shared_graph", "decode_plain_graph", "decode_plain_eager", "mixed_step", "sampler_only"):
        p = steps.get(key)
        if isinstance(p, dict) and "top" in p:
            head = f"## {key}: wall {p['wall_ms']:.2f} ms, kernels {p['device_ms']:.2f} ms"
            lines += ["", head, "```", *p["top"], "```"]
    (out_dir / "profile.md").write_text("\n".join(lines) + "\n")
    (out_dir / "profile.log").write_text("\n".join(LOG) + "\n")


def add_arguments(ap) -> None:
    ap.add_argument("--out", default=None, help=OUT_HELP)
    ap.add_argument("--budget-s", type=float, default=130.0)
    ap.add_argument("--requests", type=int, default=256)


def main(args) -> int:
    deadline = time.perf_counter() + args.budget_s
    out_dir = make_out_dir(args.out, "profile-engine")
    model_dir = tempfile.mkdtemp(prefix="radixkv-8b-")
    (Path(model_dir) / "config.json").write_text(json.dumps(LLAMA3_8B))
    n = args.requests
    built = {}

    def engine():
        e, info = build_engine(model_dir)
        built["e"] = e
        return info

    guarded("engine", engine)
    e = built.get("e")
    if e is None:
        write(out_dir)
        return 1
    plan = [("workload_shared", lambda: run_workload(e, n, "shared", True, 1000 + n), 12),
            ("workload_plain", lambda: run_workload(e, n, "plain", False, 2000 + n), 12),
            ("steps", lambda: step_profile(e, n), 25),
            ("workload_unfused", lambda: unfused_workload(e, n), 30)]
    for name, fn, need_s in plan:
        left = deadline - time.perf_counter()
        if left < need_s:
            RESULTS[name] = {"skipped": f"{left:.0f} s of budget left"}
            say(f"[{name}] skipped, {left:.0f} s left")
            continue
        guarded(name, fn)
        write(out_dir)
    write(out_dir)
    print((out_dir / "profile.md").read_text())
    print(f"results in {out_dir}/profile.*")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
