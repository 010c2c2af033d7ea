"""`radixkv` command line.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`main(args) -> int`; modules keep heavy imports (torch) inside `main`, so
`radixkv --help` stays fast.
"""

import argparse
import importlib
import importlib.util

# name -> (module, one-line help)
SUBCOMMANDS = {
    "serve": ("radixkv.cli.serve", "start the OpenAI-compatible server (front + engine worker)"),
    "generate": ("radixkv.cli.generate", "generate completions offline for prompts given on the command line"),
    "bench": ("radixkv.cli.bench", "run a benchmark: memory accounting, cache ops, throughput, serving load"),
    "demo": ("radixkv.cli.demo", "serve SmolLM2-135M (--tiny: a random tiny model), send shared-prompt chats, "
                                 "print the answers and the cache figures"),
    "make-tiny-model": ("radixkv.cli.make_tiny_model", "write a tiny random-weight HF model folder (deterministic)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixkv", description="Prefix-caching LLM serving runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue  # not part of this installation
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._main(args) or 0)

