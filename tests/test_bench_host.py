"""`radixkv bench host` on a small run: every phase reported, identical tokens across repeats,
files in --out."""

import json

from benchmarks.host import PHASES, main


def test_host_bench_small(tmp_path):
    out = tmp_path / "out"
    assert main(["--seqs", "4", "8", "--prompt", "40", "--shared", "32", "--output", "20", "--repeats", "2",
                 "--out", str(out)]) == 0
    result = json.loads((out / "host.json").read_text())
    assert [r["seqs"] for r in result["rows"]] == [4, 8]
    for r in result["rows"]:
        assert set(r["ms"]) == set(PHASES)
        assert r["decode_steps"] > 0 and r["host_ms"] > 0
        assert abs(sum(r["ms"].values()) - r["host_ms"]) < 0.01 * len(PHASES)
    md = (out / "host.md").read_text()
    assert "| 8 |" in md and "python -m benchmarks.host --seqs 4 8" in md
