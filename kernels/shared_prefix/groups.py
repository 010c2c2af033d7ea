"""Prefix groups for shared-prefix decode: which sequences of a batch share which leading
blocks, as flat tensors a kernel can read (see kernels/shared_prefix/decode.py for the API).

A group is one node of the sharing tree: a run of shared physical blocks (a segment) and
the batch rows that hold it. A row may sit in several groups, one per level (system
prompt -> few-shot examples -> conversation); its segments, outermost first, cover its
tokens [0, private_start) and its own block table covers the rest.
"""

from dataclasses import dataclass, replace

import torch

from kernels.checks import check_cache_pair, check_tensor

_I32 = torch.int32


def _fail(name, msg):
    raise ValueError(f"{name}: {msg}")


@dataclass
class PrefixGroups:
    block_tables: torch.Tensor   # [G, max_shared_blocks] int32: each group's segment of blocks
    shared_lens: torch.Tensor    # [G] int32: tokens in each segment
    cu_members: torch.Tensor     # [G + 1] int32: group g's member slots are cu[g]:cu[g+1]
    members: torch.Tensor        # [M] int32: batch row of each member slot
    seq_slots: torch.Tensor      # [B, levels] int32: row b's member slot per level, -1 = none
    private_start: torch.Tensor  # [B] int32: first token of row b's private part
    max_members: int             # host bound on any group's member count (sizes the grid)
    max_shared_len: int          # host bound on shared_lens (picks the KV split)
    saved_tokens: int = 0        # KV tokens per step per layer not re-read: sum (members - 1) * len

    @property
    def num_groups(self) -> int:
        return self.shared_lens.shape[0]

    @property
    def batch(self) -> int:
        return self.private_start.shape[0]

    @property
    def num_levels(self) -> int:
        return self.seq_slots.shape[1]

    def to(self, device, non_blocking=False) -> "PrefixGroups":
        move = {f: getattr(self, f).to(device, non_blocking=non_blocking)
                for f in ("block_tables", "shared_lens", "cu_members", "members", "seq_slots",
                          "private_start")}
        return replace(self, **move)

    def padded(self, *, num_groups, num_members, num_levels, max_members=None,
               max_shared_len=None, batch=None) -> "PrefixGroups":
        """The same sharing in fixed shapes, for a captured CUDA graph: extra groups hold no
        tokens, extra member slots sit in the last extra group and no row names them, extra
        levels are -1; batch (default: this one's) adds rows that share nothing and are private
        from token 0 (a graph's padding rows). Host bounds may only grow. Runs on the tensors'
        device, no sync."""
        g, m, lv, b = self.num_groups, self.members.shape[0], self.num_levels, self.batch
        batch = b if batch is None else batch
        for name, v, lo in (("num_groups", num_groups, g), ("num_members", num_members, m),
                            ("num_levels", num_levels, lv), ("batch", batch, b)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                _fail(name, f"expected an int >= {lo} (the current size), got {v!r}")
        if num_members > m and num_groups == g:
            _fail("num_groups", "padding member slots needs at least one extra (empty) group")
        bounds = {"max_members": (max_members, max(self.max_members, num_members - m)),
                  "max_shared_len": (max_shared_len, self.max_shared_len)}
        for name, (v, lo) in bounds.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                _fail(name, f"expected an int >= {lo}, got {v!r}")
        dev, width = self.shared_lens.device, max(self.block_tables.shape[1], 1)
        tab = torch.zeros((num_groups, width), dtype=_I32, device=dev)
        tab[:g, :self.block_tables.shape[1]] = self.block_tables
        lens = torch.zeros(num_groups, dtype=_I32, device=dev)
        lens[:g] = self.shared_lens
        cu = torch.full((num_groups + 1,), m, dtype=_I32, device=dev)
        cu[:g + 1] = self.cu_members
        cu[-1] = num_members
        members = torch.zeros(num_members, dtype=_I32, device=dev)
        members[:m] = self.members
        slots = torch.full((batch, num_levels), -1, dtype=_I32, device=dev)
        slots[:b, :lv] = self.seq_slots
        pstart = self.private_start
        if batch > b:
            pstart = torch.zeros(batch, dtype=_I32, device=dev)
            pstart[:b] = self.private_start
        return replace(self, block_tables=tab, shared_lens=lens, cu_members=cu, members=members,
                       seq_slots=slots, private_start=pstart,
                       max_members=bounds["max_members"][0] or bounds["max_members"][1],
                       max_shared_len=bounds["max_shared_len"][0] or bounds["max_shared_len"][1])

    @classmethod
    def empty(cls, batch: int, device="cpu") -> "PrefixGroups":
        """No sharing: every row is private from token 0."""
        z = lambda *s: torch.zeros(s, dtype=_I32, device=device)  # noqa: E731
        return cls(z(0, 1), z(0), z(1), z(0), z(batch, 0), z(batch), 0, 0)


def check_groups(groups, *, batch, block_size, num_blocks, device, seq_lens=None):
    """Shapes and dtypes always; values (ranges, consistency) when the tensors are on the CPU."""
    if not isinstance(groups, PrefixGroups):
        _fail("groups", f"expected a PrefixGroups, got {type(groups).__name__}")
    g_tab, lens, cu, mem = groups.block_tables, groups.shared_lens, groups.cu_members, groups.members
    for name in ("block_tables", "seq_slots"):
        check_tensor(f"groups.{name}", getattr(groups, name), ndim=2, dtypes=(_I32,), device=device)
    for name in ("shared_lens", "cu_members", "members", "private_start"):
        check_tensor(f"groups.{name}", getattr(groups, name), ndim=1, dtypes=(_I32,), device=device)
    n_groups = lens.shape[0]
    if g_tab.shape[0] != n_groups or cu.shape[0] != n_groups + 1:
        _fail("groups", f"{n_groups} shared_lens, {g_tab.shape[0]} block_tables rows and "
                        f"{cu.shape[0]} cu_members entries (expected G + 1)")
    if groups.seq_slots.shape[0] != batch or groups.private_start.shape[0] != batch:
        _fail("groups.seq_slots", f"rows {groups.seq_slots.shape[0]} / private_start "
                                  f"{groups.private_start.shape[0]} do not match the batch {batch}")
    if g_tab.stride(1) != 1 or groups.seq_slots.stride(1) != 1:
        _fail("groups", "block_tables and seq_slots must be row-contiguous")
    for name in ("max_members", "max_shared_len"):
        v = getattr(groups, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail(f"groups.{name}", f"expected a non-negative int, got {v!r}")
    if device.type != "cpu":
        return
    cu_l, lens_l = cu.tolist(), lens.tolist()
    sizes = [b - a for a, b in zip(cu_l, cu_l[1:])]
    if cu_l[0] != 0 or cu_l[-1] != mem.shape[0] or (sizes and min(sizes) < 0):
        _fail("groups.cu_members", f"must rise from 0 to {mem.shape[0]} members, got {cu_l}")
    if sizes and max(sizes) > groups.max_members:
        _fail("groups.max_members", f"{groups.max_members} < largest group {max(sizes)}")
    if lens_l and (min(lens_l) < 0 or max(lens_l) > groups.max_shared_len):
        _fail("groups.shared_lens", f"must lie in [0, max_shared_len={groups.max_shared_len}]")
    if lens_l and max(lens_l) > g_tab.shape[1] * block_size:
        _fail("groups.shared_lens", f"a segment exceeds {g_tab.shape[1]} blocks of {block_size}")
    used = torch.arange(g_tab.shape[1]) < (lens.long() + block_size - 1)[:, None] // block_size
    ids = g_tab[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        _fail("groups.block_tables", f"a used entry lies outside [0, {num_blocks})")
    if mem.numel() and (int(mem.min()) < 0 or int(mem.max()) >= batch):
        _fail("groups.members", f"a member lies outside the batch [0, {batch})")
    slots = groups.seq_slots
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= mem.shape[0]):
        _fail("groups.seq_slots", f"entries must lie in [-1, {mem.shape[0]})")
    rows, lvls = torch.nonzero(slots >= 0, as_tuple=True)
    hit = slots[rows, lvls].long()
    named = torch.bincount(hit, minlength=mem.shape[0])
    if (named.numel() and int(named.max()) > 1) or not torch.equal(mem[hit].long(), rows):
        _fail("groups.seq_slots", "must name a member slot at most once, in the row it holds")
    slot_group = torch.repeat_interleave(torch.arange(n_groups), torch.tensor(sizes, dtype=torch.long))
    if bool(((named == 0) & (lens[slot_group] > 0)).any()):  # padding may sit in empty groups
        _fail("groups.seq_slots", "a member slot of a non-empty group is named by no row")
    covered = torch.zeros(batch, dtype=torch.long).index_add_(0, rows, lens[slot_group[hit]].long())
    if not torch.equal(covered, groups.private_start.long()):
        _fail("groups.private_start", "must equal the sum of the row's segment lengths")
    if seq_lens is not None and batch and bool((groups.private_start >= seq_lens).any()):
        _fail("groups.private_start", "must leave at least the newest token private (< seq_lens)")


def check_decode(q, k_cache, v_cache, groups, block_tables, seq_lens, scale, out):
    """Arguments of shared_prefix_decode (one query token per row)."""
    check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    dev = k_cache.device
    check_tensor("q", q, ndim=3, dtypes=(k_cache.dtype,), device=dev)
    if q.shape[2] != head_dim or q.shape[1] % kv_heads or q.stride(-1) != 1:
        _fail("q", f"shape {tuple(q.shape)} needs head_dim {head_dim} (contiguous) and a "
                   f"multiple of {kv_heads} kv heads")
    batch = q.shape[0]
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(_I32,), device=dev)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(_I32,), device=dev)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.shape[0] != batch:
            _fail(name, f"{t.shape[0]} rows for a batch of {batch} queries")
    if block_tables.stride(1) != 1:
        _fail("block_tables", "rows must be contiguous")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        _fail("scale", f"expected a positive float, got {scale!r}")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=dev)
        if out.shape != q.shape or out.stride(-1) != 1:
            _fail("out", f"shape {tuple(out.shape)} must equal q's {tuple(q.shape)}, last dim contiguous")
    check_groups(groups, batch=batch, block_size=block_size, num_blocks=num_blocks, device=dev,
                 seq_lens=seq_lens)
    if dev.type != "cpu" or not batch:
        return
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
        _fail("seq_lens", f"must lie in [1, max_blocks * block_size = "
                          f"{block_tables.shape[1] * block_size}]")
    cols = torch.arange(block_tables.shape[1])
    lo = groups.private_start.long() // block_size
    hi = (seq_lens.long() + block_size - 1) // block_size
    ids = block_tables[(cols >= lo[:, None]) & (cols < hi[:, None])]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        _fail("block_tables", f"a used entry lies outside [0, {num_blocks})")
