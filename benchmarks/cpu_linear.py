"""CPU linear layers at decode sizes: F.linear (x W^T) against (W x^T)^T, SmolLM2-135M's shapes.

One decode step's products (30 layers of q|k|v, o, gate|up and down projections, then the tied
head over 49,152 tokens), fp32, distinct weights per layer so they stream from memory as in the
model. Milliseconds per step, the median of --repeats, for 1 to 16 rows:
  F.linear       x W^T as MKL gets it from torch
  W x^T          (W x^T)^T for every weight, a lone row doubled
  layers.linear  radixkv.models.layers.linear, the engine's: W x^T up to layers.SMALL_ROWS rows, else F.linear
"""

import argparse
import statistics
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q|k|v, o, gate|up, down: [out, in]
HEAD = (49152, 576)


def add_arguments(p) -> None:
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=5)


def main(args) -> int:
    import torch
    import torch.nn.functional as F

    from radixkv.models.layers import linear

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) for _ in range(30) for o, i in SHAPES] + [torch.randn(*HEAD, generator=g)]

    def transposed(x, w):
        xx = x.expand(2, -1).contiguous() if x.shape[0] == 1 else x
        return torch.mm(w, xx.t())[:, : x.shape[0]].t().contiguous()

    fns = {"F.linear": F.linear, "W x^T": transposed, "layers.linear": linear}
    print("| rows | " + " | ".join(f"{k} (ms/step)" for k in fns) + " |")
    print("|---:|" + "---:|" * len(fns))
    for rows in args.rows:
        xs = {i: torch.randn(rows, i, generator=g) for i in {i for _, i in SHAPES}}
        times = {k: [] for k in fns}
        for _ in range(args.repeats):  # interleaved, so a change of the machine's load hits all three
            for k, fn in fns.items():
                t = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                times[k].append((time.perf_counter() - t) * 1e3)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(t):.1f}" for t in times.values()) + " |", flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
