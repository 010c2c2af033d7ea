"""Triton kernels of shared-prefix decode (host side: kernels/shared_prefix.py).

Partial results are (o, lse): o normalised over its part of the context, lse the
log2-sum-exp2 of that part's scaled scores (-inf when the part is empty). Merging
partials by lse gives exactly the softmax over the union of the parts.
"""

import triton
import triton.language as tl


@triton.jit
def _attend(q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, start, end, kvh,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, qk_scale,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            HEAD_DIM: tl.constexpr, DOT: tl.constexpr):
    """Online softmax of the rows of q [M, D] (DOT dtype) over tokens [start, end) of the
    paged sequence whose block ids start at table_ptr; exp2 domain (qk_scale has log2 e)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        n_ok = tok < end
        blk = tl.load(table_ptr + tok // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = (tok % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ko + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile holds >= 1 live token: finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vo + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
        m_i = m_new
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


@triton.jit
def _shared_kernel(
    q_ptr, k_ptr, v_ptr, g_tab_ptr, g_len_ptr, cu_ptr, members_ptr, po_ptr, plse_ptr,
    stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_gt, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
    qk_scale, split_len,
    TILES: tl.constexpr, QPK: tl.constexpr, TILE_MEMBERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr,
):
    # Grid (group x member tile, kv head, KV split): the tile's members x QPK query heads
    # share every K/V load of the group's segment.
    g = tl.program_id(0) // TILES
    first = tl.load(cu_ptr + g) + (tl.program_id(0) % TILES) * TILE_MEMBERS
    last = tl.load(cu_ptr + g + 1)
    if first >= last:
        return
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    slot = first + rows // QPK
    row_ok = (rows < TILE_MEMBERS * QPK) & (slot < last)
    head = kvh * QPK + rows % QPK
    seq = tl.load(members_ptr + slot, mask=row_ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    start = split * split_len
    g_len = tl.load(g_len_ptr + g)
    # The last split runs to the end: a host bound that fell short costs balance, not tokens.
    end = tl.where(split == tl.num_programs(2) - 1, g_len, tl.minimum(start + split_len, g_len))
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, g_tab_ptr + g.to(tl.int64) * stride_gt,
                            start, end, kvh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                            stride_vh, qk_scale, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, DOT)
    o, lse = _finish(acc, m_i, l_i)
    slot64 = slot.to(tl.int64)
    tl.store(po_ptr + split * stride_pos + slot64[:, None] * stride_pom + head[:, None] * stride_poh
             + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(plse_ptr + split * stride_pls + slot64 * stride_plm + head, lse, mask=row_ok)


@triton.jit
def _fold_shared(acc, m_i, l_i, b, head, row_ok, offs_d, d_ok, slots_ptr, stride_ss,
                 po_ptr, plse_ptr, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
                 LEVELS: tl.constexpr, SPLITS: tl.constexpr):
    """Merge row b's shared partials (every level, every split) into the running state."""
    for lvl in range(LEVELS):
        slot = tl.load(slots_ptr + b * stride_ss + lvl).to(tl.int64)
        ok = row_ok & (slot >= 0)
        for s in range(SPLITS):
            lse_p = tl.load(plse_ptr + s * stride_pls + slot * stride_plm + head, mask=ok,
                            other=float("-inf"))
            o_p = tl.load(po_ptr + s * stride_pos + slot * stride_pom + head[:, None] * stride_poh
                          + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc, m_i, l_i = _merge(acc, m_i, l_i, o_p, lse_p)
    return acc, m_i, l_i


@triton.jit
def _private_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, pstart_ptr, slots_ptr,
    po_ptr, plse_ptr, out_ptr, xo_ptr, xlse_ptr,
    stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_tb, stride_ss, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
    stride_ob, stride_oh, stride_xos, stride_xob, stride_xoh, stride_xls, stride_xlb,
    qk_scale, split_len,
    QPK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr,
    LEVELS: tl.constexpr, SHARED_SPLITS: tl.constexpr, FUSE: tl.constexpr,
):
    # Grid (kv head, row, KV split of the private part): a row's kv heads run side by side,
    # so together they read whole tokens. FUSE (one split): fold in the shared partials and
    # write the output; else write a partial for _combine_kernel.
    kvh = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < QPK
    head = kvh * QPK + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    start = tl.load(pstart_ptr + b) + split * split_len
    seq_len = tl.load(lens_ptr + b)
    end = tl.where(split == tl.num_programs(2) - 1, seq_len, tl.minimum(start + split_len, seq_len))
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, tables_ptr + b * stride_tb, start, end,
                            kvh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                            qk_scale, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, DOT)
    mask = row_ok[:, None] & d_ok[None, :]
    if FUSE:
        acc, m_i, l_i = _fold_shared(acc, m_i, l_i, b, head, row_ok, offs_d, d_ok, slots_ptr,
                                     stride_ss, po_ptr, plse_ptr, stride_pos, stride_pom,
                                     stride_poh, stride_pls, stride_plm, LEVELS, SHARED_SPLITS)
        o, _ = _finish(acc, m_i, l_i)
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        o, lse = _finish(acc, m_i, l_i)
        tl.store(xo_ptr + split * stride_xos + b * stride_xob + head[:, None] * stride_xoh
                 + offs_d[None, :], o, mask=mask)
        tl.store(xlse_ptr + split * stride_xls + b * stride_xlb + head, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    slots_ptr, po_ptr, plse_ptr, xo_ptr, xlse_ptr, out_ptr,
    stride_ss, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
    stride_xos, stride_xob, stride_xoh, stride_xls, stride_xlb, stride_ob, stride_oh,
    QPK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    LEVELS: tl.constexpr, SHARED_SPLITS: tl.constexpr, PRIVATE_SPLITS: tl.constexpr,
):
    # Grid (kv head, row): merge the private splits' and the shared partials.
    b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < QPK
    head = tl.program_id(0) * QPK + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(PRIVATE_SPLITS):
        lse_p = tl.load(xlse_ptr + s * stride_xls + b * stride_xlb + head, mask=row_ok,
                        other=float("-inf"))
        o_p = tl.load(xo_ptr + s * stride_xos + b * stride_xob + head[:, None] * stride_xoh
                      + offs_d[None, :], mask=mask, other=0.0)
        acc, m_i, l_i = _merge(acc, m_i, l_i, o_p, lse_p)
    acc, m_i, l_i = _fold_shared(acc, m_i, l_i, b, head, row_ok, offs_d, d_ok, slots_ptr,
                                 stride_ss, po_ptr, plse_ptr, stride_pos, stride_pom, stride_poh,
                                 stride_pls, stride_plm, LEVELS, SHARED_SPLITS)
    o, _ = _finish(acc, m_i, l_i)
    tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)
