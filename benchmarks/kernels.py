"""Paged-attention kernel benchmark (GPU): ours on shuffled paged K/V against torch SDPA on
the same K/V laid out contiguously, plus the copy bandwidth and bf16 matmul rate of the
same run as ceilings.

    radixkv bench kernels [--sweep [all|decode|prefill]] [--out DIR]
    (or python3 benchmarks/kernels.py ...; --out benchmarks/results refreshes the committed results)

One layer, 32 query / 8 kv heads, head dim 128, bf16, block size 16. Decode at batch
{1, 32, 256} x context {512, 4k, 32k}; prefill of a 2,048-token chunk over a 0 / 8k prefix.
Times are GPU times: each call captured in a CUDA graph (as the engine runs decode), median
over replays, rotating among enough input sets that small problems are not served from L2.
The eager column (triton.testing.do_bench) adds Python and launch overhead.
--sweep also times alternative tile configs per shape (for tuning the defaults); --sweep
prefill (or decode) only for that kind of shape.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

# Run as a script, this file's folder heads sys.path and its name would shadow the kernels
# package: put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from benchmarks.out_dir import OUT_HELP, out_dir  # noqa: E402
from benchmarks.timing import eager_ms  # noqa: E402
from kernels import paged_attention  # noqa: E402
from kernels.attention_config import AttentionConfig, default_config  # noqa: E402
from kernels.paged_attention import attention_flops  # noqa: E402

H, KVH, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = "cuda"  # set in main(); "cpu" only for --smoke runs through the interpreter
DECODE_SHAPES = [(b, c) for b in (1, 32, 256) for c in (512, 4096, 32768)]
PREFILL_SHAPES = [(2048, 0), (2048, 8192)]
DECODE_SWEEP = [AttentionConfig(16, 64, 4, 2), AttentionConfig(16, 64, 4, 3),
                AttentionConfig(16, 128, 4, 2), AttentionConfig(16, 64, 2, 3)]
PREFILL_SWEEP = [AttentionConfig(m, n, w, s) for m, n, w, s in (
    (256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3),
    (128, 32, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
    (128, 32, 4, 3))]


def graph_time(fns) -> float:
    """GPU milliseconds per call: the calls (one per rotating input set, so small problems
    are not served from L2) captured in one CUDA graph, median over replays."""
    if DEV != "cuda":
        return eager_ms(lambda: [f() for f in fns], DEV) / len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    deadline = time.perf_counter() + 0.3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 100):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    del graph
    return sorted(times)[len(times) // 2] / len(fns)


def ceilings(smoke) -> dict:
    x = torch.randn(1 << (20 if smoke else 30), device=DEV, dtype=DTYPE)  # 2 GiB: far beyond L2
    y = torch.empty_like(x)
    ms = eager_ms(lambda: y.copy_(x), DEV)
    copy_gbs = 2 * x.numel() * x.element_size() / ms / 1e6
    del x, y
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=DEV, dtype=DTYPE)
    b = torch.randn(n, n, device=DEV, dtype=DTYPE)
    mm_tflops = 2 * n ** 3 / eager_ms(lambda: a @ b, DEV) / 1e9
    return {"copy_GBps": copy_gbs, "matmul_bf16_TFLOPs": mm_tflops}


def paged_problem(batch, ctx, n_q, gen):
    """Shuffled paged K/V plus the same K/V contiguous [batch, KVH, ctx, D] for SDPA."""
    nb = ctx // BS
    tables = torch.randperm(batch * nb, device=DEV, generator=gen).to(torch.int32).view(batch, nb)
    caches, contig = [], []
    for _ in range(2):
        c = torch.randn(batch * nb, BS, KVH, D, device=DEV, dtype=DTYPE, generator=gen)
        caches.append(c)
        contig.append(c[tables.long()].view(batch, ctx, KVH, D).transpose(1, 2).contiguous())
    q = torch.randn(batch * n_q, H, D, device=DEV, dtype=DTYPE, generator=gen)
    cu = torch.arange(0, batch * n_q + 1, n_q, device=DEV, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    return dict(q=q, kc=caches[0], vc=caches[1], kcont=contig[0], vcont=contig[1], tables=tables,
                cu=cu, lens=lens, out=torch.empty_like(q))


def sdpa_peer(p, n_q, ctx, batch, scale, repeat_kv=False):
    """SDPA on contiguous K/V, causal aligned to the end of the context."""
    q4 = p["q"].view(batch, n_q, H, D).transpose(1, 2).contiguous()
    kw = {"is_causal": n_q > 1} if n_q in (1, ctx) else {"attn_mask": causal_lower_right(n_q, ctx)}
    if repeat_kv:  # fallback if GQA and the lower-right mask do not mix in this torch
        kr, vr = p["kcont"].repeat_interleave(H // KVH, 1), p["vcont"].repeat_interleave(H // KVH, 1)
        return lambda: F.scaled_dot_product_attention(q4, kr, vr, scale=scale, **kw)
    return lambda: F.scaled_dot_product_attention(q4, p["kcont"], p["vcont"], scale=scale,
                                                  enable_gqa=True, **kw)


def run_shape(kind, batch, ctx, n_q, sweep, gen, ceil):
    scale = D ** -0.5
    kv_bytes = 2 * batch * ctx * KVH * D * 2
    n_sets = 1 if DEV == "cpu" else min(64, -(-(512 << 20) // kv_bytes))  # > 8x L2 in all
    sets = [paged_problem(batch, ctx, n_q, gen) for _ in range(n_sets)]
    cfg = default_config(sets[0]["q"].device, num_seqs=batch, kv_heads=KVH, group=H // KVH,
                         head_dim=D, max_seqlen_q=n_q, max_context=ctx, is_decode=n_q == 1)

    def ours(c, p):
        return lambda: paged_attention(p["q"], p["kc"], p["vc"], p["tables"], p["cu"], p["lens"],
                                       scale=scale, max_seqlen_q=n_q, out=p["out"], config=c)

    t0 = time.perf_counter()
    ours(cfg, sets[0])()
    torch.cuda.synchronize() if DEV == "cuda" else None
    first_call_s = time.perf_counter() - t0
    peer_name, repeat_kv = "sdpa(enable_gqa)", False
    try:
        ref = sdpa_peer(sets[0], n_q, ctx, batch, scale)()
    except Exception as e:  # noqa: BLE001 - record and fall back
        print(f"SDPA with enable_gqa failed ({e!r:.120}); repeating kv heads", flush=True)
        peer_name, repeat_kv = "sdpa(repeated kv heads)", True
        ref = sdpa_peer(sets[0], n_q, ctx, batch, scale, True)()
    got = sets[0]["out"].view(batch, n_q, H, D).transpose(1, 2).float()
    err = ((got - ref.float()).norm() / ref.float().norm()).item()
    peers = [sdpa_peer(p, n_q, ctx, batch, scale, repeat_kv) for p in sets]
    t_ours = graph_time([ours(cfg, p) for p in sets])
    try:
        t_sdpa = graph_time(peers)
    except Exception as e:  # noqa: BLE001 - a backend that cannot be captured: time eagerly
        print(f"SDPA graph capture failed ({e!r:.120}); timing it eagerly", flush=True)
        t_sdpa, peer_name = eager_ms(peers[0], DEV), peer_name + " eager"
    backends = {}  # which SDPA backend the default is: each one forced, where it runs
    if DEV == "cuda" and not repeat_kv:
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([be]):
                    backends[be.name] = graph_time(peers) * 1e3
            except Exception as e:  # noqa: BLE001 - a backend that rejects the shape
                backends[be.name] = f"{type(e).__name__}"
    flops = batch * attention_flops(n_q, ctx, H, D)
    row = {"kind": kind, "batch": batch, "context": ctx, "n_q": n_q, "config": cfg.__dict__,
           "us": t_ours * 1e3, "sdpa_us": t_sdpa * 1e3, "ratio_vs_sdpa": t_ours / t_sdpa,
           "kv_GBps": kv_bytes / t_ours / 1e6, "frac_copy_bw": kv_bytes / t_ours / 1e6 / ceil["copy_GBps"],
           "sdpa_frac_copy_bw": kv_bytes / t_sdpa / 1e6 / ceil["copy_GBps"],
           "TFLOPs": flops / t_ours / 1e9, "sdpa_TFLOPs": flops / t_sdpa / 1e9,
           "eager_us": eager_ms(ours(cfg, sets[0]), DEV) * 1e3,
           "sdpa_eager_us": eager_ms(peers[0], DEV) * 1e3, "rel_err_vs_sdpa": err,
           "sdpa_backend_us": backends, "first_call_s": first_call_s, "peer": peer_name,
           "input_sets": n_sets}
    if sweep:
        row["sweep"] = []
        for alt in sweep_configs(cfg, batch, n_q):
            try:
                row["sweep"].append({"config": alt.__dict__,
                                     "us": graph_time([ours(alt, p) for p in sets]) * 1e3})
            except Exception as e:  # noqa: BLE001 - e.g. a tile that exceeds shared memory
                row["sweep"].append({"config": alt.__dict__, "error": repr(e)[:200]})
    del sets, peers, ref, got
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def sweep_configs(cfg, batch, n_q):
    if n_q > 1:
        return PREFILL_SWEEP
    alts = [AttentionConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, cfg.num_splits)
            for c in DECODE_SWEEP]
    if batch * KVH < 1024:  # small batches: how many splits pays
        alts += [AttentionConfig(16, bn, 4, 2, s) for bn in (64, 128) for s in (1, 2, 4, 8, 16, 32, 64)
                 if s != cfg.num_splits]
    return alts


def to_markdown(res) -> str:
    c = res["ceilings"]
    lines = [f"# Paged-attention kernel benchmark ({res['date']})", "",
             f"`{res['command']}` on {res['device']}; torch {res['torch']}, triton {res['triton']}.",
             f"One layer, {H} query / {KVH} kv heads, head dim {D}, bf16, block size {BS}, "
             "shuffled block tables. Peer: torch SDPA (enable_gqa) on the same K/V contiguous.",
             f"Ceilings measured in the same run: copy {c['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s.", "",
             "| kind | batch | context | q tokens | ours (us) | SDPA (us) | ours/SDPA | KV GB/s | "
             "frac. of copy BW | SDPA frac. | TFLOP/s | SDPA TFLOP/s | splits | eager ours / SDPA (us) "
             "| rel. err vs SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['n_q']} | {r['us']:.1f} | "
                     f"{r['sdpa_us']:.1f} | {r['ratio_vs_sdpa']:.2f} | {r['kv_GBps']:.0f} | "
                     f"{r['frac_copy_bw']:.2f} | {r['sdpa_frac_copy_bw']:.2f} | {r['TFLOPs']:.0f} | "
                     f"{r['sdpa_TFLOPs']:.0f} | {r['config']['num_splits']} | "
                     f"{r['eager_us']:.1f} / {r['sdpa_eager_us']:.1f} | {r['rel_err_vs_sdpa']:.1e} |")
    forced = [r for r in res["rows"] if r.get("sdpa_backend_us")]
    if forced:
        lines += ["", "SDPA with one backend forced (us, graph replays; a name: the backend rejected the shape):",
                  "", "| kind | batch | context | default | " + " | ".join(forced[0]["sdpa_backend_us"]) + " |",
                  "|---|---|---|---|" + "---|" * len(forced[0]["sdpa_backend_us"])]
        for r in forced:
            cells = [f"{v:.1f}" if isinstance(v, float) else v for v in r["sdpa_backend_us"].values()]
            lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['sdpa_us']:.1f} | "
                         + " | ".join(cells) + " |")
    sweeps = [r for r in res["rows"] if r.get("sweep")]
    if sweeps:
        lines += ["", "Tile-config sweep (default vs fastest alternative):", "",
                  "| kind | batch | context | default (us) | best alt. (us) | best alt. config |",
                  "|---|---|---|---|---|---|"]
        for r in sweeps:
            ok = [v for v in r["sweep"] if "us" in v]
            best = min(ok, key=lambda v: v["us"]) if ok else {"us": float("nan"), "config": "-"}
            lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['us']:.1f} | "
                         f"{best['us']:.1f} | {best['config']} |")
    return "\n".join(lines) + "\n"


def add_arguments(ap) -> None:
    ap.add_argument("--sweep", nargs="?", const="all", choices=("all", "decode", "prefill"),
                    help="also time alternative tile configs (of one kind of shape)")
    ap.add_argument("--out", "--out-dir", dest="out", default=None, help=OUT_HELP)
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes; on the CPU through Triton's interpreter (checks the script)")


def main(args=None) -> int:
    """`args`: parsed arguments (radixkv bench kernels), or an argv list, or None (sys.argv)."""
    if not isinstance(args, argparse.Namespace):
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(ap)
        args = ap.parse_args(args)
    global DEV
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    if DEV == "cpu" and not args.smoke:
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": " ".join(["python3 benchmarks/kernels.py"] + ([f"--sweep {args.sweep}"] if args.sweep else [])
                               + (["--smoke"] if args.smoke else [])
                               + ([f"--only {args.only}"] if args.only else [])),
           "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(),
           "ceilings": ceilings(args.smoke), "rows": []}
    print(f"ceilings: {res['ceilings']}", flush=True)
    decode_shapes, prefill_shapes = ([(2, 64)], [(32, 32)]) if args.smoke else (DECODE_SHAPES, PREFILL_SHAPES)
    shapes = []
    if args.only in (None, "decode"):
        shapes += [("decode", b, c, 1) for b, c in decode_shapes]
    if args.only in (None, "prefill"):
        shapes += [("prefill", 1, prefix + n, n) for n, prefix in prefill_shapes]
    for kind, batch, ctx, n_q in shapes:
        row = run_shape(kind, batch, ctx, n_q, args.sweep in ("all", kind), gen, res["ceilings"])
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    out = out_dir(args.out, "kernels")
    with open(out / "kernels.json", "w") as f:
        json.dump(res, f, indent=1)
    md = to_markdown(res)
    with open(out / "kernels.md", "w") as f:
        f.write(md)
    print(md)
    print(f"results in {out}/kernels.*")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
