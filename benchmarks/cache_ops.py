"""Cache-manager operations per second on a seeded shared-prompt trace (CPU, no model).

Trace: `groups` system prompts of `system` random tokens; `per_group` requests each, in a
seeded random order across groups; each request = system prompt + `question` random
tokens, then `decode` output tokens. Per request: add_sequence (match), try_reserve +
mark_tokens_computed for the uncached prompt part (commit), the same for the output
(`decode_chunk` tokens at a time), free. The pool holds `pool_frac` of the deduplicated
working set, so eviction runs. Blocks are never written: this times the bookkeeping only,
sha256 block keys on.

Reported: wall time of the whole trace (median of `runs`, uninstrumented), per-operation
throughput from one instrumented run (evict = blocks evicted per second inside
try_reserve, whose own figure excludes it), hit rate against the ideal, the Python heap
the manager holds after the trace, and the cost of each operation as the number of cached
blocks grows (it should stay flat). `--peer vllm` drives vLLM's v1 KVCacheManager through
the same trace in the same run (benchmarks/peer_vllm.py) and puts both side by side.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from array import array

from benchmarks.out_dir import out_dir
from radixkv.cache import KVCacheManager
from radixkv.cache.hashing import TOKEN_TYPECODE


def make_trace(groups=64, per_group=32, system=2400, question=200, decode=128, vocab=32000, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(system)] for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    return [(systems[g] + [rng.randrange(vocab) for _ in range(question)], [rng.randrange(vocab) for _ in range(decode)])
            for g in order]


def pool_blocks(trace, system: int, groups: int, block_size: int, frac: float) -> int:
    shared = groups * (system // block_size)
    private = sum(-(-(len(p) + len(o)) // block_size) - system // block_size for p, o in trace)
    return int(frac * (shared + private))


def run_trace(m: KVCacheManager, trace, decode_chunk: int, timers=None) -> None:
    """Drive the trace; with `timers` (dict name -> [seconds, calls]) time every call."""
    clock = time.perf_counter
    if timers is None:
        for i, (prompt, out) in enumerate(trace):
            hit = m.add_sequence(i, prompt)
            assert m.try_reserve(i, len(prompt) - hit)
            m.mark_tokens_computed(i, prompt[hit:])
            for j in range(0, len(out), decode_chunk):
                piece = out[j : j + decode_chunk]
                assert m.try_reserve(i, len(piece))
                m.mark_tokens_computed(i, piece)
            m.free(i)
        return

    def timed(name, phase, fn, *args):
        t0 = clock()
        r = fn(*args)
        t = clock() - t0
        acc = timers.setdefault(name, [0.0, 0])
        acc[0] += t
        acc[1] += 1
        phases.setdefault(phase, [0.0, 0])[0] += t
        return r

    phases = timers.setdefault("phases", {})  # per request phase, as peer_vllm.py times them
    for i, (prompt, out) in enumerate(trace):
        hit = timed("match", "lookup", m.add_sequence, i, prompt)
        assert timed("reserve", "prefill", m.try_reserve, i, len(prompt) - hit)
        timed("commit", "prefill", m.mark_tokens_computed, i, prompt[hit:])
        for j in range(0, len(out), decode_chunk):
            piece = out[j : j + decode_chunk]
            assert timed("reserve", "decode", m.try_reserve, i, len(piece))
            timed("commit", "decode", m.mark_tokens_computed, i, piece)
            phases["decode"][1] += 1
        timed("free", "free", m.free, i)
        for phase in ("lookup", "prefill", "free"):
            phases[phase][1] += 1


def heap_after_trace(make, drive) -> dict:
    """Python heap (tracemalloc) held by the manager `make()` builds once `drive(m)` ran
    the trace, and the peak while it ran; the trace itself is allocated before."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        m = make()
        drive(m)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {"retained_mib": (current - base) / 2**20, "peak_mib": (peak - base) / 2**20}


def _instrument_evict(m, timers):
    inner = m.tree.evict

    def evict(n):
        t0 = time.perf_counter()
        inner(n)
        acc = timers.setdefault("evict", [0.0, 0])
        acc[0] += time.perf_counter() - t0
        acc[1] += n

    m.tree.evict = evict


def measure_trace(args) -> dict:
    trace = make_trace(args.groups, args.per_group, args.system, args.question, args.decode, seed=args.seed)
    N = pool_blocks(trace, args.system, args.groups, args.block_size, args.pool_frac)
    walls, last = [], None
    for _ in range(args.runs):
        m = KVCacheManager(N, args.block_size, hash_algo=args.hash_algo)
        t0 = time.perf_counter()
        run_trace(m, trace, args.decode_chunk)
        walls.append(time.perf_counter() - t0)
        last = m
    last.check_invariants()
    st = last.stats()
    timers: dict = {}
    m = KVCacheManager(N, args.block_size, hash_algo=args.hash_algo)
    _instrument_evict(m, timers)
    run_trace(m, trace, args.decode_chunk, timers)
    phases = timers.pop("phases")
    # The same trace with every prompt already a uint32 array (what the manager keeps): the
    # lookup without converting Python ints, as an engine that holds arrays pays it.
    arrays: dict = {}
    run_trace(KVCacheManager(N, args.block_size, hash_algo=args.hash_algo),
              [(array(TOKEN_TYPECODE, p), o) for p, o in trace], args.decode_chunk, arrays)
    t, c = arrays["phases"]["lookup"]
    phases["lookup_from_array"] = [t, c]
    ev = timers.get("evict", [0.0, 0])
    timers["reserve"][0] -= ev[0]  # reserve's own cost, eviction reported on its own line
    heap = heap_after_trace(lambda: KVCacheManager(N, args.block_size, hash_algo=args.hash_algo),
                            lambda m: run_trace(m, trace, args.decode_chunk))
    query = sum(len(p) for p, _ in trace)
    ideal = (args.groups * (args.per_group - 1)) * (args.system // args.block_size * args.block_size)
    return {
        "num_blocks": N, "requests": len(trace), "wall_s_median": statistics.median(walls),
        "wall_s_runs": walls, "hit_rate": st.prefix_hit_tokens / st.prefix_query_tokens,
        "hit_tokens": st.prefix_hit_tokens, "query_tokens": st.prefix_query_tokens,
        "ideal_hit_rate": ideal / query, "evicted_blocks": st.evicted_blocks, "decode_chunk": args.decode_chunk,
        "ops": {k: {"calls": c, "ops_per_s": c / t if t else None, "us_per_op": 1e6 * t / c if c else None}
                for k, (t, c) in timers.items()},
        "heap": heap, "phases": {k: {"calls": c, "us_per_op": 1e6 * t / c} for k, (t, c) in phases.items()},
        "trace_data": (trace, N),
    }


def measure_scaling(args, sizes=(1_000, 10_000, 100_000, 400_000), reps=300, rounds_per_size=3) -> list[dict]:
    """Per-operation cost with about `size` cached blocks: the tree is filled with chains of
    171 blocks sharing their first 150, the pool is exactly full, then `reps` more such
    requests run, each evicting the 20 blocks it needs: the tree keeps its size."""
    rng, B, out = random.Random(args.seed + 1), args.block_size, []
    system = [rng.randrange(32000) for _ in range(2400)]

    def request():
        return system + [rng.randrange(32000) for _ in range(200)], [rng.randrange(32000) for _ in range(128)]

    for size in sizes:
        # Each request caches 20 blocks of its own; its partial last block goes back free.
        chains = max(1, (size - 150) // 20)
        m = KVCacheManager(150 + 20 * chains + 1, B, hash_algo=args.hash_algo)
        run_trace(m, [request() for _ in range(chains)], 128)
        rounds = []
        for r in range(rounds_per_size):  # median of rounds: the machine is shared
            timers: dict = {}
            _instrument_evict(m, timers)
            run_trace(_Offset(m, chains + r * reps), [request() for _ in range(reps)], 128, timers)
            del m.tree.evict, timers["phases"]  # back to the class's method; phases unused here
            timers["reserve"][0] -= timers["evict"][0]
            rounds.append({k: 1e6 * t / c for k, (t, c) in timers.items()})
        m.check_invariants()
        out.append({"cached_blocks": m.stats().cached_blocks,
                    "us_per_op": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}})
    return out


class _Offset:
    """The manager with sequence ids shifted, so a second trace reuses no live id."""

    def __init__(self, m, offset):
        self.m, self.k = m, offset

    def add_sequence(self, i, p):
        return self.m.add_sequence(i + self.k, p)

    def try_reserve(self, i, n):
        return self.m.try_reserve(i + self.k, n)

    def mark_tokens_computed(self, i, t):
        return self.m.mark_tokens_computed(i + self.k, t)

    def free(self, i):
        return self.m.free(i + self.k)


def to_markdown(res: dict, scaling: list[dict], cmd: str, peer: dict | None = None) -> str:
    load = ", ".join(f"{x:.1f}" for x in res["load_avg_before"])
    lines = [f"# Cache manager operations\n\n{time.strftime('%Y-%m-%d')}, `{cmd}`, Python {sys.version.split()[0]}, "
             f"this 2-core CPU machine, shared with other jobs (load average before the run {load}).\n",
             f"Trace: {res['requests']} requests, pool {res['num_blocks']} blocks, {res['evicted_blocks']} evicted. "
             f"**Whole trace {res['wall_s_median'] * 1000:.0f} ms** (median of {len(res['wall_s_runs'])}), "
             f"hit rate **{res['hit_rate']:.1%}** (ideal {res['ideal_hit_rate']:.1%}).\n",
             "| operation | calls | ops/s | us/op |", "|---|---:|---:|---:|"]
    for k, v in res["ops"].items():
        unit = " (blocks)" if k == "evict" else ""
        lines.append(f"| {k}{unit} | {v['calls']} | {v['ops_per_s']:,.0f} | {v['us_per_op']:.2f} |")
    lines += ["", "Decode: output tokens reserved and committed "
              + ("one at a time (as an engine decodes)." if res["decode_chunk"] == 1 else
                 f"{res['decode_chunk']} at a time; `--decode-chunk 1` times per-token decoding.")]
    if peer is not None:
        lines += ["", _peer_markdown(res, peer)]
    if scaling:
        lines += ["", "Cost per operation (us) against cached blocks; each request hits 150 blocks, adds 21, "
                  "evicts 20:", "",
                  "| cached blocks | match | reserve | commit | free | evict (per block) |",
                  "|---:|---:|---:|---:|---:|---:|"]
    for s in scaling:
        u = s["us_per_op"]
        lines.append(f"| {s['cached_blocks']:,} | {u['match']:.1f} | {u['reserve']:.1f} | {u['commit']:.1f} | "
                     f"{u['free']:.1f} | {u['evict']:.2f} |")
    return "\n".join(lines) + "\n"


def _peer_markdown(res: dict, peer: dict) -> str:
    if "error" in peer:
        return f"Peer not run: its cache manager could not be imported here ({peer['error']})."
    ours, theirs = res["phases"], peer["phases"]
    rows = [("whole trace (s, median)", f"{res['wall_s_median']:.3f}", f"{peer['wall_s_median']:.3f}",
             peer["wall_s_median"] / res["wall_s_median"]),
            ("hit rate", f"{res['hit_rate']:.2%} ({res['hit_tokens']:,} tokens)",
             f"{peer['hit_rate']:.2%} ({peer['hit_tokens']:,} tokens)", None),
            ("evicted blocks", f"{res['evicted_blocks']:,}", f"{peer['evicted_blocks']:,}", None)]
    for k, label in (("lookup", "lookup, per request"), ("prefill", "prefill reserve + commit, per request"),
                     ("decode", "decode reserve + commit, per chunk"), ("free", "free, per request")):
        a, b = ours[k]["us_per_op"], theirs[k]["us_per_op"]
        rows.append((f"{label} (us)", f"{a:.1f}", f"{b:.1f}", b / a))
        if k == "lookup":
            rows.append(("lookup, prompt given as a uint32 array (us)", f"{ours['lookup_from_array']['us_per_op']:.1f}",
                         "", None))
    for k, label in (("retained_mib", "heap held after the trace (MiB)"), ("peak_mib", "heap peak during it (MiB)")):
        a, b = res["heap"][k], peer["heap"][k]
        rows.append((label, f"{a:.1f}", f"{b:.1f}", b / a if a else None))
    out = [f"Side by side with {peer['name']}, the same trace in the same run (benchmarks/peer_vllm.py: "
           "lookup includes hashing the prompt's blocks, which vLLM does when a request is created; "
           "its allocate_slots also caches the new full blocks):", "",
           "| | radixkv.cache | " + peer["name"] + " | peer / ours |", "|---|---:|---:|---:|"]
    out += [f"| {name} | {a} | {b} | {'' if r is None else f'{r:.1f}x'} |" for name, a, b, r in rows]
    return "\n".join(out)


def add_arguments(ap) -> None:
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=32)
    ap.add_argument("--system", type=int, default=2400)
    ap.add_argument("--question", type=int, default=200)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--decode-chunk", type=int, default=128, help="output tokens per reserve/commit (1 = per token)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-frac", type=float, default=0.3)
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="also drive this peer's cache manager through the trace (pip install '.[peers]')")
    ap.add_argument("--out", default=None,
                    help="folder for cache_ops.json / cache_ops.md (default: a new temp folder; '' = none)")


def main(args=None) -> int:
    """`args`: parsed arguments (radixkv bench cache-ops), or an argv list, or None (sys.argv)."""
    if not isinstance(args, argparse.Namespace):
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(ap)
        argv = args
        args = ap.parse_args(argv)
        shown, prog = (sys.argv[1:] if argv is None else argv), "python -m benchmarks.cache_ops"
    else:
        shown = sys.argv[3:] if sys.argv[1:3] == ["bench", "cache-ops"] else []
        prog = "radixkv bench cache-ops"
    load = os.getloadavg()
    res = measure_trace(args)
    res["load_avg_before"] = load
    trace, N = res.pop("trace_data")
    peer = None
    if args.peer == "vllm":
        from benchmarks import peer_vllm

        peer = peer_vllm.measure(trace, N, args.block_size, args.decode_chunk, args.runs)
    del trace
    scaling = [] if args.no_scaling else measure_scaling(args)
    cmd = prog + "".join(" " + a for a in shown)
    md = to_markdown(res, scaling, cmd, peer)
    print(md)
    if args.out != "":
        out = out_dir(args.out, "cache-ops")
        tag = ("" if args.decode_chunk == 128 else f"_chunk{args.decode_chunk}") + (f"_{args.peer}" if args.peer else "")
        (out / f"cache_ops{tag}.json").write_text(
            json.dumps({"args": vars(args), "trace": res, "peer": peer, "scaling": scaling}, indent=1) + "\n")
        (out / f"cache_ops{tag}.md").write_text(md)
        print(f"results in {out}/cache_ops{tag}.*")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
