"""Shared-prefix decode on a real GPU at real shapes (32 query / 8 kv heads, head dim 128,
block size 16), against the torch reference and the plain paged kernel. Skipped without CUDA."""

import random

import pytest
import torch

from kernels import paged_attention
from kernels.shared_prefix import derive_groups, shared_prefix_decode, shared_prefix_decode_ref
from test_kernels_cases import assert_close, fresh_seed, poisoned_out
from test_shared_prefix_cases import make_problem, tree_batch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def problem(batch, level_blocks, fanout, private_tokens, dtype, seed):
    rows, lens, num_blocks = tree_batch(random.Random(seed), batch, level_blocks=level_blocks,
                                        fanout=fanout, private_tokens=private_tokens, block_size=16)
    p = make_problem(rows, lens, block_size=16, num_blocks=num_blocks, kv_heads=8, qpk=4,
                     head_dim=128, dtype=dtype, device=DEV, seed=seed)
    groups = derive_groups(p.block_tables.cpu(), p.seq_lens.cpu(), block_size=16,
                           min_shared_blocks=4, device=DEV)
    return p, groups


def check(p, groups, tol):
    out = poisoned_out(p.q)
    shared_prefix_decode(p.q, p.k_cache, p.v_cache, groups, p.block_tables, p.seq_lens,
                         scale=p.scale, out=out)
    ref = shared_prefix_decode_ref(p.q.float(), p.k_cache.float(), p.v_cache.float(), groups,
                                   p.block_tables, p.seq_lens, scale=p.scale)
    assert_close(out, ref, tol, p.seed, "shared-prefix vs reference")
    plain = paged_attention(p.q, p.k_cache, p.v_cache, p.block_tables,
                            torch.arange(p.q.shape[0] + 1, dtype=torch.int32, device=DEV),
                            p.seq_lens, scale=p.scale, max_seqlen_q=1)
    assert_close(out, plain, tol, p.seed, "shared-prefix vs plain paged kernel")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shared_prompt_real_shape(dtype):
    seed = fresh_seed()
    p, groups = problem(96, [128], [1], (1, 300), dtype, seed)
    assert groups.num_groups == 1 and groups.max_members == 96
    check(p, groups, 1e-2)


def test_tree_real_shape():
    # system prompt -> 3 few-shot sets -> pairs -> private; fp32 runs the dots in TF32
    seed = fresh_seed()
    p, groups = problem(60, [64, 32, 8], [1, 3, 10], (1, 200), torch.float32, seed)
    assert groups.num_levels == 3
    check(p, groups, 3e-3)


def test_cuda_graph_replay_without_host_sync():
    seed = fresh_seed()
    p, groups = problem(64, [64, 16], [1, 4], (1, 100), torch.bfloat16, seed)
    out = torch.empty_like(p.q)
    args = (p.q, p.k_cache, p.v_cache, groups, p.block_tables, p.seq_lens)
    run = lambda: shared_prefix_decode(*args, scale=p.scale, out=out,  # noqa: E731
                                       max_private_len=100)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    p.q.copy_(torch.randn_like(p.q))
    graph.replay()
    torch.cuda.synchronize()
    eager = shared_prefix_decode(*args, scale=p.scale, max_private_len=100)
    assert torch.equal(out, eager), "graph replay differs from an eager call"
