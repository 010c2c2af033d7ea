"""benchmarks/cache_ops.py on a small trace: files written, hit rate right, eviction runs."""

import json

import pytest

from benchmarks import peer_vllm
from benchmarks.cache_ops import main

SMALL = ["--groups", "4", "--per-group", "6", "--system", "160", "--question", "40", "--decode", "24",
         "--runs", "1", "--no-scaling"]

# vLLM's core imports here (the `peers` extra), or not: each case below runs under one of the two.
PEER_MISSING = peer_vllm.load()[0] is None


@pytest.fixture(scope="module")
def whole_pool(tmp_path_factory):
    """The trace's results with a pool that holds the whole working set."""
    out = tmp_path_factory.mktemp("cache-ops-whole")
    assert main(SMALL + ["--out", str(out), "--pool-frac", "1.0"]) == 0
    return json.loads((out / "cache_ops.json").read_text())["trace"]


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    """(trace results, markdown report) with a pool of 30% of the working set, decoding one token a chunk."""
    out = tmp_path_factory.mktemp("cache-ops-small")
    assert main(SMALL + ["--out", str(out), "--pool-frac", "0.3", "--decode-chunk", "1"]) == 0
    res = json.loads((out / "cache_ops_chunk1.json").read_text())["trace"]
    return res, (out / "cache_ops_chunk1.md").read_text()


def test_a_pool_holding_the_working_set_never_evicts(whole_pool):
    assert whole_pool["evicted_blocks"] == 0


def test_a_pool_holding_the_working_set_hits_ideally(whole_pool):
    # Never evicting, every repeat of a system prompt hits all of its blocks: the hit rate
    # is the ideal one exactly.
    assert whole_pool["hit_rate"] == whole_pool["ideal_hit_rate"] > 0.5


def test_a_small_pool_evicts_and_counts_one_evict_call_per_block(small_pool):
    res, _ = small_pool
    assert res["evicted_blocks"] > 0 and res["ops"]["evict"]["calls"] == res["evicted_blocks"]


def test_one_reserve_per_prompt_and_per_output_token(small_pool):
    res, _ = small_pool
    assert res["ops"]["reserve"]["calls"] == 24 * (1 + 24)  # prompt + one per output token


def test_one_lookup_per_request_from_the_array_too(small_pool):
    res, _ = small_pool
    assert res["phases"]["lookup_from_array"]["calls"] == res["phases"]["lookup"]["calls"] == 24


def test_the_report_has_the_whole_trace_section(small_pool):
    _, md = small_pool
    assert "Whole trace" in md


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """--peer vllm on a smaller trace: (the JSON results, the markdown report)."""
    out = tmp_path_factory.mktemp("cache-ops-peer")
    args = ["--groups", "3", "--per-group", "4", "--system", "96", "--question", "24", "--decode", "16",
            "--runs", "1", "--no-scaling", "--out", str(out), "--peer", "vllm"]
    assert main(args) == 0
    return json.loads((out / "cache_ops_vllm.json").read_text()), (out / "cache_ops_vllm.md").read_text()


@pytest.mark.skipif(PEER_MISSING, reason="vLLM's core does not import here (the peers extra)")
def test_peer_gives_the_same_hits_and_evictions_side_by_side(peer_run):
    """The same trace gives the same hits and evictions in both managers."""
    res, md = peer_run
    assert res["peer"]["hit_tokens"] == res["trace"]["hit_tokens"]
    assert res["peer"]["evicted_blocks"] == res["trace"]["evicted_blocks"]
    assert "Side by side" in md


@pytest.mark.skipif(not PEER_MISSING, reason="vLLM's core imports here: the peer runs")
def test_a_missing_peer_is_a_line_saying_why_and_how_to_install_it(peer_run):
    res, md = peer_run
    assert "error" in res["peer"] and "Peer not run" in md and "--no-deps vllm" in md
