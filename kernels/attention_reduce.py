"""Merge split-KV partials (flash-decoding's second step) by log-sum-exp."""

import triton
import triton.language as tl

from kernels.runtime import next_pow2


@triton.jit
def _merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (token, head). Partials hold unnormalised acc and (m, l) in log2 units.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (t * NUM_HEADS + h) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_ml_ptr + (row + s) * 2)
    l = tl.load(part_ml_ptr + (row + s) * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
    denom = tl.sum(w * l, 0)
    dmask = d < HEAD_DIM
    acc = tl.load(part_acc_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=dmask[None, :],
                  other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def merge_splits(part_acc, part_ml, out):
    """part_acc [T, H, S, d] fp32, part_ml [T, H, S, 2] fp32 (m, l) -> out [T, H, d]."""
    num_tokens, num_heads, splits, head_dim = part_acc.shape
    assert splits & (splits - 1) == 0, "the reduce tiles the splits as a power of two"
    _merge_kernel[(num_tokens, num_heads)](
        part_acc, part_ml, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=splits, HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim), num_warps=4,
    )
