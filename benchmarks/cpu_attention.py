"""CPU paged attention: the per-sequence reference against the batched path's variants.

One step of a SmolLM2-135M-shaped model's attention (30 layers, 9 query / 3 KV heads, head
dim 64, fp32, blocks of 16 in shuffled order, a cache per layer) at batches the engine meets:
decodes of 1, 8 and 32 rows with contexts of 100-1,500 tokens, 32 decodes after a shared
700-token system prompt, a 500-token prefill and a mixed step (a 256-token chunk over a
300-token cached prefix beside 31 decodes). Milliseconds per step (all 30 layers), the median
of --repeats; every variant is first checked against the reference.

Variants (kernels/cpu_attention.py with its knobs set):
  reference      kernels.reference.paged_attention_ref, a Python loop over sequences
  row            every decode row alone (group_tokens=1), no shared prefixes
  padded         all decode rows padded into one call (group_tokens=inf), no shared prefixes
  grouped        groups of <= 2,048 padded tokens (the default), no shared prefixes
  default        grouped, shared prefixes read once (the engine's torch backend)
  always-shared  grouped, any shared prefix read once (min_shared_tokens=1)
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 30, 3, 3, 64, 16
VARIANTS = {"reference": None, "row": (1, 0), "padded": (1 << 40, 0), "grouped": (2048, 0), "default": (2048, 1024),
            "always-shared": (2048, 1)}


def cases(rng: random.Random) -> dict:
    """name -> (query tokens per sequence, context per sequence, shared prefix tokens)."""
    ctx = lambda n: [rng.randint(100, 1500) for _ in range(n)]  # noqa: E731
    return {
        "decode 1 x 500": ([1], [500], 0),
        "decode 1 x 1500": ([1], [1500], 0),
        "decode 8 x 100-1500": ([1] * 8, ctx(8), 0),
        "decode 32 x 100-1500": ([1] * 32, ctx(32), 0),
        "decode 32 x 20-100": ([1] * 32, [rng.randint(20, 100) for _ in range(32)], 0),
        "decode 32, shared 704 + 20-100": ([1] * 32, [704 + rng.randint(20, 100) for _ in range(32)], 704),
        "decode 2, shared 512 + 20-100": ([1] * 2, [512 + rng.randint(20, 100) for _ in range(2)], 512),
        "decode 4, shared 256 + 20-100": ([1] * 4, [256 + rng.randint(20, 100) for _ in range(4)], 256),
        "decode 8, shared 128 + 20-100": ([1] * 8, [128 + rng.randint(20, 100) for _ in range(8)], 128),
        "decode 4, shared 512 + 20-100": ([1] * 4, [512 + rng.randint(20, 100) for _ in range(4)], 512),
        "decode 16, shared 128 + 20-100": ([1] * 16, [128 + rng.randint(20, 100) for _ in range(16)], 128),
        "prefill 500": ([500], [500], 0),
        "mixed 256 over 300 + 31 decodes": ([256] + [1] * 31, [556] + ctx(31), 0),
    }


def build(n_q, ctx, shared, seed):
    """Caches [LAYERS] and a batch; sequences with a shared prefix use the same physical blocks."""
    import torch

    g = torch.Generator().manual_seed(seed)
    need = [-(-c // BLOCK) for c in ctx]
    s = shared // BLOCK
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(ctx), max(need), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used: used + nb]
        used += nb
        if i and s:
            tables[i, :s] = tables[0, :s]
    kv = torch.randn(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    cu = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(LAYERS, int(cu[-1]), KV_HEADS * GROUP, HEAD_DIM, generator=g)
    return kv, q, tables, cu, torch.tensor(ctx, dtype=torch.int32), max(n_q)


def step_fn(variant, kv, q, tables, cu, lens, max_q):
    """A callable running all layers' attention of one step as the engine would."""
    from kernels.cpu_attention import paged_attention_cpu, plan_attention
    from kernels.reference import paged_attention_ref

    scale = HEAD_DIM ** -0.5
    if VARIANTS[variant] is None:
        return lambda: [paged_attention_ref(q[i], kv[i, 0], kv[i, 1], tables, cu, lens, scale=scale, max_seqlen_q=max_q)
                        for i in range(LAYERS)]
    group_tokens, min_shared = VARIANTS[variant]

    def run():
        plan = plan_attention(tables, cu, lens, block_size=BLOCK, kv_heads=KV_HEADS, group_tokens=group_tokens,
                              min_shared_tokens=min_shared)  # once per step, as the engine plans
        return [paged_attention_cpu(q[i], kv[i, 0], kv[i, 1], tables, cu, lens, scale=scale, max_seqlen_q=max_q,
                                    plan=plan) for i in range(LAYERS)]

    return run


def add_arguments(p) -> None:
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared machine)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for cpu_attention.json / .md (default: print only)")


def main(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for name, (n_q, ctx, shared) in cases(random.Random(args.seed)).items():
        if args.cases and name not in args.cases:
            continue
        kv, q, tables, cu, lens, max_q = build(n_q, ctx, shared, args.seed)
        fns = {v: step_fn(v, kv, q, tables, cu, lens, max_q) for v in args.variants}
        want = step_fn("reference", kv, q, tables, cu, lens, max_q)()
        for v, fn in fns.items():
            got = fn()
            err = max(float((a - b).abs().max()) for a, b in zip(got, want))
            assert err < 1e-4, f"{name}: {v} differs from the reference by {err}"
        times = {v: [] for v in fns}
        for _ in range(args.repeats):  # interleaved: a change in the machine's load hits every variant
            for v, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[v].append((time.perf_counter() - t) * 1e3)
        row = {"case": name, **{v: statistics.median(t) for v, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    head = "| case (ms per step of 30 layers) | " + " | ".join(args.variants) + " |"
    lines = [head, "|---|" + "---:|" * len(args.variants)]
    lines += ["| " + r["case"] + " | " + " | ".join(f"{r[v]:.1f}" for v in args.variants) + " |" for r in rows]
    table = "\n".join(lines)
    cmd = "python -m benchmarks.cpu_attention " + " ".join(sys.argv[1:])
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        date = time.strftime("%Y-%m-%d")
        (out / "cpu_attention.json").write_text(json.dumps({"date": date, "command": cmd, "threads": args.threads,
                                                            "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
        (out / "cpu_attention.md").write_text(f"# CPU paged attention\n\n{date}, `{cmd}`, {args.threads} thread(s), "
                                             f"torch {torch.__version__}.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
