"""`radixkv bench cpu` end to end on the tiny model: HF generate and radixkv, same prompts, same answers."""

import json


def test_bench_cpu_writes_its_report(tiny_llama_dir, tmp_path):
    import torch

    from radixkv.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "cpu"
    assert main(["bench", "cpu", "--model", str(tiny_llama_dir), "--chats", "5", "--answer-tokens", "6",
                 "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the benchmark's thread count does not leak
    result = json.loads((out / "cpu.json").read_text())
    assert result["threads"] == 1 and "--threads 1" in result["command"]
    rows = {r["workload"]: r for r in result["rows"]}
    assert set(rows) == {"one_chat", "shared_chats"} and rows["shared_chats"]["chats"] == 5
    for r in rows.values():
        # greedy on both sides from the same prompts: the same answers, token for token
        assert r["answers_equal"] == r["chats"]
        assert r["hf"]["output_tokens"] == r["radixkv"]["output_tokens"] > 0
        assert r["x_hf"] > 0 and r["hf"]["seconds"] > 0
    # the chats after the first find the shared system prompt cached
    assert rows["shared_chats"]["radixkv"]["cached_prompt_tokens"] >= 4 * 16
    md = (out / "cpu.md").read_text()
    assert "| shared_chats | 5 |" in md and "radixkv bench cpu" in md
    assert (out / "cpu.png").stat().st_size > 1000
