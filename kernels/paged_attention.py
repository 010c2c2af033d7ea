"""Paged attention: one launch for a mixed batch of prefill chunks and decodes.

A program owns a tile of BLOCK_M rows = BLOCK_Q query tokens x the GROUP query heads
that share one kv head (GQA/MQA), so each K/V tile is read once for the whole group.
Keys and values are gathered BLOCK_N tokens at a time through the block table (several
paged blocks per iteration keeps enough bytes in flight); prefill tiles look their block
ids up one iteration early, so the software pipeliner keeps K/V tiles in flight. Tiles
that every row may see run without masks; only the tiles on the causal diagonal (or the
context end) are masked.
With NUM_SPLITS > 1 the context is cut into splits whose unnormalised partials a second
launch merges (flash-decoding), for decode batches too small to fill the GPU.
"""

import torch
import triton
import triton.language as tl

from kernels.attention_config import AttentionConfig, default_config
from kernels.attention_reduce import merge_splits
from kernels.checks import check_attention
from kernels.runtime import ensure_runnable, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i owns q-block programs [cu[i] // BLOCK_Q + i, ...): an upper bound of its
    # ceil(n_i / BLOCK_Q) blocks that needs no host sync. Find the last i starting <= pid.
    lo = pid * 0  # tensors from the start: loop-carried values keep one type
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(acc, l_i, m_i, q, qk_scale, k_ptr, v_ptr, blk, start, hi, q_pos,
                 offs_n, offs_d, kv_head_off, stride_kb, stride_ko,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASKED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # blk: the paged block id of each of the tile's BLOCK_N tokens; q_pos read only if MASKED
    n = start + offs_n
    if MASKED:
        n_ok = n < hi
    kv_off = blk.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ko + kv_head_off
    ptrs = kv_off[:, None] + offs_d[None, :]
    if MASKED:
        if BLOCK_D != HEAD_DIM:
            lmask = n_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        else:
            lmask = n_ok[:, None]
        k = tl.load(k_ptr + ptrs, mask=lmask, other=0.0)
        v = tl.load(v_ptr + ptrs, mask=lmask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptr + ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptr + ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptr + ptrs)
        v = tl.load(v_ptr + ptrs)
    if UPCAST:  # the interpreter's bf16 arithmetic is wrong: compute in fp32
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        ok = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
    # Log2 units, qk_scale = scale * log2(e) > 0: scaling the row max equals the max of the
    # scaled row, and the scale folds into one FMA with the max subtraction below.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:  # a row with nothing visible yet keeps m = -inf; avoid (-inf) - (-inf)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_ptr, lens_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ko, stride_kh, stride_bt,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_DECODE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    # Axis 0 walks kv heads fastest and q-blocks from the last: the heaviest q-blocks
    # (longest causal range) of every head start first, the light ones fill the tail.
    lin = tl.program_id(0)
    kv_head = lin % KV_HEADS
    pid = tl.num_programs(0) // KV_HEADS - 1 - lin // KV_HEADS
    split = tl.program_id(1)
    if IS_DECODE:  # at most one query per sequence: program i is sequence i
        seq = pid
        q_block = 0
    else:
        seq = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
        q_block = pid - (tl.load(cu_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(cu_ptr + seq)
    n_q = tl.load(cu_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= n_q:
        return
    ctx = tl.load(lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    if BLOCK_Q * GROUP == BLOCK_M:
        row_ok = tok < n_q
    else:  # rows past the last whole group are padding
        row_ok = (tok < n_q) & (rows < BLOCK_Q * GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_D != HEAD_DIM:
        io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    else:
        io_mask = row_ok[:, None]
    # 256-row tiles sit at the register limit, so keep few tile-sized values alive: 64 bits
    # only in the chunk's base pointer (in-chunk offsets fit 32, checked on the host), and
    # rows past the chunk's end read its last token (never stored) instead of a load mask.
    q_rows = q_ptr + q_start.to(tl.int64) * stride_qt
    q_tok = tl.minimum(tok, n_q - 1)
    if BLOCK_D != HEAD_DIM:
        q = tl.load(q_rows + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        q = tl.load(q_rows + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :])
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [0, kv_end) matter to this tile; keys [0, full_end) are visible to every row.
    kv_end = tl.minimum(ctx, ctx - n_q + (q_block + 1) * BLOCK_Q)
    full_end = ctx - n_q + q_block * BLOCK_Q + 1
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(kv_end, lo + per_split)
    else:
        lo = 0
        hi = kv_end
    mid = tl.maximum(lo, lo + (tl.minimum(hi, full_end) - lo) // BLOCK_N * BLOCK_N)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if IS_DECODE:  # many light programs per SM hide the table load's latency
        for start in range(lo, mid, BLOCK_N):
            blk = tl.load(bt_row + (start + offs_n) // BLOCK_SIZE)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, qk_scale, k_ptr, v_ptr, blk, start, hi, tok,
                                         offs_n, offs_d, kv_head_off, stride_kb, stride_ko,
                                         BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, UPCAST, IEEE)
    else:
        # Block ids one tile ahead: K/V addresses then wait on no load of the same
        # iteration, and the pipeliner keeps num_stages - 1 tiles in flight instead of one.
        nxt = lo + offs_n
        blk_next = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < mid, other=0)
        for start in range(lo, mid, BLOCK_N):
            blk = blk_next
            nxt = start + BLOCK_N + offs_n
            blk_next = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < mid, other=0)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, qk_scale, k_ptr, v_ptr, blk, start, hi, tok,
                                         offs_n, offs_d, kv_head_off, stride_kb, stride_ko,
                                         BLOCK_SIZE, HEAD_DIM, BLOCK_D, False, UPCAST, IEEE)
    q_pos = ctx - n_q + tok  # only the masked tiles need positions: not live in the loop above
    for start in range(mid, hi, BLOCK_N):
        n = start + offs_n
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n < hi, other=0)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, qk_scale, k_ptr, v_ptr, blk, start, hi, q_pos,
                                     offs_n, offs_d, kv_head_off, stride_kb, stride_ko,
                                     BLOCK_SIZE, HEAD_DIM, BLOCK_D, True, UPCAST, IEEE)

    if NUM_SPLITS > 1:
        # Unnormalised partials; an empty split writes m = -inf, l = 0, acc = 0.
        prow = ((q_start + tok).to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = out_ptr + q_start.to(tl.int64) * stride_ot
        tl.store(out_rows + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, scale,
                    max_seqlen_q, out=None, config: AttentionConfig | None = None):
    """Causal attention of flattened query chunks q [T, H, d] over the paged cache.

    Sequence i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1], the last positions of
    its seq_lens[i]-token context. max_seqlen_q (a host int) must bound every chunk; when it
    is 1 the decode path (and split-KV if the batch is small) is taken. `config` overrides
    the tile shapes (benchmarks, tests). No host sync; CUDA-graph capturable.
    """
    check_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                    max_seqlen_q, out)
    if q.dtype == torch.float64:
        raise ValueError("q: float64 is reference-only; use kernels.reference.paged_attention_ref")
    ensure_runnable("paged_attention", _paged_attention_kernel, q.device)
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    group = num_heads // kv_heads
    is_decode = max_seqlen_q == 1
    if config is None:
        config = default_config(q.device, num_seqs=num_seqs, kv_heads=kv_heads, group=group,
                                head_dim=head_dim, max_seqlen_q=max_seqlen_q,
                                max_context=block_tables.shape[1] * block_size, is_decode=is_decode,
                                dtype=q.dtype)
    config.validate(group)
    block_q = 1 if is_decode else config.block_m // group
    grid_m = num_seqs if is_decode else num_tokens // block_q + num_seqs
    splits = config.num_splits
    if splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    interp = q.device.type == "cpu"
    _paged_attention_kernel[(grid_m * kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, part_acc, part_ml,
        float(scale) * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, NUM_SPLITS=splits, IS_DECODE=is_decode,
        UPCAST=interp and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        merge_splits(part_acc, part_ml, out)
    return out


def attention_flops(n_q: int, ctx: int, num_heads: int, head_dim: int) -> int:
    """FLOPs of causal attention of n_q queries that end a ctx-token context (QK^T and PV)."""
    visible = n_q * (ctx - n_q) + n_q * (n_q + 1) // 2
    return 4 * visible * num_heads * head_dim

