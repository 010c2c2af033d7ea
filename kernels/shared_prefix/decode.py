"""Shared-prefix (cascade) decode attention: a KV block shared by many sequences is read
once per step for all of them, not once per sequence.

API
---
    from kernels.shared_prefix import derive_groups, shared_prefix_decode, shared_prefix_decode_ref

    groups = derive_groups(block_tables, seq_lens, block_size=16, min_shared_blocks=8,
                           max_levels=4, device="cuda")        # host side, each step (see below)
    out = shared_prefix_decode(q, k_cache, v_cache, groups, block_tables, seq_lens, *,
                               scale, out=None, max_private_len=None, config=None)

- q [B, H, d]: one decode query per sequence; k_cache / v_cache [num_blocks, block_size,
  kv_heads, d]; block_tables [B, max_blocks] int32 (each row the sequence's whole table);
  seq_lens [B] int32, context including the new token (as in kernels.paged_attention).
- groups (PrefixGroups, kernels/shared_prefix/groups.py): the sharing tree as tensors.
  A group is a segment of shared blocks (block_tables [G, max_shared_blocks], shared_lens
  [G] tokens) and its member rows (members [M], CSR by cu_members [G + 1]). Row b holds
  one member slot per level (seq_slots [B, levels], -1 = none; levels nest: system prompt
  -> few-shot -> conversation); its segments cover tokens [0, private_start[b]) and its own
  table covers the private rest [private_start[b], seq_lens[b]). PrefixGroups.empty(B) =
  no sharing (plain paged decode). Host ints max_members / max_shared_len size the grid.
- Result: softmax(q K^T * scale) V over each row's whole context, exactly as plain paged
  attention over the row's own table would give when the segments hold the same KV.

How: a shared program, one per (group x tile of members, kv head, KV split), loads each
shared K/V tile once and runs it against members x q-per-kv query rows with tl.dot,
writing a partial output and log-sum-exp (lse) per row. A private program, one per (kv
head, a few rows), attends to the rows' private parts (each step gathers keys of every
row; a block-diagonal mask keeps rows apart). Both kinds run in one launch, so the shared
ones (bound by tensor cores) and the private ones (bound by bandwidth) share the SMs; a
second launch merges the partials by lse. Config streams=True runs them as two kernels on
two streams instead; overlap=False runs the shared programs first and lets the private
ones merge. No host sync: CUDA-graph capturable (a side stream forks from and joins the caller's)
for fixed shapes and host ints; groups.padded(num_groups=, num_members=, num_levels=,
max_members=, max_shared_len=) gives any batch's groups the shapes of a captured graph.

derive_groups runs on the CPU tables: ~0.7-0.9 ms for 256 rows x 136 blocks given a
tensor (lists of ids cost ~2 ms more to convert). Groups stay valid as long as the batch
holds the same rows in the same order (decode only appends private tokens), so they need
recomputing only when the batch changes. When sharing pays, in measurements on an H200
(benchmarks/results/shared_prefix.md): groups.saved_tokens >= ~64k per layer gave >= 1.3x
over the plain paged kernel; a small batch (16 rows) was slower; with no groups call the
plain kernel.
"""

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from kernels.attention_config import num_sms
from kernels.runtime import ensure_runnable, next_pow2
from kernels.shared_prefix.groups import check_decode
from kernels.shared_prefix.triton import _cascade_kernel, _combine_kernel

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in partials than it gains


@dataclass(frozen=True)
class SharedPrefixConfig:
    # Defaults: the fastest of a sweep on an H200 (benchmarks/results/shared_prefix.md).
    block_m: int = 128           # shared tile rows: members x q-per-kv, padded (power of 2, >= 16)
    block_n: int = 64            # shared KV tokens per loop step (power of 2, >= 16)
    num_warps: int = 4
    num_stages: int = 2
    shared_split_len: int = 1024  # shared KV tokens per program; 0: enough splits to fill the GPU
    private_block_n: int = 128   # private KV tokens per loop step (all rows of a program)
    private_split_len: int = 0   # private KV tokens per program; 0: split only small batches
    private_num_warps: int = 4
    private_rows: int = 0        # batch rows per private program; 0: from the private length
    # With shared work, run the shared programs (tensor-core bound) next to the private ones
    # (bandwidth bound) and merge both in a second launch; False: shared, then private
    # programs that merge the shared partials themselves.
    overlap: bool = True
    streams: bool = False        # overlap as two kernels on two streams, not one launch

    def validate(self):
        for name in ("block_m", "block_n", "private_block_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"config.{name}: must be a power of two >= 16, got {v!r}")
        for name in ("shared_split_len", "private_split_len", "num_stages", "private_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (name == "num_stages"):
                raise ValueError(f"config.{name}: expected a non-negative int, got {v!r}")
        for name in ("num_warps", "private_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"config.{name}: expected 1, 2, 4, 8 or 16, got "
                                 f"{getattr(self, name)!r}")
        if self.private_rows & (self.private_rows - 1) or self.private_rows > self.private_block_n:
            raise ValueError(f"config.private_rows: 0 or a power of two <= private_block_n, got "
                             f"{self.private_rows!r}")
        for name in ("overlap", "streams"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config.{name}: expected a bool, got {getattr(self, name)!r}")


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int):
    return torch.cuda.Stream(device=device_index)


def _cdiv(a, b):
    return -(-a // b)


def _splits(length, fixed, tile, programs, sms):
    """(splits, tokens per split, a multiple of tile) over `length` tokens: `fixed` tokens per
    split if given, else enough splits for ~2 programs per SM, each >= MIN_SPLIT_TOKENS."""
    if fixed:
        n = _cdiv(length, _cdiv(fixed, tile) * tile)
    else:
        n = min(_cdiv(2 * sms, max(programs, 1)), length // MIN_SPLIT_TOKENS)
    n = max(1, min(MAX_SPLITS, n))
    per = max(tile, _cdiv(_cdiv(length, n), tile) * tile)
    return _cdiv(length, per), per


def shared_prefix_decode(q, k_cache, v_cache, groups, block_tables, seq_lens, *, scale, out=None,
                         max_private_len=None, config=None):
    """See the module docstring. max_private_len: host hint of the longest private part
    (seq_lens - private_start) that sizes the private split; default: the table's capacity.
    A hint that falls short stays correct (the last split runs to the end), only slower."""
    check_decode(q, k_cache, v_cache, groups, block_tables, seq_lens, scale, out)
    cfg = config or SharedPrefixConfig()
    if not isinstance(cfg, SharedPrefixConfig):
        raise ValueError(f"config: expected a SharedPrefixConfig, got {type(cfg).__name__}")
    cfg.validate()
    if q.dtype == torch.float64:
        raise ValueError("q: float64 is reference-only; use shared_prefix_decode_ref")
    ensure_runnable("shared_prefix_decode", _cascade_kernel, q.device)
    out = torch.empty_like(q) if out is None else out
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if batch == 0:
        return out
    qpk, dev, sms = num_heads // kv_heads, q.device, num_sms(q.device)
    block_d = max(16, next_pow2(head_dim))
    # The interpreter computes bf16 wrongly: it gets fp32 operands. On the GPU the dots take
    # the cache's own dtype (tensor cores) and accumulate in fp32.
    dot = tl.float32 if dev.type == "cpu" or q.dtype == torch.float32 else \
        (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    qk_scale = float(scale) * LOG2E
    n_members, levels = groups.members.shape[0], groups.num_levels
    shared = groups.num_groups > 0 and n_members > 0 and groups.max_shared_len > 0
    block_m = max(cfg.block_m, next_pow2(qpk))
    tile_members = block_m // qpk
    tiles = _cdiv(groups.max_members, tile_members)
    s_splits, s_len = 1, 1
    if shared:
        s_splits, s_len = _splits(groups.max_shared_len, cfg.shared_split_len, cfg.block_n,
                                  groups.num_groups * tiles * kv_heads, sms)
    if max_private_len is not None and (isinstance(max_private_len, bool)
                                        or not isinstance(max_private_len, int) or max_private_len < 1):
        raise ValueError(f"max_private_len: expected a positive int, got {max_private_len!r}")
    bound = block_tables.shape[1] * block_size if max_private_len is None else max_private_len
    # Auto: about 8 steps of private_block_n keys per program (rows x private length), up to
    # 32 tile rows and at least one key per row and step. Measured on an H200: 128-token
    # private parts ran fastest with 8 rows of 4 heads (75.6 us against 88.8 with one row);
    # 640+ tokens with one row (304.8 against 398.8 us at 2,176). Without a hint the bound is
    # the table's capacity: one row.
    auto_rows = min(32 // qpk, cfg.private_block_n, cfg.private_block_n * 8 // bound)
    p_rows = cfg.private_rows or 1 << (max(1, auto_rows).bit_length() - 1)
    p_tiles = _cdiv(batch, p_rows)
    p_splits, p_len = _splits(max(bound, 1), cfg.private_split_len, cfg.private_block_n,
                              p_tiles * kv_heads, sms)
    overlap = shared and cfg.overlap
    fuse = p_splits == 1 and not overlap  # the private programs merge the shared partials
    # Partials, fp32: shared [split, member slot, head, d] and lse; private [split, row, head, d].
    po = torch.empty((s_splits, max(n_members, 1), num_heads, head_dim), dtype=torch.float32,
                     device=dev)
    plse = torch.empty((s_splits, max(n_members, 1), num_heads), dtype=torch.float32, device=dev)
    shape = (p_splits, batch, num_heads) if not fuse else (1, 1, 1)
    xo = torch.empty(shape + (head_dim,), dtype=torch.float32, device=dev)
    xlse = torch.empty(shape, dtype=torch.float32, device=dev)
    slots = groups.seq_slots if levels else groups.private_start  # not read when levels == 0
    n_shared = groups.num_groups * tiles * kv_heads * s_splits if shared else 0
    n_private = kv_heads * p_tiles * p_splits

    def launch(first, count, with_shared, with_private, num_warps):
        _cascade_kernel[(count,)](
            q, k_cache, v_cache, groups.block_tables, groups.shared_lens, groups.cu_members,
            groups.members, block_tables, seq_lens, groups.private_start, slots, po, plse, out,
            xo, xlse, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            groups.block_tables.stride(0), block_tables.stride(0), slots.stride(0),
            *po.stride()[:3], *plse.stride()[:2], out.stride(0), out.stride(1),
            *xo.stride()[:3], *xlse.stride()[:2], qk_scale, s_len, p_len, batch, first, n_shared,
            groups.num_groups * tiles, kv_heads, s_splits, p_tiles, p_splits,
            SHARED=with_shared, PRIVATE=with_private, TILES=tiles, QPK=qpk,
            TILE_MEMBERS=tile_members, BLOCK_M=block_m, S_BLOCK_N=cfg.block_n, ROWS=p_rows,
            BLOCK_H=max(16, next_pow2(p_rows * qpk)), P_BLOCK_N=cfg.private_block_n,
            BLOCK_D=block_d, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, DOT=dot, LEVELS=levels,
            SHARED_SPLITS=s_splits, FUSE=fuse, num_warps=num_warps, num_stages=cfg.num_stages)

    if overlap and not cfg.streams:  # one launch: both kinds of program share the GPU
        launch(0, n_shared + n_private, True, True, cfg.num_warps)
    else:
        side = main = None
        if overlap and dev.type == "cuda":  # fork: the side stream starts after all inputs
            main, side = torch.cuda.current_stream(dev), _side_stream(dev.index)
            side.wait_stream(main)
        if shared:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                launch(0, n_shared, True, False, cfg.num_warps)
        launch(n_shared, n_private, False, True, cfg.private_num_warps)
        if side is not None:  # join before the merge reads the shared partials
            main.wait_stream(side)
    if not fuse:
        _combine_kernel[(batch,)](
            slots, po, plse, xo, xlse, out, slots.stride(0), *po.stride()[:3], *plse.stride()[:2],
            *xo.stride()[:3], *xlse.stride()[:2], out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, BLOCK_H=max(16, next_pow2(num_heads)), BLOCK_D=block_d,
            HEAD_DIM=head_dim, LEVELS=levels, SHARED_SPLITS=s_splits, PRIVATE_SPLITS=p_splits, num_warps=4)
    return out


def shared_prefix_decode_ref(q, k_cache, v_cache, groups, block_tables, seq_lens, *, scale,
                             out=None, max_private_len=None, config=None):
    """Pure torch, same signature: each row's context is its groups' segments (in level
    order) followed by its private tokens; plain softmax attention over that context."""
    check_decode(q, k_cache, v_cache, groups, block_tables, seq_lens, scale, out)
    out = torch.empty_like(q) if out is None else out
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    cpu = groups.to("cpu")
    cu, lens = cpu.cu_members.tolist(), cpu.shared_lens.tolist()
    group_of = {slot: g for g in range(len(lens)) for slot in range(cu[g], cu[g + 1])}

    def gather(table, lo, hi):
        blocks = table[lo // block_size: _cdiv(hi, block_size)].long()
        skip = lo - lo // block_size * block_size
        return (k_cache[blocks].flatten(0, 1)[skip: skip + hi - lo],
                v_cache[blocks].flatten(0, 1)[skip: skip + hi - lo])

    for b, ctx in enumerate(seq_lens.tolist()):
        parts = [gather(cpu.block_tables[group_of[s]], 0, lens[group_of[s]])
                 for s in cpu.seq_slots[b].tolist() if s >= 0]
        parts.append(gather(block_tables[b], int(cpu.private_start[b]), ctx))
        k = torch.cat([p[0] for p in parts])
        v = torch.cat([p[1] for p in parts])
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qb = q[b].to(acc).view(kv_heads, -1, q.shape[-1])            # [kvh, qpk, d]
        p = torch.softmax(torch.einsum("kgd,lkd->kgl", qb, k.to(acc)) * scale, dim=-1)
        out[b] = torch.einsum("kgl,lkd->kgd", p, v.to(acc)).reshape(q.shape[1:]).to(out.dtype)
    return out
