"""Serving load: drive a running `radixkv serve` (or any OpenAI-compatible server) over HTTP.

Requests of a workload (benchmarks/workloads.py, token-id prompts) go to
/v1/completions with `stream: true`, either at a Poisson request rate or at a fixed
concurrency. Per request we record time to first token (TTFT), time per output token
after the first (TPOT) and end-to-end latency; overall throughput, and the prefix-cache
hit rate from the server's /metrics (difference of the token counters over the run).
"""

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass

from benchmarks.out_dir import OUT_HELP, out_dir

WORKLOADS = ("shared_chats_short", "shared_chats", "generated_shared_prefix", "multi_turn", "unique")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft: float
    tpot: float
    latency: float
    error: str = ""


def _counter(metrics_text: str, name_part: str) -> float:
    """Sum of the samples of every counter whose name contains `name_part` (e.g. 'prefix_cache_hits')."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\deE.]+|NaN)$", line)
        if m and name_part in m.group(1) and m.group(1).endswith("_total"):
            total += float(m.group(3))
    return total


async def _one(client, url, model, req, max_tokens) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    n_out = cached = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, len(req.prompt), 0, 0, 0, 0, 0, f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    if first is None:
                        first = time.perf_counter()
                if chunk.get("usage"):
                    n_out = chunk["usage"]["completion_tokens"]
                    cached = ((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        return RequestResult(False, len(req.prompt), 0, 0, 0, 0, time.perf_counter() - t0, repr(e)[:200])
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (n_out - 1) if n_out > 1 else 0.0
    return RequestResult(True, len(req.prompt), n_out, cached, first - t0, tpot, end - t0)


async def run_load(url, model, requests, max_tokens, rate, concurrency, seed=0, progress=True):
    import httpx
    from tqdm import tqdm

    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def guarded(req):
            if sem:
                async with sem:
                    r = await _one(client, url, model, req, max_tokens or req.max_tokens)
            else:
                r = await _one(client, url, model, req, max_tokens or req.max_tokens)
            bar.update(1)
            return r

        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(guarded(req)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    bar.close()
    return results


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def summarise(results, seconds, hits, queries) -> dict:
    ok = [r for r in results if r.ok]
    s = {"requests": len(results), "failed": len(results) - len(ok), "seconds": seconds,
         "output_tok_per_s": sum(r.output_tokens for r in ok) / seconds,
         "request_per_s": len(ok) / seconds, "server_hit_rate": hits / queries if queries else None,
         "client_cached_fraction": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))}
    for name in ("ttft", "tpot", "latency"):
        xs = [getattr(r, name) for r in ok]
        s[name] = {"mean": statistics.fmean(xs) if xs else float("nan"),
                   **{f"p{q}": _pct(xs, q) for q in (50, 90, 99)}}
    return s


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, name, unit in zip(axes, ("ttft", "tpot", "latency"), (1e3, 1e3, 1)):
        ax.hist([getattr(r, name) * unit for r in ok], bins=40)
        ax.set_title(f"{name} ({'ms' if unit == 1e3 else 's'})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--workload", choices=WORKLOADS, default="shared_chats_short")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--scale", type=float, default=1.0, help="shrink prompt lengths (e.g. 0.1 for a tiny CPU model)")
    p.add_argument("--max-tokens", type=int, default=0, help="cap the output length (0: the workload's)")
    p.add_argument("--rate", type=float, default=0.0, help="requests per second, Poisson (0: all at once)")
    p.add_argument("--concurrency", type=int, default=0, help="at most this many in flight (0: no limit)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--no-progress", action="store_true")


def build_requests(args):
    from benchmarks import workloads as wl

    def s(x):
        return max(1, int(x * args.scale))

    n = args.num_requests
    make = {
        "shared_chats_short": lambda: wl.shared_chats(n, s(2400), s(200), s(60), args.vocab, args.seed,
                                                       name="shared_chats_short"),
        "shared_chats": lambda: wl.shared_chats(n, s(2400), s(200), s(900), args.vocab, args.seed),
        "generated_shared_prefix": lambda: wl.generated_shared_prefix(max(1, n // 16), 16, s(2048), s(128), s(256),
                                                                      args.vocab, args.seed),
        "multi_turn": lambda: wl.multi_turn(max(1, n // 4), 4, s(512), s(64), s(200), args.vocab, args.seed),
        "unique": lambda: wl.unique(n, s(2600), s(900), args.vocab, args.seed),
    }
    return make[args.workload]().requests[:n]


def main(args) -> int:
    import httpx

    url = args.url.rstrip("/")
    model = args.model or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    requests = build_requests(args)
    before = httpx.get(url + "/metrics", timeout=10).text
    t = time.perf_counter()
    results = asyncio.run(run_load(url, model, requests, args.max_tokens, args.rate, args.concurrency, args.seed,
                                   not args.no_progress))
    seconds = time.perf_counter() - t
    after = httpx.get(url + "/metrics", timeout=10).text
    hits = _counter(after, "prefix_cache_hits") - _counter(before, "prefix_cache_hits")
    queries = _counter(after, "prefix_cache_queries") - _counter(before, "prefix_cache_queries")
    summary = summarise(results, seconds, hits, queries)
    summary.update(date=time.strftime("%Y-%m-%d"), workload=args.workload, rate=args.rate,
                   concurrency=args.concurrency, model=model, scale=args.scale)
    out = out_dir(args.out, "serve")
    stem = f"serve_{args.workload}"
    (out / f"{stem}.json").write_text(json.dumps({"summary": summary, "requests": [asdict(r) for r in results]},
                                                 indent=1) + "\n")
    plot(results, out / f"{stem}.png")
    ms = {k: {q: v * 1e3 for q, v in summary[k].items()} for k in ("ttft", "tpot", "latency")}
    (out / f"{stem}.md").write_text(
        f"# Serving load: {args.workload}\n\n{summary['date']}, model `{model}`, {len(requests)} requests, "
        f"rate {args.rate or 'all at once'}, concurrency {args.concurrency or 'unlimited'}, scale {args.scale}.\n\n"
        f"| output tok/s | req/s | failed | hit rate | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 (ms) | latency p50 / p99 (ms) |\n"
        f"|---:|---:|---:|---:|---|---|---|\n"
        f"| {summary['output_tok_per_s']:,.0f} | {summary['request_per_s']:.1f} | {summary['failed']} | "
        f"{(summary['server_hit_rate'] or 0):.1%} | {ms['ttft']['p50']:.0f} / {ms['ttft']['p90']:.0f} / {ms['ttft']['p99']:.0f} | "
        f"{ms['tpot']['p50']:.1f} / {ms['tpot']['p90']:.1f} | {ms['latency']['p50']:.0f} / {ms['latency']['p99']:.0f} |\n")
    print(json.dumps(summary, indent=1))
    print(f"results in {out}/{stem}.*")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
