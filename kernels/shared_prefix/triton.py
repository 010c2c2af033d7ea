"""Triton kernels of shared-prefix decode (host side: kernels/shared_prefix/decode.py): the shared
and private programs, the launch that holds both, and the merge of their partials.
"""

import triton
import triton.language as tl

from kernels.shared_prefix.softmax import _attend, _attend_step, _finish, _merge


@triton.jit
def _shared_program(
    gt, kvh, split, last_split, q_ptr, k_ptr, v_ptr, g_tab_ptr, g_len_ptr, cu_ptr, members_ptr,
    po_ptr, plse_ptr, stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
    stride_vh, stride_gt, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm, qk_scale,
    split_len, TILES: tl.constexpr, QPK: tl.constexpr, TILE_MEMBERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr,
):
    # Program (group x member tile gt, kv head, KV split): the tile's members x QPK query
    # heads share every K/V load of the group's segment.
    g = gt // TILES
    first = tl.load(cu_ptr + g) + (gt % TILES) * TILE_MEMBERS
    last = tl.load(cu_ptr + g + 1)
    if first < last:  # a padded tile past the group's members does nothing
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
        end = tl.where(split == last_split, g_len, tl.minimum(start + split_len, g_len))
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, g_tab_ptr + g.to(tl.int64) * stride_gt,
                                start, end, kvh, stride_kb, stride_ko, stride_kh, stride_vb,
                                stride_vo, stride_vh, qk_scale, BLOCK_SIZE, BLOCK_N, BLOCK_D,
                                HEAD_DIM, DOT)
        o, lse = _finish(acc, m_i, l_i)
        slot64 = slot.to(tl.int64)
        tl.store(po_ptr + split * stride_pos + slot64[:, None] * stride_pom
                 + head[:, None] * stride_poh + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(plse_ptr + split * stride_pls + slot64 * stride_plm + head, lse, mask=row_ok)


@triton.jit
def _fold_shared(acc, m_i, l_i, b, head, row_ok, offs_d, d_ok, slots_ptr, stride_ss,
                 po_ptr, plse_ptr, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
                 LEVELS: tl.constexpr, SPLITS: tl.constexpr):
    """Merge the shared partials (every level, every split) of each tile row's batch row
    b [M] into the running state."""
    for lvl in range(LEVELS):
        slot = tl.load(slots_ptr + b * stride_ss + lvl, mask=row_ok, other=-1).to(tl.int64)
        ok = row_ok & (slot >= 0)
        for s in range(SPLITS):
            lse_p = tl.load(plse_ptr + s * stride_pls + slot * stride_plm + head, mask=ok,
                            other=float("-inf"))
            o_p = tl.load(po_ptr + s * stride_pos + slot[:, None] * stride_pom
                          + head[:, None] * stride_poh + offs_d[None, :],
                          mask=ok[:, None] & d_ok[None, :], other=0.0)
            acc, m_i, l_i = _merge(acc, m_i, l_i, o_p, lse_p)
    return acc, m_i, l_i


@triton.jit
def _private_program(
    kvh, tile, split, last_split, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, pstart_ptr, slots_ptr,
    po_ptr, plse_ptr, out_ptr, xo_ptr, xlse_ptr,
    stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_tb, stride_ss, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
    stride_ob, stride_oh, stride_xos, stride_xob, stride_xoh, stride_xls, stride_xlb,
    qk_scale, split_len, batch,
    QPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr,
    LEVELS: tl.constexpr, SHARED_SPLITS: tl.constexpr, FUSE: tl.constexpr,
):
    # Program (kv head, tile of ROWS batch rows, KV split of the private part). Private parts
    # are short, so one row per program would be all ramp (q, table and first K/V loads);
    # ROWS rows share a program instead: each step gathers BLOCK_N / ROWS keys of every row
    # and a block-diagonal mask keeps each query row to its own keys. The tile's rows are
    # ROWS x QPK query heads. FUSE (one split): fold in the shared partials and write the
    # output; else write a partial for _combine_kernel.
    KPR: tl.constexpr = BLOCK_N // ROWS  # keys per row per step
    rows = tl.arange(0, BLOCK_H)
    b = tile.to(tl.int64) * ROWS + rows // QPK
    row_ok = (rows < ROWS * QPK) & (b < batch)
    head = kvh * QPK + rows % QPK
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    # Per key lane: its row (r_key) and that row's private range [lo, hi) of this split.
    offs_n = tl.arange(0, BLOCK_N)
    r_key = offs_n // KPR
    b_key = tile.to(tl.int64) * ROWS + r_key
    key_row_ok = b_key < batch
    lo = tl.load(pstart_ptr + b_key, mask=key_row_ok, other=0) + split * split_len
    seq_len = tl.load(lens_ptr + b_key, mask=key_row_ok, other=0)
    last = split == last_split  # the last split runs to the end (short host hint)
    hi = tl.where(last, seq_len, tl.minimum(lo + split_len, seq_len))
    hi = tl.where(key_row_ok, tl.maximum(hi, lo), lo)  # a split past a row's end is empty
    # Steps where every row of the tile still has KPR live keys run unmasked.
    full_steps = tl.min(hi - lo, 0) // KPR
    steps = tl.cdiv(tl.max(hi - lo, 0), KPR)
    table_key = tables_ptr + b_key * stride_tb
    own = (rows // QPK)[:, None] == r_key[None, :]  # query row x key lane of the same row
    lane = offs_n % KPR
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for step in range(0, full_steps):
        acc, m_i, l_i = _attend_step(q, acc, m_i, l_i, k_ptr, v_ptr, table_key, lo + step * KPR + lane,
                                     hi, own, kvh, stride_kb, stride_ko, stride_kh, stride_vb,
                                     stride_vo, stride_vh, qk_scale, BLOCK_SIZE, BLOCK_D, HEAD_DIM,
                                     DOT, False, True)
    for step in range(full_steps, steps):
        acc, m_i, l_i = _attend_step(q, acc, m_i, l_i, k_ptr, v_ptr, table_key, lo + step * KPR + lane,
                                     hi, own, kvh, stride_kb, stride_ko, stride_kh, stride_vb,
                                     stride_vo, stride_vh, qk_scale, BLOCK_SIZE, BLOCK_D, HEAD_DIM,
                                     DOT, True, True)
    mask = row_ok[:, None] & d_ok[None, :]
    if FUSE:
        acc, m_i, l_i = _fold_shared(acc, m_i, l_i, b, head, row_ok, offs_d, d_ok, slots_ptr,
                                     stride_ss, po_ptr, plse_ptr, stride_pos, stride_pom,
                                     stride_poh, stride_pls, stride_plm, LEVELS, SHARED_SPLITS)
        o, _ = _finish(acc, m_i, l_i)
        tl.store(out_ptr + b[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        o, lse = _finish(acc, m_i, l_i)
        tl.store(xo_ptr + split * stride_xos + b[:, None] * stride_xob + head[:, None] * stride_xoh
                 + offs_d[None, :], o, mask=mask)
        tl.store(xlse_ptr + split * stride_xls + b * stride_xlb + head, lse, mask=row_ok)


@triton.jit
def _cascade_kernel(
    q_ptr, k_ptr, v_ptr, g_tab_ptr, g_len_ptr, cu_ptr, members_ptr, tables_ptr, lens_ptr,
    pstart_ptr, slots_ptr, po_ptr, plse_ptr, out_ptr, xo_ptr, xlse_ptr,
    stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_gt, stride_tb, stride_ss, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
    stride_ob, stride_oh, stride_xos, stride_xob, stride_xoh, stride_xls, stride_xlb,
    qk_scale, s_split_len, p_split_len, batch, first_program, n_shared, group_tiles, kv_heads,
    s_splits, p_tiles, p_splits,
    SHARED: tl.constexpr, PRIVATE: tl.constexpr, TILES: tl.constexpr, QPK: tl.constexpr,
    TILE_MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr, S_BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, P_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr, LEVELS: tl.constexpr,
    SHARED_SPLITS: tl.constexpr, FUSE: tl.constexpr,
):
    # One 1-D grid numbers the shared programs [0, n_shared) and then the private ones; a
    # launch runs programs [first_program, first_program + grid). Launched together, the
    # shared programs (tensor-core bound) start first and the private ones (bandwidth
    # bound) fill the rest of the GPU and take over as they finish; SHARED / PRIVATE
    # compile only the half a launch runs.
    pid = tl.program_id(0) + first_program
    if pid < n_shared:
        if SHARED:
            _shared_program(pid % group_tiles, (pid // group_tiles) % kv_heads,
                            pid // (group_tiles * kv_heads), s_splits - 1,
                            q_ptr, k_ptr, v_ptr, g_tab_ptr, g_len_ptr, cu_ptr, members_ptr, po_ptr,
                            plse_ptr, stride_qb, stride_qh, stride_kb, stride_ko, stride_kh,
                            stride_vb, stride_vo, stride_vh, stride_gt, stride_pos, stride_pom,
                            stride_poh, stride_pls, stride_plm, qk_scale, s_split_len,
                            TILES, QPK, TILE_MEMBERS, BLOCK_M, S_BLOCK_N, BLOCK_D, HEAD_DIM,
                            BLOCK_SIZE, DOT)
    else:
        if PRIVATE:
            p = pid - n_shared  # kv heads fastest: a row tile's heads read whole tokens together
            _private_program(p % kv_heads, (p // kv_heads) % p_tiles, p // (kv_heads * p_tiles),
                             p_splits - 1, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, pstart_ptr,
                             slots_ptr, po_ptr, plse_ptr, out_ptr, xo_ptr, xlse_ptr,
                             stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb,
                             stride_vo, stride_vh, stride_tb, stride_ss, stride_pos, stride_pom,
                             stride_poh, stride_pls, stride_plm, stride_ob, stride_oh, stride_xos,
                             stride_xob, stride_xoh, stride_xls, stride_xlb, qk_scale, p_split_len,
                             batch, QPK, ROWS, BLOCK_H, P_BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE,
                             DOT, LEVELS, SHARED_SPLITS, FUSE)


@triton.jit
def _combine_kernel(
    slots_ptr, po_ptr, plse_ptr, xo_ptr, xlse_ptr, out_ptr,
    stride_ss, stride_pos, stride_pom, stride_poh, stride_pls, stride_plm,
    stride_xos, stride_xob, stride_xoh, stride_xls, stride_xlb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    LEVELS: tl.constexpr, SHARED_SPLITS: tl.constexpr, PRIVATE_SPLITS: tl.constexpr,
):
    # Grid (row,): merge the private splits' and the shared partials of every head of a row.
    head = tl.arange(0, BLOCK_H)
    b = tl.program_id(0).to(tl.int64) + head * 0
    row_ok = head < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(PRIVATE_SPLITS):
        lse_p = tl.load(xlse_ptr + s * stride_xls + b * stride_xlb + head, mask=row_ok,
                        other=float("-inf"))
        o_p = tl.load(xo_ptr + s * stride_xos + b[:, None] * stride_xob + head[:, None] * stride_xoh
                      + offs_d[None, :], mask=mask, other=0.0)
        acc, m_i, l_i = _merge(acc, m_i, l_i, o_p, lse_p)
    acc, m_i, l_i = _fold_shared(acc, m_i, l_i, b, head, row_ok, offs_d, d_ok, slots_ptr,
                                 stride_ss, po_ptr, plse_ptr, stride_pos, stride_pom, stride_poh,
                                 stride_pls, stride_plm, LEVELS, SHARED_SPLITS)
    o, _ = _finish(acc, m_i, l_i)
    tl.store(out_ptr + b[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)
