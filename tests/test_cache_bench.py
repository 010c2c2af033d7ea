"""benchmarks/cache_ops.py on a small trace: files written, hit rate right, eviction runs."""

import json

from benchmarks.cache_ops import main


def test_cache_ops_small_trace(tmp_path):
    small = ["--groups", "4", "--per-group", "6", "--system", "160", "--question", "40", "--decode", "24",
             "--runs", "1", "--no-scaling", "--out", str(tmp_path)]
    assert main(small + ["--pool-frac", "1.0"]) == 0
    res = json.loads((tmp_path / "cache_ops.json").read_text())["trace"]
    # A pool that holds the whole working set never evicts, so every repeat of a system
    # prompt hits all of its blocks: the hit rate is the ideal one exactly.
    assert res["evicted_blocks"] == 0 and res["hit_rate"] == res["ideal_hit_rate"] > 0.5
    assert main(small + ["--pool-frac", "0.3", "--decode-chunk", "1"]) == 0
    res = json.loads((tmp_path / "cache_ops_chunk1.json").read_text())["trace"]
    assert res["evicted_blocks"] > 0 and res["ops"]["evict"]["calls"] == res["evicted_blocks"]
    assert res["ops"]["reserve"]["calls"] == 24 * (1 + 24)  # prompt + one per output token
    assert "Whole trace" in (tmp_path / "cache_ops_chunk1.md").read_text()
    assert res["phases"]["lookup_from_array"]["calls"] == res["phases"]["lookup"]["calls"] == 24


def test_cache_ops_peer_side_by_side(tmp_path):
    """--peer vllm: the peer's row when its core imports here, else a line saying why not."""
    from benchmarks import peer_vllm

    small = ["--groups", "3", "--per-group", "4", "--system", "96", "--question", "24", "--decode", "16",
             "--runs", "1", "--no-scaling", "--out", str(tmp_path), "--peer", "vllm"]
    assert main(small) == 0
    res = json.loads((tmp_path / "cache_ops_vllm.json").read_text())
    md = (tmp_path / "cache_ops_vllm.md").read_text()
    if peer_vllm.load()[0] is None:
        assert "error" in res["peer"] and "Peer not run" in md and "--no-deps vllm" in md
    else:  # the same trace gives the same hits and evictions in both managers
        assert res["peer"]["hit_tokens"] == res["trace"]["hit_tokens"]
        assert res["peer"]["evicted_blocks"] == res["trace"]["evicted_blocks"]
        assert "Side by side" in md
