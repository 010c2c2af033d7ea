"""Shared-prefix (cascade) decode in the engine: the prefix groups of the running decode batch,
the CUDA-graph shape a batch replays, and the groups padded to that shape.

The kernels (kernels/shared_prefix/) read each shared segment once per group; this module
decides when a batch uses them:

  PrefixGroupCache  the groups of the decode batch, derived again only when its rows change
  GraphKey          a decode graph's shape (batch, groups, splits); a plain graph has no groups
  shared_graph_key  which shape a batch with these groups replays (None: the plain graph)
  pad_groups        the groups in a graph's fixed shapes (PrefixGroups.padded's layout)
  GraphGroups       the static group inputs that the shared-prefix graphs read

A graph's groups are padded to fixed shapes: up to `groups` groups (bucketed) + 1 padding
group holding the unused member slots, LEVELS levels, LEVELS member slots per row, and
`splits` KV splits of SPLIT_LEN shared tokens (bucketed; the last split runs to the end, so
a longer segment stays correct).
"""

from __future__ import annotations

import bisect
import time
from typing import NamedTuple

import numpy as np
import torch

from kernels.shared_prefix import PrefixGroups, SharedPrefixConfig, derive_groups

GROUP_BUCKETS = (1, 4, 16, 64)  # shared graphs exist for up to this many groups (bucketed)
SPLIT_BUCKETS = (1, 2, 4, 8)  # KV splits of the shared segments (bucketed)
# A graph's host bound max_shared_len = splits x SPLIT_LEN makes the kernel split at exactly
# `splits`: the graph's split length is the kernel's own default, never a copy of it.
SPLIT_LEN = SharedPrefixConfig().shared_split_len
LEVELS = 2  # sharing levels per row (system prompt -> few-shot examples)
MAX_SHARED_GRAPHS = 48  # beyond this many shapes, batches fall back to the plain graphs
MIN_SHARED_BATCH = 64  # smaller decode batches replay the plain graphs


class PrefixGroupCache:
    """Prefix groups (kernels/shared_prefix/) of the running decode batch.

    Deriving them from the block tables costs ~1 ms for 256 rows, and they stay valid while the
    batch holds the same sequences in the same order: decoding only appends private tokens,
    and blocks a group shares are committed, so no table entry under them changes. So they are
    derived again only when the batch's sequence ids change. Returns None when sharing would
    not pay (fewer than `min_saved_tokens` KV tokens per layer not re-read).
    """

    def __init__(self, block_size: int, min_saved_tokens: int, *, min_shared_blocks: int = 8,
                 max_levels: int = LEVELS, device=None):
        self.block_size, self.min_saved_tokens = block_size, min_saved_tokens
        self.min_shared_blocks, self.max_levels = min_shared_blocks, max_levels
        self.device = device
        self._key: tuple | None = None
        self._groups = self._on_device = None
        self.num_derived = 0  # how often groups were derived, and the host seconds it took
        self.derive_seconds = 0.0

    def get(self, seq_ids: tuple, block_tables: np.ndarray, seq_lens: np.ndarray):
        """(groups on the CPU, the same on `device`) for a decode batch, or (None, None)."""
        if seq_ids != self._key:
            t = time.perf_counter()
            groups = derive_groups(torch.from_numpy(block_tables), torch.from_numpy(seq_lens),
                                   block_size=self.block_size, min_shared_blocks=self.min_shared_blocks,
                                   max_levels=self.max_levels)
            self.num_derived += 1
            self.derive_seconds += time.perf_counter() - t
            self._key = seq_ids
            if groups.num_groups and groups.saved_tokens >= max(1, self.min_saved_tokens):
                self._groups = groups
                self._on_device = groups if self.device is None else groups.to(self.device, non_blocking=True)
            else:
                self._groups = self._on_device = None
        return self._groups, self._on_device

    @property
    def current(self):
        """The CPU groups of the last batch asked about (None: it does not share enough)."""
        return self._groups

    def clear(self) -> None:
        self._key = None
        self._groups = self._on_device = None


def max_private_len(groups: PrefixGroups, seq_lens: np.ndarray) -> int:
    """Host bound on the rows' private parts (seq_lens - private_start): sizes the kernel's
    private split without reading device memory."""
    return int((seq_lens - groups.private_start.numpy()).max())


class GraphKey(NamedTuple):
    """The shape of a decode graph. groups == 0: the plain graph (paged attention)."""

    batch: int
    groups: int = 0  # bucketed group count, not counting the padding group
    splits: int = 0  # bucketed KV splits of the shared segments

    # NOTE: a NamedTuple, not a frozen dataclass: immutable and hashable alike, and the
    # benchmarks' reports (benchmarks/graph_keys.py) list shapes as plain (batch, groups,
    # splits) tuples, which a key equals and prints as.
    __repr__ = tuple.__repr__

    @property
    def shared(self) -> bool:
        return self.groups > 0


def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def shared_graph_key(n: int, groups, sizes: list[int], min_shared_batch: int, max_blocks: int) -> GraphKey | None:
    """The shared-prefix graph that a decode batch of n rows with these (CPU) groups replays
    (sizes: the captured batch sizes), or None when it takes the plain graph."""
    bs = sizes[bisect.bisect_left(sizes, n)]
    if groups is None or bs < min_shared_batch or groups.num_levels > LEVELS:
        return None
    g = _bucket(groups.num_groups, GROUP_BUCKETS)
    if g is None or groups.block_tables.shape[1] > max_blocks:
        return None
    splits = _bucket(-(-groups.max_shared_len // SPLIT_LEN), SPLIT_BUCKETS) or SPLIT_BUCKETS[-1]
    return GraphKey(bs, g, splits)


def start_up_shared_keys(sizes: list[int], min_shared_batch: int) -> list[GraphKey]:
    """The shared-prefix graph shapes captured at start, largest first: one group and one
    split for every size from min_shared_batch up, and the largest size with every split
    count (the split count is the one shape the kernels compile for: every variant compiles
    at start, not inside a served step)."""
    if sizes[-1] < min_shared_batch:
        return []
    keys = [GraphKey(bs, GROUP_BUCKETS[0], SPLIT_BUCKETS[0]) for bs in reversed(sizes) if bs >= min_shared_batch]
    return keys + [GraphKey(sizes[-1], GROUP_BUCKETS[0], s) for s in SPLIT_BUCKETS[1:]]


def pad_groups(groups: PrefixGroups, n: int, bs: int, num_groups: int) -> dict[str, np.ndarray]:
    """The fields of `groups` (CPU, a batch of n rows) but its block tables, padded for a graph
    of bs rows, num_groups groups + 1 padding group and LEVELS * bs member slots: extra groups
    are empty, the last holds the unused member slots (no row names them), extra levels and
    padding rows are -1, padding rows private. One padding: PrefixGroups.padded's."""
    assert groups.batch == n and groups.num_levels <= LEVELS and groups.num_groups <= num_groups
    p = groups.padded(num_groups=num_groups + 1, num_members=LEVELS * bs, num_levels=LEVELS, batch=bs)
    return {name: getattr(p, name).numpy()
            for name in ("shared_lens", "cu_members", "members", "seq_slots", "private_start")}


class GraphGroups:
    """The static prefix-group inputs of the shared-prefix decode graphs, sized for the
    largest key; each graph reads a prefix of them. Their "no sharing" content is all zeros
    (what the start-up captures run on)."""

    def __init__(self, max_batch: int, max_blocks: int, device):
        kw = dict(dtype=torch.int32, device=device)
        g = GROUP_BUCKETS[-1] + 1  # + the padding group that holds unused member slots
        self.max_batch = max_batch
        self.block_tables = torch.zeros(g, max_blocks, **kw)
        self.shared_lens = torch.zeros(g, **kw)
        self.cu_members = torch.zeros(g + 1, **kw)
        self.members = torch.zeros(LEVELS * max_batch, **kw)
        self.seq_slots = torch.full((max_batch, LEVELS), -1, **kw)
        self.private_start = torch.zeros(max_batch, **kw)

    def view(self, key: GraphKey) -> PrefixGroups:
        """The groups a graph of this shape attends with."""
        bs, g = key.batch, key.groups
        return PrefixGroups(
            block_tables=self.block_tables[: g + 1], shared_lens=self.shared_lens[: g + 1],
            cu_members=self.cu_members[: g + 2], members=self.members[: LEVELS * bs],
            seq_slots=self.seq_slots[:bs], private_start=self.private_start[:bs],
            # host bounds that size the grid: every member slot of the batch sizes, and the splits
            max_members=LEVELS * self.max_batch, max_shared_len=key.splits * SPLIT_LEN)

    def fill(self, groups: PrefixGroups, key: GraphKey) -> None:
        """Static inputs <- `groups` (CPU, the batch's n rows) padded to the graph's shapes."""
        padded = pad_groups(groups, groups.batch, key.batch, key.groups)
        g, w = groups.num_groups, groups.block_tables.shape[1]
        self.block_tables[:g, :w].copy_(groups.block_tables, non_blocking=True)
        for name, src in padded.items():
            getattr(self, name)[: src.shape[0]].copy_(torch.from_numpy(src), non_blocking=True)
