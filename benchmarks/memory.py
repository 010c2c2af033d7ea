"""Memory accounting of paging and prefix sharing, on the real cache manager (no model).

For each workload and block size, every request is admitted in order (its prompt
computed, so later prompts hit the blocks earlier ones committed), then all of them
decode together, `chunk` tokens per step, until their outputs are written. At every
step we record what three layouts would hold for the live sequences:

- contiguous: each sequence reserves `max_len` slots up front (the pre-paging baseline);
- paged: each sequence holds ceil(len / B) blocks of its own (paging, no sharing);
- shared: the blocks the cache manager really holds (prefix hits, forks, copy-on-write).

Parallel samples fork from the computed prompt. Beam search keeps `width` beams: each
step every new beam picks a parent among the current beams (uniformly, seeded), forks
it and appends a token; the old beams are freed, so shared history is ref-counted,
never copied.

Reported per (workload, block size): slot utilisation (tokens / paged slots), last-block
slack, time-averaged savings of sharing vs paging and of paging vs contiguous, requests
that fit in the pool a contiguous layout needs for 64 requests, and the prefix hit rate.
"""

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass

from radixkv.cache import KVCacheManager

BLOCK_SIZES = (8, 16, 32, 128)


@dataclass
class MemoryResult:
    workload: str
    block_size: int
    requests: int
    slot_utilisation: float  # tokens held / slots of the blocks held (paged, peak)
    last_block_slack: float  # mean empty slots in each sequence's last block (peak)
    saving_vs_paged: float  # 1 - shared blocks / paged blocks, averaged over steps
    saving_vs_contiguous: float  # 1 - shared slots / contiguous slots, averaged over steps
    fit_contiguous: int  # requests that fit in the pool (64 * max_len slots)
    fit_paged: int
    fit_shared: int
    hit_rate: float  # prefix hit tokens / prefix query tokens
    peak_shared_blocks: int
    peak_paged_blocks: int


class _Trace:
    """Drives one workload through a manager and samples the three layouts."""

    def __init__(self, workload, block_size: int, max_len: int, chunk: int, seed: int):
        need = sum((len(r.prompt) + len(r.output)) * max(r.n, r.beam_width, 1) for r in workload.requests)
        self.m = KVCacheManager(num_blocks=need // block_size + 64 * max(1, len(workload.requests)), block_size=block_size)
        self.B, self.max_len, self.chunk = block_size, max_len, chunk
        self.rng = random.Random(seed)
        self.next_id = 0
        self.live: dict[int, tuple[list[int], int]] = {}  # seq id -> (output tokens, produced)
        self.samples: list[tuple[int, int, int]] = []  # (shared blocks, paged blocks, live seqs)
        self.peak = (0, 0, 0, 0)  # shared, paged, tokens, slack

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def compute(self, sid: int, token_ids: list[int]) -> None:
        assert self.m.try_reserve(sid, len(token_ids)), \
            f"pool too small by {self.m.blocks_short(sid, len(token_ids))} blocks"
        self.m.take_copy_ops()  # an engine runs these before the forward; here only the accounting matters
        self.m.mark_tokens_computed(sid, token_ids)

    def admit(self, req) -> list[int]:
        sid = self.new_id()
        cached = self.m.add_sequence(sid, req.prompt, salt=req.salt)
        self.compute(sid, req.prompt[cached:])
        sids = [sid]
        for i in range(1, max(req.n, req.beam_width, 1)):
            child = self.new_id()
            self.m.fork(sid, child)
            sids.append(child)
        for i, s in enumerate(sids):
            # Parallel samples and beams write different tokens: derive each one's output.
            out = req.output if i == 0 else [(t + 7 * i) % 2045 + 3 for t in req.output]
            self.live[s] = (out, 0)
        return sids

    def step_sequence(self, sid: int, k: int) -> None:
        out, produced = self.live[sid]
        k = min(k, len(out) - produced)
        self.compute(sid, out[produced : produced + k])
        self.live[sid] = (out, produced + k)

    def sample(self) -> None:
        lens = [self.m.num_tokens(s) for s in self.live]
        paged = sum(math.ceil(n / self.B) for n in lens)
        shared = self.m.stats().in_use_blocks
        self.samples.append((shared, paged, len(lens)))
        if paged > self.peak[1]:
            slack = sum(-n % self.B for n in lens) / max(1, len(lens))
            self.peak = (shared, paged, sum(lens), slack)


def _run_plain(t: _Trace, workload) -> None:
    for r in workload.requests:
        t.admit(r)
    t.sample()
    while t.live:
        for s in list(t.live):
            t.step_sequence(s, t.chunk)
        t.sample()
        for s in [s for s, (out, produced) in t.live.items() if produced >= len(out)]:
            t.m.free(s)
            del t.live[s]


def _run_beams(t: _Trace, workload) -> None:
    beams = [t.admit(r) for r in workload.requests]
    # Beam i of a request writes its own token stream; built once, not per fork.
    outputs = [[[(tok + 11 * i) % 2045 + 3 for tok in r.output] for i in range(r.beam_width)] for r in workload.requests]
    t.sample()
    for step in range(max(len(r.output) for r in workload.requests)):
        for g, r in enumerate(workload.requests):
            if step >= len(r.output):
                continue
            parents = beams[g]
            children = []
            for i in range(len(parents)):
                child = t.new_id()
                t.m.fork(parents[t.rng.randrange(len(parents))], child)
                t.live[child] = (outputs[g][i], step)
                children.append(child)
            for p in parents:  # dropped beams release their blocks before the children write
                t.m.free(p)
                del t.live[p]
            for c in children:
                t.step_sequence(c, 1)
            beams[g] = children
        t.sample()
    for s in list(t.live):
        t.m.free(s)
        del t.live[s]


def measure(workload, block_size: int, max_len: int = 4096, chunk: int = 16, seed: int = 0) -> MemoryResult:
    t = _Trace(workload, block_size, max_len, chunk, seed)
    (_run_beams if any(r.beam_width for r in workload.requests) else _run_plain)(t, workload)
    t.m.check_invariants()
    st = t.m.stats()
    steps = [s for s in t.samples if s[2]]
    saving_paged = sum(1 - sh / pg for sh, pg, _ in steps) / len(steps)
    saving_contig = sum(1 - sh * block_size / (live * max_len) for sh, _, live in steps) / len(steps)
    shared, paged, tokens, slack = t.peak
    pool = 64 * max_len  # slots a contiguous layout needs for 64 requests
    nreq = len(workload.requests)
    return MemoryResult(
        workload=workload.name,
        block_size=block_size,
        requests=nreq,
        slot_utilisation=tokens / (paged * block_size),
        last_block_slack=slack,
        saving_vs_paged=saving_paged,
        saving_vs_contiguous=saving_contig,
        fit_contiguous=pool // max_len,
        fit_paged=int(pool / (paged * block_size / nreq)),
        fit_shared=int(pool / (max(shared, 1) * block_size / nreq)),
        hit_rate=st.prefix_hit_tokens / max(1, st.prefix_query_tokens),
        peak_shared_blocks=shared,
        peak_paged_blocks=paged,
    )


def run_all(workloads, block_sizes=BLOCK_SIZES, max_len=4096) -> list[MemoryResult]:
    return [measure(w, b, max_len) for w in workloads for b in block_sizes]


def to_markdown(results: list[MemoryResult]) -> str:
    rows = [
        "| workload | B | util | slack | saved vs paged | saved vs contiguous | fit: contiguous / paged / shared | hit rate |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.workload} | {r.block_size} | {r.slot_utilisation:.1%} | {r.last_block_slack:.1f} | "
            f"{r.saving_vs_paged:.1%} | {r.saving_vs_contiguous:.1%} | "
            f"{r.fit_contiguous} / {r.fit_paged} / {r.fit_shared} | {r.hit_rate:.1%} |"
        )
    return "\n".join(rows)


def plot(results: list[MemoryResult], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(BLOCK_SIZES)
    for j, b in enumerate(BLOCK_SIZES):
        sel = {r.workload: r for r in results if r.block_size == b}
        xs = [i + j * width for i in range(len(names))]
        axes[0].bar(xs, [sel[n].saving_vs_paged * 100 if n in sel else 0 for n in names], width, label=f"B={b}")
        axes[1].bar(xs, [sel[n].slot_utilisation * 100 if n in sel else 0 for n in names], width, label=f"B={b}")
    for ax, title in zip(axes, ["memory saved by sharing vs paging alone (%)", "slot utilisation at peak (%)"]):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--scale", type=float, default=1.0, help="shrink workload counts and lengths (tests use 0.05)")
    p.add_argument("--max-len", type=int, default=4096, help="contiguous reservation per sequence (model context)")
    p.add_argument("--out", default=None, help="folder for memory.json / memory.md / memory.png (default: a new temp folder)")
    p.add_argument("--no-plot", action="store_true")


def main(args) -> int:
    from benchmarks.out_dir import out_dir
    from benchmarks.workloads import all_workloads

    t0 = time.perf_counter()
    results = run_all(all_workloads(scale=args.scale), max_len=args.max_len)
    took = time.perf_counter() - t0
    out = out_dir(args.out, "memory")
    table = to_markdown(results)
    (out / "memory.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    cmd = f"radixkv bench memory --scale {args.scale} --max-len {args.max_len}"
    (out / "memory.md").write_text(f"# Memory accounting\n\n{time.strftime('%Y-%m-%d')}, `{cmd}`, {took:.1f} s on the CPU.\n\n{table}\n")
    if not args.no_plot:
        plot(results, out / "memory.png")
    print(table)
    print(f"\n{len(results)} runs in {took:.1f} s; results in {out}/memory.*")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
