"""Shared-prefix (cascade) decode benchmark (GPU): attention time per decode step of
kernels.shared_prefix against the plain paged kernel on the same paged K/V, torch SDPA on
the same K/V laid out contiguously, and the bandwidth floors at the copy bandwidth
measured in the same run.

    radixkv bench shared-prefix [--sweep] [--out DIR]
    (or python3 benchmarks/shared_prefix.py ...; --out benchmarks/results refreshes the committed results)

One layer, 32 query / 8 kv heads, head dim 128, bf16, block size 16, shuffled physical
blocks. Headline: 256 sequences sharing a 2,048-token prefix, 128 private tokens each.
Also: a tree (1,024-token system prompt -> 8 few-shot sets of 512 -> 128 private), batch
and prefix-length sweeps, and an unshared control. Times are medians of
triton.testing.do_bench (CUDA events, L2 flushed before every run).
"""

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))  # keep this folder from shadowing `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks.out_dir import OUT_HELP, out_dir  # noqa: E402
from benchmarks.timing import eager_ms  # noqa: E402
from kernels import paged_attention  # noqa: E402
from kernels.shared_prefix import (PrefixGroups, SharedPrefixConfig, derive_groups,  # noqa: E402
                                   shared_prefix_decode, shared_prefix_decode_ref)

H, KVH, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = "cuda"
DEADLINE = float("inf")  # perf_counter() after which the sweep stops (set by --budget-s)
_C = SharedPrefixConfig  # variations around the defaults
SWEEP = [_C(streams=True), _C(overlap=False), _C(private_rows=2), _C(private_rows=4),
         _C(private_block_n=64), _C(num_warps=8), _C(num_stages=3), _C(shared_split_len=512),
         _C(shared_split_len=2048)]


def copy_bandwidth(smoke) -> float:
    x = torch.randn(1 << (16 if smoke else 30), device=DEV, dtype=DTYPE)  # 2 GiB: far beyond L2
    y = torch.empty_like(x)
    gbps = 2 * x.numel() * x.element_size() / eager_ms(lambda: y.copy_(x), DEV) / 1e6
    del x, y
    return gbps


def tree_tables(batch, level_tokens, fanout, private, rng):
    """Rows of a sharing tree: level l cuts each node into fanout[l] parts with their own
    level_tokens[l] tokens of blocks; every row then gets `private` tokens of its own."""
    n_priv = -(-private // BS)
    num_blocks = batch * (sum(level_tokens) // BS + n_priv)  # upper bound, ids shuffled
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    rows, parts = [[] for _ in range(batch)], [list(range(batch))]
    for tokens, fan in zip(level_tokens, fanout):
        parts = [p[i::fan] for p in parts for i in range(fan) if p[i::fan]]
        for p in parts:
            seg = [ids.pop() for _ in range(tokens // BS)]
            for b in p:
                rows[b] += seg
    for r in rows:
        r += [ids.pop() for _ in range(n_priv)]
    lens = [len(r) * BS - (n_priv * BS - private) for r in rows]
    return rows, lens, num_blocks


def graph_ms(fn) -> float:
    """Median ms of replaying fn captured in a CUDA graph (GPU time, no launch overhead);
    eager time where capture is impossible (CPU smoke runs, a peer that cannot capture)."""
    fn()
    if DEV != "cuda":
        return eager_ms(fn, DEV)
    try:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception as e:  # noqa: BLE001 - record, fall back to eager
        print(f"graph capture failed ({e!r:.100}); timing eagerly", flush=True)
        return eager_ms(fn, DEV)
    return eager_ms(g.replay, DEV)


def scenario(name, batch, level_tokens, fanout, private, *, gen, bw, max_levels=4, sdpa=True,
             sweep=False, detail=False, share=True, config=None):
    rows, lens, num_blocks = tree_tables(batch, level_tokens, fanout, private, random.Random(batch))
    tables = torch.tensor(rows, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    runs = []
    for _ in range(21):  # the first call warms up; median of the other 20
        t0 = time.perf_counter()
        groups = derive_groups(tables, seq_lens, block_size=BS, min_shared_blocks=4,
                               max_levels=max_levels) if share else PrefixGroups.empty(batch)
        runs.append(time.perf_counter() - t0)
    derive_ms = sorted(runs[1:])[10] * 1e3
    groups = groups.to(DEV)
    bt, sl = tables.to(DEV), seq_lens.to(DEV)
    kc = torch.randn(num_blocks, BS, KVH, D, device=DEV, dtype=DTYPE, generator=gen)
    vc = torch.randn(num_blocks, BS, KVH, D, device=DEV, dtype=DTYPE, generator=gen)
    q = torch.randn(batch, H, D, device=DEV, dtype=DTYPE, generator=gen)
    scale, out, out_plain = D ** -0.5, torch.empty_like(q), torch.empty_like(q)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    priv_max = max(lens) - int(groups.private_start.min())

    def ours(cfg=None):
        return lambda: shared_prefix_decode(q, kc, vc, groups, bt, sl, scale=scale, out=out,
                                            max_private_len=priv_max, config=cfg or config)

    plain = lambda: paged_attention(q, kc, vc, bt, cu, sl, scale=scale, max_seqlen_q=1,  # noqa: E731
                                    out=out_plain)
    t_ours, t_plain = graph_ms(ours()), graph_ms(plain)
    err = ((out.float() - out_plain.float()).norm() / out_plain.float().norm()).item()
    kv_tok = 2 * KVH * D * q.element_size()  # bytes of K and V per token
    unique = int(groups.shared_lens.sum()) + sum(lens) - int(groups.private_start.sum())
    to_us = lambda nbytes: nbytes / (bw * 1e9) * 1e6  # noqa: E731
    row = {"name": name, "batch": batch, "levels_tokens": level_tokens, "fanout": fanout,
           "private": private, "groups": groups.num_groups, "levels": groups.num_levels,
           "us": t_ours * 1e3, "plain_us": t_plain * 1e3, "speedup_vs_plain": t_plain / t_ours,
           "floor_us": to_us(unique * kv_tok), "plain_floor_us": to_us(sum(lens) * kv_tok),
           "derive_groups_ms": derive_ms, "rel_err_vs_plain": err}
    row["frac_of_floor"] = row["floor_us"] / row["us"]
    if detail:
        row["eager_us"], row["plain_eager_us"] = eager_ms(ours(), DEV) * 1e3, eager_ms(plain, DEV) * 1e3
        ref = shared_prefix_decode_ref(q.float(), kc.float(), vc.float(), groups, bt, sl, scale=scale)
        ours()()
        row["rel_err_vs_fp32_ref"] = ((out.float() - ref).norm() / ref.norm()).item()
        if DEV == "cuda":
            row["kernel_us"] = kernel_breakdown(ours())
    if sdpa:
        ctx = max(lens)  # equal lengths here: contiguous [B, KVH, ctx, D]
        kcont = kc[bt.long()].view(batch, -1, KVH, D)[:, :ctx].transpose(1, 2).contiguous()
        vcont = vc[bt.long()].view(batch, -1, KVH, D)[:, :ctx].transpose(1, 2).contiguous()
        q4 = q.view(batch, H, 1, D)
        res = {}
        fn = lambda: res.__setitem__("o", F.scaled_dot_product_attention(  # noqa: E731
            q4, kcont, vcont, scale=scale, enable_gqa=True))
        row["sdpa_us"] = graph_ms(fn) * 1e3
        row["sdpa_rel_err"] = ((res["o"].view(batch, H, D).float() - out_plain.float()).norm()
                               / out_plain.float().norm()).item()
        del kcont, vcont, res
    if sweep:
        row["sweep"] = []
        for cfg in SWEEP:
            if time.perf_counter() > DEADLINE:
                row["sweep"].append({"config": cfg.__dict__, "error": "skipped: --budget-s spent"})
                continue
            try:
                row["sweep"].append({"config": cfg.__dict__, "us": graph_ms(ours(cfg)) * 1e3})
            except Exception as e:  # noqa: BLE001 - e.g. a tile beyond shared memory
                row["sweep"].append({"config": cfg.__dict__, "error": repr(e)[:200]})
    print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
    return row


def kernel_breakdown(fn, calls=20) -> dict:
    """GPU time per call of each kernel launched by fn (torch profiler, CUPTI)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        times = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t:
                times[e.key[:60]] = t / calls
        return times
    except Exception as e:  # noqa: BLE001 - a breakdown is a nicety, not the result
        return {"error": repr(e)[:200]}


def to_markdown(res) -> str:
    lines = [f"# Shared-prefix decode attention ({res['date']})", "",
             f"`{res['command']}` on {res['device']}; torch {res['torch']}, triton {res['triton']}.",
             f"One layer, {H} query / {KVH} kv heads, head dim {D}, bf16, block size {BS}, shuffled "
             f"physical blocks. Copy bandwidth measured in the same run: {res['copy_GBps']:.0f} GB/s. "
             "Floor = K/V bytes at that bandwidth (shared segments once + private parts; "
             "plain floor: every row's whole context).", "",
             "All times are GPU time per call, CUDA-graph replays (no launch overhead), medians.", "",
             "| scenario | batch | shared tokens per level (fan-out) | private | levels | ours (us) | "
             "plain paged (us) | SDPA contiguous (us) | speedup vs plain | floor (us) | "
             "plain floor (us) | floor/ours | derive_groups (ms, CPU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
    for r in res["rows"]:
        lv = " -> ".join(f"{t} ({n})" for t, n in zip(r["levels_tokens"], r["fanout"])) or "none"
        lines.append(f"| {r['name']} | {r['batch']} | {lv} | {r['private']} | {r['levels']} | "
                     f"{r['us']:.1f} | {r['plain_us']:.1f} | {f(r, 'sdpa_us')} | "
                     f"{r['speedup_vs_plain']:.2f}x | {r['floor_us']:.1f} | {r['plain_floor_us']:.1f} | "
                     f"{r['frac_of_floor']:.2f} | {r['derive_groups_ms']:.2f} |")
    for r in res["rows"]:
        if "eager_us" in r:
            lines += ["", f"`{r['name']}` eagerly (launch overhead included): ours "
                      f"{r['eager_us']:.1f} us, plain {r['plain_eager_us']:.1f} us; relative error "
                      f"vs an fp32 torch reference {r['rel_err_vs_fp32_ref']:.1e}."]
    base = SharedPrefixConfig().__dict__
    show = lambda c: ", ".join(f"{k}={x}" for k, x in c.items() if base[k] != x) or "default"  # noqa: E731
    lines += ["", f"Kernel config of every row: {show(res['config'])} (SharedPrefixConfig fields "
              "that differ from the code's defaults at the time of the run)."]
    if res.get("sweep"):
        lines += ["", f"Config sweep on the headline shape (us per call, graph replays; "
                  f"defaults {res['sweep']['default_us']:.1f}):", "", "| config | us |", "|---|---|"]
        for v in res["sweep"]["runs"]:
            lines.append(f"| {show(v['config'])} | " + (f"{v['us']:.1f} |" if "us" in v
                                                         else f"{v['error']} |"))
    for r in res["rows"]:
        if r.get("kernel_us"):
            lines += ["", f"GPU time per call by kernel on `{r['name']}` (profiler, us): "
                      + ", ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}"
                                  for k, v in r["kernel_us"].items())]
    errs = [f"{r['name']}: {r['rel_err_vs_plain']:.1e}" for r in res["rows"]]
    lines += ["", "Relative error vs the plain paged kernel (bf16): " + ", ".join(errs) + "."]
    return "\n".join(lines) + "\n"


def add_arguments(ap) -> None:
    ap.add_argument("--sweep", action="store_true", help="time alternative configs on the headline")
    ap.add_argument("--out", "--out-dir", dest="out", default=None, help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes through the interpreter")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="stop the config sweep once the run is this old")


def main(args=None) -> int:
    """`args`: parsed arguments (radixkv bench shared-prefix), or an argv list, or None (sys.argv)."""
    if isinstance(args, argparse.Namespace):
        argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "shared-prefix"] else []
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(ap)
        argv = sys.argv[1:] if args is None else args
        args = ap.parse_args(argv)
    global DEV, DEADLINE
    DEADLINE = time.perf_counter() + args.budget_s
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    if DEV == "cpu" and not args.smoke:
        sys.exit("benchmarks/shared_prefix.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python3 benchmarks/shared_prefix.py " + " ".join(argv),
           "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "copy_GBps": copy_bandwidth(args.smoke), "rows": []}
    k = dict(gen=gen, bw=res["copy_GBps"])
    s = 1 if not args.smoke else 0
    big = (lambda n: n) if s else (lambda n: max(64, n // 16))
    plan = [("shared 2048 + 128", 256 if s else 4, [big(2048)], [1], 128 if s else 20,
             dict(detail=True)),
            ("tree 1024 -> 8 x 512 + 128", 256 if s else 8, [big(1024), big(512)], [1, 8],
             128 if s else 20, {}),
            ("tree, one level only", 256 if s else 8, [big(1024), big(512)], [1, 8], 128 if s else 20,
             dict(max_levels=1, sdpa=False)),
            ("unshared control", 256 if s else 4, [big(2048)], [1], 128 if s else 20,
             dict(share=False, sdpa=False))]
    plan += [(f"batch {b}", b, [big(2048)], [1], 128 if s else 20, dict(sdpa=False))
             for b in ((16, 64) if s else ())]
    plan += [(f"prefix {n}", 256, [n], [1], 128, dict(sdpa=False)) for n in ((128, 256, 512) if s else ())]
    out = out_dir(args.out, "shared-prefix")
    if args.sweep:  # tune on the headline first; every row then runs the fastest config
        name, batch, lv, fan, priv, _ = plan[0]
        head = scenario(name, batch, lv, fan, priv, **k, sweep=True, sdpa=False)
        best = min([(head["us"], SharedPrefixConfig())] + [
            (v["us"], SharedPrefixConfig(**v["config"])) for v in head["sweep"] if "us" in v],
            key=lambda t: t[0])[1]
        res["sweep"] = {"default_us": head["us"], "runs": head["sweep"], "chosen": best.__dict__}
        k["config"] = best
    res["config"] = (k.get("config") or SharedPrefixConfig()).__dict__
    for name, batch, lv, fan, priv, extra in plan:
        res["rows"].append(scenario(name, batch, lv, fan, priv, **k, **extra))
        if DEV == "cuda":
            torch.cuda.empty_cache()
        with open(out / "shared_prefix.json", "w") as fh:  # after each row: a cut run keeps them
            json.dump(res, fh, indent=1)
        with open(out / "shared_prefix.md", "w") as fh:
            fh.write(to_markdown(res))
    print(to_markdown(res))
    print(f"results in {out}/shared_prefix.*")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
