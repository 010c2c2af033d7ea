"""Memory saved by sharing within a request, measured in the engine (not simulated).

Parallel sampling (n = 2..6) and beam search (widths 2..6) run on a real model folder
(the tiny Llama on the CPU is enough: sharing depends on lengths and on which beams
survive, not on speed). Every finished RequestOutput reports the blocks it held and the blocks it
would have held without sharing, summed over its steps; saving = 1 - held / without,
the time-averaged measure of the PagedAttention paper.
"""

import argparse
import json
import time
from pathlib import Path

from benchmarks.out_dir import OUT_HELP, out_dir


def measure(model_dir: str, kind: str, k: int, num_requests: int, short: bool) -> float:
    from benchmarks.workloads import beam_search, parallel_sampling
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling_params import SamplingParams

    w = (parallel_sampling(n=k, num_requests=num_requests, short=short) if kind == "parallel_sampling"
         else beam_search(width=k, num_requests=num_requests, short=short))
    e = Engine(EngineConfig(model_dir=model_dir, device="cpu", block_size=16, num_blocks=8192, max_num_seqs=256,
                            max_num_batched_tokens=8192))
    for i, r in enumerate(w.requests):
        if kind == "parallel_sampling":
            p = SamplingParams(n=k, seed=i, max_tokens=len(r.output), ignore_eos=True)
        else:
            p = SamplingParams(use_beam_search=True, beam_width=k, max_tokens=len(r.output), ignore_eos=True)
        e.add_request(str(i), r.prompt, p)
    outs = []
    while e.has_unfinished_requests():
        outs += [o for o in e.step() if o.finished]
    assert e.metrics().preemptions == 0, "a preemption would distort the accounting: give the pool more blocks"
    held = sum(o.sharing.block_steps_held for o in outs)
    without = sum(o.sharing.block_steps_without_sharing for o in outs)
    return 1 - held / without


def add_arguments(p) -> None:
    p.add_argument("--model-dir", default="models/tiny-llama", help="model folder (the tiny Llama is built if missing)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--lengths", choices=["short", "long", "both"], default="both",
                   help="Alpaca-like (short) or ShareGPT-like (long) lengths, see benchmarks/workloads.py")
    p.add_argument("--out", default=None, help=OUT_HELP)


def main(args) -> int:
    import torch

    from radixkv.models.tiny import build_tiny_model

    torch.set_num_threads(1)  # one core is enough for the tiny model; idle threads only spin
    if not (Path(args.model_dir) / "config.json").exists():
        build_tiny_model(args.model_dir, arch="llama", seed=0)
    rows = []
    for lengths in (["short", "long"] if args.lengths == "both" else [args.lengths]):
        for kind in ("parallel_sampling", "beam_search"):
            for k in (2, 3, 4, 5, 6):
                t = time.perf_counter()
                saving = measure(args.model_dir, kind, k, args.num_requests, lengths == "short")
                rows.append(dict(lengths=lengths, kind=kind, k=k, saving=saving))
                print(f"{lengths:5s} {kind:17s} {k}: {saving:.1%} ({time.perf_counter() - t:.0f} s)", flush=True)
    out = out_dir(args.out, "sharing")
    (out / "sharing.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| lengths | workload | 2 | 3 | 4 | 5 | 6 |", "|---|---|---:|---:|---:|---:|---:|"]
    for lengths in dict.fromkeys(r["lengths"] for r in rows):
        for kind in ("parallel_sampling", "beam_search"):
            cells = [f"{r['saving']:.1%}" for r in rows if r["lengths"] == lengths and r["kind"] == kind]
            lines.append(f"| {lengths} | {kind} (n or width) | " + " | ".join(cells) + " |")
    (out / "sharing.md").write_text(
        f"# Memory saved by sharing within a request (engine, tiny Llama, CPU, block 16)\n\n"
        f"{time.strftime('%Y-%m-%d')}, `radixkv bench sharing --num-requests {args.num_requests} "
        f"--lengths {args.lengths}`; saving = 1 - block-steps held / block-steps without sharing.\n\n"
        + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results in {out}/sharing.*")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
