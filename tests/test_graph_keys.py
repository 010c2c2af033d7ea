"""benchmarks/graph_keys.py: the shared-prefix graph shapes a workload meets, on the CPU."""

from benchmarks.graph_keys import measure


def test_counts_the_shared_graph_shapes_of_a_workload(tiny_llama_dir, one_torch_thread):
    # 64 rows in 4 groups of 16 sharing 2,048 tokens skip 4 x 15 x 2,048 = 122,880 KV reads per
    # layer (>= the 64k threshold): batch 64, groups bucket 4, 2 splits of 1,024 shared tokens.
    r = measure(str(tiny_llama_dir), groups=4, per_group=16, prefix=2048, question=128, output=8,
                max_num_seqs=64)
    assert r["decode_steps"] == r["plain_graph_steps"] + r["shared_graph_steps"]
    assert r["shared_graph_steps"] >= 5
    assert r["steps_by_shape"] == {"(64, 4, 2)": r["shared_graph_steps"]}
    assert r["shapes_captured_while_serving"] == [(64, 4, 2)]  # not among the start-up shapes
    assert 1 <= r["group_derivations"] <= r["decode_steps"]
