"""Write the K and V of new tokens into their paged-cache slots."""

import torch
import triton
import triton.language as tl

from kernels.checks import check_store_kv
from kernels.runtime import ensure_runnable, next_pow2


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,  # cache strides: block, offset in block, head
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token, all its heads at once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = blk * stride_cb + off * stride_co + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping):
    """key/value [T, kv_heads, d] -> k_cache/v_cache [N, B, kv_heads, d] at slot_mapping [T]
    (slot = block_id * B + offset; negative = skip). No host sync; graph capturable."""
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    if key.dtype == torch.float64:
        raise ValueError("key: float64 is reference-only; use kernels.reference.store_kv_ref")
    ensure_runnable("store_kv", _store_kv_kernel, key.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, kv_heads, head_dim = k_cache.shape
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4,
    )
