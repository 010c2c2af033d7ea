"""`radixkv make-tiny-model DIR`: a tiny random-weight HF model folder."""

from radixkv.models.tiny import ARCHS


def add_arguments(p):
    p.add_argument("dir", help="output folder (created if missing)")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="model family (default: llama)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")


def main(args) -> int:
    from radixkv.models.tiny import build_tiny_model

    out = build_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote {args.arch} tiny model to {out}")
    return 0
