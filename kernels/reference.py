"""Pure-torch references of every kernel: same signatures, same semantics.

They are the ground truth in tests and the attention backend on the CPU. They loop
over sequences on the host, so they synchronise freely; the Triton versions never do.
Arithmetic runs in float32 (float64 for float64 inputs) and results are cast back.
"""

import torch

from kernels.checks import check_attention, check_copy_blocks, check_store_kv


def store_kv_ref(key, value, k_cache, v_cache, slot_mapping):
    """Write key/value [T, kv_heads, d] of new tokens into the slots slot_mapping [T] names
    (slot = block_id * block_size + offset); a negative slot skips its token."""
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_blocks, block_size = k_cache.shape[:2]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = key[keep]
    v_cache[blk, off] = value[keep]


def copy_blocks_ref(kv_cache, block_mapping):
    """For every (src, dst) row of block_mapping [n, 2], copy block src to block dst in
    every layer's K and V of kv_cache [L, 2, N, B, kv_heads, d]."""
    check_copy_blocks(kv_cache, block_mapping)
    if block_mapping.numel() == 0:
        return
    m = block_mapping.to(kv_cache.device)
    kv_cache[:, :, m[:, 1]] = kv_cache[:, :, m[:, 0]]


def _attend_one(q, k, v, scale):
    """q [n, H, d], k/v [L, kvh, d] -> [n, H, d]; query row r sits at position L - n + r."""
    n, num_heads, d = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    group = num_heads // kv_heads
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(acc).view(n, kv_heads, group, d)
    s = torch.einsum("nkgd,lkd->kgnl", qf, k.to(acc)) * scale
    q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    allowed = torch.arange(ctx, device=q.device)[None, :] <= q_pos
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("kgnl,lkd->nkgd", p, v.to(acc))
    return o.reshape(n, num_heads, d)


def paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *,
                        scale, max_seqlen_q, out=None):
    """Causal attention of flattened query chunks over paged K/V.

    q [T, H, d]; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1], which are the
    last positions of its context of seq_lens[i] tokens (prefix + chunk); its token at
    position p lives in block block_tables[i, p // B] at offset p % B.
    """
    check_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                    max_seqlen_q, out)
    if out is None:
        out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, ctx in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        nb = -(-ctx // block_size)
        blocks = block_tables[i, :nb].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        out[lo:hi] = _attend_one(q[lo:hi], k, v, scale).to(out.dtype)
    return out
