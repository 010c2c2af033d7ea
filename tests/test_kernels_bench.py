"""benchmarks/kernels.py runs end to end (tiny shapes, Triton interpreter on the CPU) and
writes its table; its numbers are only meaningful on a GPU."""

import importlib.util
import json
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "kernels.py"


def test_kernel_benchmark_smoke(tmp_path):
    if torch.cuda.is_available():  # the real run is the GPU benchmark itself
        return
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "kernels.json").read_text())
    assert [r["kind"] for r in res["rows"]] == ["decode", "prefill"]
    for r in res["rows"]:
        assert r["rel_err_vs_sdpa"] < 1e-2, r  # ours and SDPA computed the same attention
        assert r["us"] > 0 and r["sdpa_us"] > 0
    md = (tmp_path / "kernels.md").read_text()
    assert "python3 benchmarks/kernels.py --smoke" in md and "| decode | 2 | 64 |" in md
