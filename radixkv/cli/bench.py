"""`radixkv bench NAME ...`: runs a benchmark from the repository's benchmarks/ folder.

Benchmarks are scripts that sit beside the package (not installed with it); each module
exposes add_arguments(parser) and main(args), like the other subcommands. Each writes its
files to --out, by default a new temporary folder (benchmarks/out_dir.py), never into the
committed benchmarks/results/ unless given `--out benchmarks/results`.
"""

import argparse
import importlib
import sys
from pathlib import Path

BENCHMARKS = {
    "memory": ("benchmarks.memory", "memory accounting of paging and sharing per workload and block size (CPU)"),
    "sharing": ("benchmarks.sharing", "memory saved by parallel sampling and beam search, measured in the engine (CPU)"),
    "cache-ops": ("benchmarks.cache_ops", "cache manager operations per second on a shared-prompt trace (CPU)"),
    "kernels": ("benchmarks.kernels", "paged attention kernels vs contiguous SDPA (GPU)"),
    "shared-prefix": ("benchmarks.shared_prefix", "shared-prefix (cascade) decode attention vs the plain paged kernel (GPU)"),
    "profile-engine": ("benchmarks.profile_engine", "where a GPU engine step's time goes, shared-prompt workload (GPU)"),
    "host": ("benchmarks.host", "host CPU time per decode step by phase, stub forward, 32-512 sequences (CPU)"),
    "cpu-attention": ("benchmarks.cpu_attention", "paged attention variants on the CPU at decode sizes"),
    "cpu-linear": ("benchmarks.cpu_linear", "linear layers on the CPU at decode sizes, SmolLM2-135M's shapes"),
    "throughput": ("benchmarks.throughput", "engine throughput vs HF transformers on one GPU"),
    "graph-keys": ("benchmarks.graph_keys", "shared-prefix decode-graph shapes a workload meets while served (CPU)"),
    "cpu": ("benchmarks.cpu", "radixkv vs HF transformers generate on the CPU: one chat, chats after a shared system prompt"),
    "front": ("benchmarks.front", "the front's CPU time per streamed token, a stand-in worker at a fixed step rate (CPU)"),
    "grammar-masks": ("benchmarks.grammar_masks", "xgrammar vs llguidance: compile, token-bitmask time per step at batch 1-256, schema coverage (CPU)"),
    "serve": ("benchmarks.serve", "drive a running server with a workload: TTFT, TPOT, latency, hit rate"),
    "serve-vs-offline": ("benchmarks.serve_vs_offline", "the offline engine vs `radixkv serve` over HTTP, same model and prompts: output tok/s, TTFT, hit rate, ratio"),
}
REPO = Path(__file__).resolve().parents[2]  # radixkv/cli/bench.py -> the checkout


def add_arguments(p) -> None:
    p.add_argument("name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items()))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark (see NAME --help)")


def main(args) -> int:
    if not (REPO / "benchmarks").is_dir():
        print(f"benchmarks/ not found beside the package ({REPO}); run from a source checkout", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    module_name, help_text = BENCHMARKS[args.name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"radixkv bench {args.name}", description=help_text)
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(args.bench_args)) or 0)
