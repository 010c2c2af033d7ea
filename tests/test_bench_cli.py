"""`radixkv bench NAME --help` for every benchmark; every benchmark is in the bench table; a run
with the default --out leaves the committed benchmarks/results/ alone."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.cli.bench import BENCHMARKS

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def _radixkv(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixkv.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, **kw)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help(name):
    # GPU benchmarks too: on this CPU machine their --help must print, the bench's main not run
    r = _radixkv("bench", name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: radixkv bench {name}")


def test_every_benchmark_is_registered():
    # a benchmark is a module of benchmarks/ with a main; helpers (workloads, timing, ...) have none
    benchmarks = {f"benchmarks.{p.stem}" for p in (REPO / "benchmarks").glob("*.py")
                  if re.search(r"^def main\(", p.read_text(), re.M)}
    registered = {module for module, _ in BENCHMARKS.values()}
    assert benchmarks - registered == set()
    assert registered - benchmarks == set()


def _results_state():
    files = {p: p.stat().st_mtime_ns for p in RESULTS.rglob("*")}
    status = subprocess.run(["git", "status", "--porcelain", "--", str(RESULTS)], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    return files, status


def test_default_out_is_not_the_committed_results(tmp_path):
    before = _results_state()
    # TMPDIR: the default temporary folder lands in pytest's, which cleans it up
    r = _radixkv("bench", "cache-ops", "--groups", "4", "--per-group", "4", "--system", "160", "--question", "32",
                 "--decode", "16", "--runs", "1", "--no-scaling", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert _results_state() == before
    [out] = re.findall(r"^results in (.+)/cache_ops\.\*$", r.stdout, re.M)
    assert Path(out).parent == tmp_path and (Path(out) / "cache_ops.json").is_file()
