"""Online-softmax steps over paged K/V and the log-sum-exp merge of partial results, shared
by the shared-prefix decode programs (kernels/shared_prefix/triton.py).

Partial results are (o, lse): o normalised over its part of the context, lse the
log2-sum-exp2 of that part's scaled scores (-inf when the part is empty). Merging
partials by lse gives exactly the softmax over the union of the parts.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_step(q, acc, m_i, l_i, k_ptr, v_ptr, table, tok, end, own, kvh,
                 stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, qk_scale,
                 BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT: tl.constexpr, MASKED: tl.constexpr, OWN: tl.constexpr):
    """One online-softmax step of the rows of q over the keys at positions tok [N] (table:
    the block-id pointer of each key's sequence, or one for all). MASKED: keys at or past
    end are dropped (else all are live, and the loads stay unpredicated); OWN: the score
    mask own [M, N] says which keys each query row may see."""
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED:
        n_ok = tok < end
        blk = tl.load(table + tok // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(table + tok // BLOCK_SIZE).to(tl.int64)
    off = (tok % BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ko + kvh * stride_kh
    v_ptrs = v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vo + kvh * stride_vh
    if MASKED:
        kv_mask = n_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        v = tl.load(v_ptrs + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0).to(DOT)
        v = tl.load(v_ptrs + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0).to(DOT)
    else:
        k = tl.load(k_ptrs + offs_d[None, :]).to(DOT)
        v = tl.load(v_ptrs + offs_d[None, :]).to(DOT)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if OWN:
        if MASKED:
            s = tl.where(own & n_ok[None, :], s, float("-inf"))
        else:
            s = tl.where(own, s, float("-inf"))
    elif MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row that has seen no live key yet keeps m = -inf: avoid (-inf) - (-inf)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
    return acc, m_new, l_i


@triton.jit
def _attend(q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, start, end, kvh,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, qk_scale,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            HEAD_DIM: tl.constexpr, DOT: tl.constexpr):
    """Online softmax of the rows of q [M, D] (DOT dtype) over tokens [start, end) of the
    paged sequence whose block ids start at table_ptr; exp2 domain (qk_scale has log2 e).
    Full tiles first, unmasked; then the partial last tile, if any."""
    offs_n = tl.arange(0, BLOCK_N)
    end = tl.maximum(end, start)  # a split past a short segment's end is empty
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for t0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_step(q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, t0 + offs_n, end, 0,
                                     kvh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                                     stride_vh, qk_scale, BLOCK_SIZE, BLOCK_D, HEAD_DIM, DOT,
                                     False, False)
    for t0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_step(q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, t0 + offs_n, end, 0,
                                     kvh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                                     stride_vh, qk_scale, BLOCK_SIZE, BLOCK_D, HEAD_DIM, DOT,
                                     True, False)
    return acc, m_i, l_i


@triton.jit
def _merge(acc, m_i, l_i, o_p, lse_p):
    """Fold a normalised partial (o_p, lse_p) into the running (acc, m, l); -inf safe."""
    m_new = tl.maximum(m_i, lse_p)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    beta = tl.exp2(lse_p - m_safe)
    return acc * alpha[:, None] + o_p * beta[:, None], m_new, l_i * alpha + beta


@triton.jit
def _finish(acc, m_i, l_i):
    """Running state -> (normalised o, lse); an empty part gives (0, -inf)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    return acc / l_safe[:, None], lse
