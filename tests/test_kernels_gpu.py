"""Kernels on a real GPU at real shapes (32 query / 8 kv heads, head dim 128), against the
references in float64. Skipped without CUDA."""

import pytest
import torch

from kernels import copy_blocks, paged_attention, store_kv
from kernels.attention_config import AttentionConfig
from kernels.reference import copy_blocks_ref, paged_attention_ref, store_kv_ref
from test_kernels_cases import TOL, assert_close, fresh_seed, make_case, poisoned_out

pytestmark = pytest.mark.gpu
DEV = "cuda"


def check(case, dtype, config=None, what=""):
    out = poisoned_out(case.q)
    paged_attention(*case.args(), scale=case.scale, max_seqlen_q=case.max_seqlen_q, out=out,
                    config=config)
    ref = paged_attention_ref(*case.args(torch.float64), scale=case.scale,
                              max_seqlen_q=case.max_seqlen_q)
    assert_close(out, ref, TOL[dtype], case.seed, what)


# Decodes whose contexts end on / just past block and tile boundaries, prefill chunks with
# an empty prefix, over a cached prefix, and ending exactly on a 4k boundary.
MIXED_N = [1, 1, 1, 1, 1, 1, 300, 257, 64, 1]
MIXED_CTX = [1, 16, 17, 512, 513, 4097, 300, 1257, 4096, 2048]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_real_shape(dtype):
    case = make_case(MIXED_N, MIXED_CTX, block_size=16, kv_heads=8, group=4, head_dim=128,
                     dtype=dtype, device=DEV)
    check(case, dtype, what="mixed")


@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (32, 128), (16, 64)])
def test_block_sizes_and_head_dims(block_size, head_dim):
    case = make_case([1, 130, 1, 33], [700, 130, 64, 1000], block_size=block_size, kv_heads=2,
                     group=4, head_dim=head_dim, dtype=torch.bfloat16, device=DEV)
    check(case, torch.bfloat16, what=f"B={block_size} d={head_dim}")


def test_fp32_ieee():
    case = make_case([1, 40, 1], [300, 90, 33], block_size=16, kv_heads=2, group=4, head_dim=128,
                     dtype=torch.float32, device=DEV)
    check(case, torch.float32, what="fp32")


@pytest.mark.parametrize("batch,ctx", [(2, 8191), (32, 4096), (256, 600)])
def test_decode_default_config(batch, ctx):
    # The default picks split-KV for the small batches; contexts are ragged around ctx.
    lens = torch.randint(max(1, ctx // 2), ctx + 1, (batch,)).tolist()
    lens[0] = ctx
    case = make_case([1] * batch, lens, block_size=16, kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, device=DEV)
    check(case, torch.bfloat16, what=f"decode {batch}x{ctx}")


@pytest.mark.parametrize("splits", [2, 16])
def test_forced_splits_mixed(splits):
    case = make_case(MIXED_N, MIXED_CTX, block_size=16, kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, device=DEV)
    check(case, torch.bfloat16, AttentionConfig(64, 64, 4, 2, splits), what=f"splits={splits}")


def test_store_and_copy_real_shape():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    layers, n, bs, kvh, d = 4, 512, 16, 8, 128
    cache = torch.randn(layers, 2, n, bs, kvh, d, generator=g, device=DEV, dtype=torch.bfloat16)
    expect = cache.clone()
    t = 1000
    slots = torch.randperm(n * bs, device=DEV, generator=g)[:t]
    slots[::7] = -1
    kv = torch.randn(t, 2, kvh, d, generator=g, device=DEV, dtype=torch.bfloat16)
    store_kv(kv[:, 0], kv[:, 1], cache[1, 0], cache[1, 1], slots)
    store_kv_ref(kv[:, 0], kv[:, 1], expect[1, 0], expect[1, 1], slots)
    assert torch.equal(cache, expect)
    perm = torch.randperm(n, device=DEV, generator=g)
    mapping = torch.stack([perm[:100], perm[100:200]], 1)
    copy_blocks(cache, mapping)
    copy_blocks_ref(expect, mapping)
    assert torch.equal(cache, expect)
    host_mapping = torch.stack([perm[200:210], perm[210:220]], 1).cpu()  # as the engine passes it
    copy_blocks(cache, host_mapping)
    copy_blocks_ref(expect, host_mapping)
    assert torch.equal(cache, expect)


def test_no_sync_and_cuda_graph_replay():
    """store_kv + split-KV decode captured in a CUDA graph; replays on new data match the
    reference. Sync-debug mode makes any host sync inside the launches an error."""
    batch, max_ctx, bs, kvh, group, d = 4, 2048, 16, 8, 4, 128
    case = make_case([1] * batch, [max_ctx] * batch, block_size=bs, kv_heads=kvh, group=group,
                     head_dim=d, dtype=torch.bfloat16, device=DEV)
    q, kc, vc, bt, cu, lens = case.args()
    key = torch.empty(batch, kvh, d, device=DEV, dtype=torch.bfloat16)
    value = torch.empty_like(key)
    slots = torch.empty(batch, device=DEV, dtype=torch.int64)
    out = torch.empty_like(q)
    cfg = AttentionConfig(16, 128, 4, 3, num_splits=8)

    def step():
        store_kv(key, value, kc, vc, slots)
        paged_attention(q, kc, vc, bt, cu, lens, scale=case.scale, max_seqlen_q=1, out=out,
                        config=cfg)

    def refill():
        # new contexts, queries and new tokens written at each context's last slot
        new_lens = torch.randint(1, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32)
        lens.copy_(new_lens)
        pos = new_lens.long() - 1
        slots.copy_(bt[torch.arange(batch, device=DEV), pos // bs].long() * bs + pos % bs)
        for t in (q, key, value):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))

    refill()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # compile/warm-up outside the graph; must not sync
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(3):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q.double(), kc.double(), vc.double(), bt, cu, lens,
                                  scale=case.scale, max_seqlen_q=1)
        assert_close(out, ref, TOL[torch.bfloat16], case.seed, "graph replay")
        idx = torch.arange(batch, device=DEV)
        pos = lens.long() - 1
        assert torch.equal(kc[bt[idx, pos // bs].long(), pos % bs], key)
