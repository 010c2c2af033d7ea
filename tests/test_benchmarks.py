"""Workload generators and the memory report, at tiny sizes, on the real cache manager."""

import json

import pytest

from benchmarks import workloads as wl
from benchmarks.memory import measure, to_markdown


def test_generators_are_seeded_and_documented_shapes():
    a = wl.all_workloads(scale=0.05, seed=1)
    b = wl.all_workloads(scale=0.05, seed=1)
    c = wl.all_workloads(scale=0.05, seed=2)
    assert [r.prompt for w in a for r in w.requests] == [r.prompt for w in b for r in w.requests]
    assert [r.prompt for w in a for r in w.requests] != [r.prompt for w in c for r in w.requests]
    names = [w.name for w in a]
    assert len(set(names)) == len(names) == 11
    for w in a:
        assert w.requests and all(w.requests[i].prompt for i in range(len(w.requests)))
        assert all(min(r.prompt + r.output) >= wl.FIRST_ID and max(r.prompt + r.output) < 2048 for r in w.requests)


def test_shared_prompt_workloads_share_exactly_the_system_prompt():
    w = wl.shared_chats(num_chats=8, system_len=100, question_len=10, answer_len=20, seed=0)
    assert all(r.prompt[:100] == w.requests[0].prompt[:100] for r in w.requests)
    assert len({tuple(r.prompt[100:]) for r in w.requests}) == 8
    g = wl.generated_shared_prefix(groups=3, per_group=4, system_len=50, question_len=8, output_len=5, seed=0)
    assert len({tuple(r.prompt[:50]) for r in g.requests}) == 3
    assert all(len(r.output) == 5 for r in g.requests)
    m = wl.multi_turn(num_conversations=2, turns=3, system_len=20, message_len=6, answer_len=5, seed=0)
    first, later = m.requests[0], m.requests[2]  # conversation 0, turns 1 and 2
    assert later.prompt[: len(first.prompt) + len(first.output)] == first.prompt + first.output


def test_memory_report_shapes():
    shared = measure(wl.shared_chats(16, 160, 16, 40, seed=0), 16)
    unique = measure(wl.unique(16, 176, 40, seed=0), 16)
    assert shared.hit_rate > 0.5 and unique.hit_rate == 0
    assert shared.saving_vs_paged > 0.4 and unique.saving_vs_paged == 0
    assert shared.fit_shared > shared.fit_paged > shared.fit_contiguous
    ps = [measure(wl.parallel_sampling(n, 8, short=True, seed=0), 16).saving_vs_paged for n in (2, 6)]
    bs = [measure(wl.beam_search(k, 8, short=True, seed=0), 16).saving_vs_paged for k in (2, 6)]
    assert 0 < ps[0] < ps[1] and 0 < bs[0] < bs[1]
    assert bs[0] > ps[0], "beams share output history too, so they must save more than parallel samples"
    assert "| shared_chats | 16 |" in to_markdown([shared])


@pytest.mark.parametrize("block_size", [8, 128])
def test_slot_utilisation_falls_with_block_size(block_size):
    r = measure(wl.unique(8, 300, 50, seed=3), block_size)
    assert 0 < r.slot_utilisation <= 1
    assert r.last_block_slack < block_size


def test_cli_writes_json_and_markdown(tmp_path):
    from radixkv.cli import main

    assert main(["bench", "memory", "--scale", "0.02", "--out", str(tmp_path), "--no-plot"]) == 0
    rows = json.loads((tmp_path / "memory.json").read_text())
    assert {r["block_size"] for r in rows} == {8, 16, 32, 128}
    assert "Memory accounting" in (tmp_path / "memory.md").read_text()


def test_one_copy_of_the_shared_system_prompt():
    # One group, equal lengths: all 12 requests are live at the peak; the 160-token (10-block)
    # system prompt must be held once, so sharing saves exactly 11 copies of it.
    w = wl.generated_shared_prefix(groups=1, per_group=12, system_len=160, question_len=20, output_len=30, seed=0)
    r = measure(w, 16)
    assert r.peak_paged_blocks - r.peak_shared_blocks == 11 * 10


def test_throughput_roofline_matches_the_design_figures():
    # DESIGN section 7: 256 x (1,024 shared + 128) prompts, 128 outputs, Llama-3-8B shape, at
    # 760 TFLOP/s and 4.27 TB/s: ~2.4 s when every sequence reads the prefix, ~1.4 s when it is read once.
    from benchmarks.throughput import LLAMA3_8B, make_requests, roofline

    r = roofline(LLAMA3_8B, make_requests(256, 1024, 128, 128256, 0), 128,
                 {"copy_bytes_per_s": 4.27e12, "matmul_flops_per_s": 760e12}, 1024)
    assert r["prefill_tokens"] == 1024 + 256 * 128
    assert 2.4 * 0.9 < r["floor_s"] < 2.4 * 1.1
    assert 1.4 * 0.85 < r["floor_shared_once_s"] < 1.4 * 1.1
