"""`radixkv SUB --help` for every subcommand, and a `radixkv --help` that stays light."""

import subprocess
import sys

import pytest

from radixkv.cli import SUBCOMMANDS


def _radixkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixkv.cli", *args], capture_output=True, text=True, timeout=120)


def test_top_level_help_lists_every_subcommand():
    r = _radixkv("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: radixkv")
    assert all(name in r.stdout for name in SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help(name):
    r = _radixkv(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: radixkv {name}")


def test_building_the_parser_imports_no_torch():
    # every subcommand's heavy imports wait for its main, so `radixkv --help` stays fast
    code = ("import sys; from radixkv.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'transformers', 'uvicorn', 'tokenizer_server.serve') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
