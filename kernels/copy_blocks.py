"""Copy-on-write block copies: every (src, dst) pair, every layer's K and V, one launch."""

import torch
import triton
import triton.language as tl

from kernels.checks import check_copy_blocks
from kernels.runtime import ensure_runnable

_CHUNK = 2048  # elements moved per loop step: 4 KB of bf16 per program iteration


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, mapping_ptr,
    stride_l, stride_kv, stride_n,
    KV_PLANES: tl.constexpr,  # 2: K and V
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    # Grid: (pair, layer * 2 + k/v). Each program moves one contiguous block.
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1)
    layer = (plane // KV_PLANES).to(tl.int64)
    kv = (plane % KV_PLANES).to(tl.int64)
    src = tl.load(mapping_ptr + pair * 2)
    dst = tl.load(mapping_ptr + pair * 2 + 1)
    base = layer * stride_l + kv * stride_kv
    src_ptr = cache_ptr + base + src * stride_n
    dst_ptr = cache_ptr + base + dst * stride_n
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_blocks(kv_cache, block_mapping):
    """kv_cache [L, 2, N, B, kv_heads, d]; block_mapping [n, 2] int64 rows (src, dst).
    Destinations must be distinct and no destination may be a source: the copies run
    concurrently. A CPU mapping is checked on the host, then uploaded without blocking."""
    check_copy_blocks(kv_cache, block_mapping)
    if kv_cache.dtype == torch.float64:
        raise ValueError("kv_cache: float64 is reference-only; use kernels.reference.copy_blocks_ref")
    ensure_runnable("copy_blocks", _copy_blocks_kernel, kv_cache.device)
    n = block_mapping.shape[0]
    if n == 0:
        return
    mapping = block_mapping.contiguous()
    if mapping.device != kv_cache.device:
        # Through pinned memory the upload is truly asynchronous: no wait on the GPU stream.
        if mapping.device.type == "cpu" and kv_cache.device.type == "cuda":
            mapping = mapping.pin_memory()
        mapping = mapping.to(kv_cache.device, non_blocking=True)
    layers = kv_cache.shape[0]
    block_numel = kv_cache[0, 0, 0].numel()
    _copy_blocks_kernel[(n, layers * 2)](
        kv_cache, mapping,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        KV_PLANES=2, BLOCK_NUMEL=block_numel, CHUNK=min(_CHUNK, triton.next_power_of_2(block_numel)),
        num_warps=4,
    )
