"""benchmarks/shared_prefix.py runs end to end (tiny shapes, Triton interpreter on the CPU) and
writes its table; its timings are only meaningful on a GPU."""

import json

import pytest
import torch


def test_shared_prefix_benchmark_smoke(tmp_path):
    if torch.cuda.is_available():  # the real run is the GPU benchmark itself
        pytest.skip("on a GPU, run the benchmark itself")
    from benchmarks import shared_prefix as bench

    bench.main(["--smoke", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "shared_prefix.json").read_text())
    names = [r["name"] for r in res["rows"]]
    assert names[0] == "shared 2048 + 128" and "unshared control" in names
    for r in res["rows"]:
        assert r["rel_err_vs_plain"] < 1e-3, r  # both paths: fp32 math in the interpreter, bf16 out
        assert r["us"] > 0 and r["plain_us"] > 0
    head = res["rows"][0]
    # bf16 K/V and output against an fp32 reference: within bf16 rounding
    assert head["groups"] == 1 and head["levels"] == 1 and head["rel_err_vs_fp32_ref"] < 1e-2
    md = (tmp_path / "shared_prefix.md").read_text()
    assert "| shared 2048 + 128 | 4 |" in md
