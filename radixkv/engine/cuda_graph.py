"""CUDA graphs for decode steps: one graph per batch size, replayed with the batch padded up.

Padding rows write nowhere (slot -1) and attend to one token of block 0, so they cost little
and touch no sequence's KV. The block table width is fixed at the model length. Every graph
writes its logits into one static buffer (no per-graph output held in the pool).

With shared-prefix attention, a batch whose rows share cached blocks replays a graph whose
attention reads each shared segment once per group. Its prefix groups are padded to fixed
shapes (PrefixGroups.padded's layout): up to `groups` groups (bucketed), 2 levels, 2 member
slots per row, and `splits` KV splits of 1,024 shared tokens (bucketed; the last split runs
to the end, so a longer segment stays correct). Graphs for one group and one split are
captured at start for every size from `min_shared_batch` up, and for the largest size with
every split count (so every kernel variant compiles at start); other shapes when first seen.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from radixkv.engine.batch import Batch
from radixkv.models.attention import AttentionMetadata

logger = logging.getLogger("radixkv.engine")

GROUP_BUCKETS = (1, 4, 16, 64)  # shared graphs exist for up to this many groups (bucketed)
SPLIT_BUCKETS = (1, 2, 4, 8)  # KV splits of the shared segments (bucketed)
SPLIT_TOKENS = 1024  # shared tokens per split: SharedPrefixConfig().shared_split_len
LEVELS = 2  # sharing levels per row (system prompt -> few-shot examples)
MAX_SHARED_GRAPHS = 48  # beyond this many shapes, batches fall back to the plain graphs
MIN_SHARED_BATCH = 64  # smaller decode batches replay the plain graphs


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def shared_graph_key(n: int, groups, sizes: list[int], min_shared_batch: int, max_blocks: int) -> tuple | None:
    """(batch size, groups, splits): the shape of the shared-prefix graph that a decode batch of
    n rows with these (CPU) groups replays, or None when it takes the plain graph."""
    bs = sizes[bisect.bisect_left(sizes, n)]
    if groups is None or bs < min_shared_batch or groups.num_levels > LEVELS:
        return None
    g = _bucket(groups.num_groups, GROUP_BUCKETS)
    if g is None or groups.block_tables.shape[1] > max_blocks:
        return None
    splits = _bucket(-(-groups.max_shared_len // SPLIT_TOKENS), SPLIT_BUCKETS) or SPLIT_BUCKETS[-1]
    return (bs, g, splits)


def start_up_shared_keys(sizes: list[int], min_shared_batch: int) -> list[tuple]:
    """The shared-prefix graph shapes captured at start, largest first: one group and one
    split for every size from min_shared_batch up, and the largest size with every split
    count (the split count is the one shape the kernels compile for: every variant compiles
    at start, not inside a served step)."""
    if sizes[-1] < min_shared_batch:
        return []
    keys = [(bs, GROUP_BUCKETS[0], SPLIT_BUCKETS[0]) for bs in reversed(sizes) if bs >= min_shared_batch]
    return keys + [(sizes[-1], GROUP_BUCKETS[0], s) for s in SPLIT_BUCKETS[1:]]


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_blocks: int, device, *, shared_prefix: bool = False,
                 min_shared_batch: int = MIN_SHARED_BATCH):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        n = self.sizes[-1]
        kw = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **kw)
        self.positions = torch.zeros(n, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **kw)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, **kw)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        cfg = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.logits = torch.empty(n, cfg.vocab_size, dtype=dtype, **kw)
        self.graphs: dict = {}  # bs -> plain graph; (bs, groups, splits) -> shared-prefix graph
        self.shared_prefix = shared_prefix
        self.min_shared_batch = min_shared_batch
        self.num_shared_captures = 0
        self.shared_capture_s = 0.0  # wall time of shared-prefix captures made while serving
        self.last_shared = False  # whether the last replay was a shared-prefix graph
        if shared_prefix:  # static prefix-group inputs; the "no sharing" content is all zeros
            g = GROUP_BUCKETS[-1] + 1  # + the padding group that holds unused member slots
            self.g_tables = torch.zeros(g, max_blocks, dtype=torch.int32, **kw)
            self.g_lens = torch.zeros(g, dtype=torch.int32, **kw)
            self.g_cu = torch.zeros(g + 1, dtype=torch.int32, **kw)
            self.g_members = torch.zeros(LEVELS * n, dtype=torch.int32, **kw)
            self.g_slots = torch.full((n, LEVELS), -1, dtype=torch.int32, **kw)
            self.g_pstart = torch.zeros(n, dtype=torch.int32, **kw)
            self._filled = None  # (groups, n, key) whose content the static inputs hold
        self._pool = None  # one memory pool for every graph, made at the first capture
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            self._capture(bs)
        if shared_prefix:
            for key in start_up_shared_keys(self.sizes, min_shared_batch):
                self._capture(key)

    # ---- capture ------------------------------------------------------------------------
    def _meta(self, key) -> AttentionMetadata:
        bs = key if isinstance(key, int) else key[0]
        meta = AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.cu_seqlens_q[: bs + 1],
                                 self.seq_lens[:bs], max_seqlen_q=1)
        if not isinstance(key, int):
            from kernels.shared_prefix import PrefixGroups

            _, groups, splits = key
            meta.prefix_groups = PrefixGroups(
                block_tables=self.g_tables[: groups + 1], shared_lens=self.g_lens[: groups + 1],
                cu_members=self.g_cu[: groups + 2], members=self.g_members[: LEVELS * bs],
                seq_slots=self.g_slots[:bs], private_start=self.g_pstart[:bs],
                # host bounds that size the grid: every member slot of the batch sizes, and the splits
                max_members=LEVELS * self.sizes[-1], max_shared_len=splits * SPLIT_TOKENS)
        return meta

    def _run(self, key) -> None:
        bs = key if isinstance(key, int) else key[0]
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(key))
        self.model.compute_logits(hidden, out=self.logits[:bs])

    @torch.inference_mode()
    def _capture(self, key) -> None:
        # The warm-up runs on whatever the static inputs hold: at start "nothing" (slots -1,
        # one token of block 0, no groups); later the current batch, which the replay recomputes.
        self._run(key)  # Triton compiles, cuBLAS picks algorithms: outside the graph
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._run(key)
        torch.cuda.synchronize()
        self.graphs[key] = graph
        if not isinstance(key, int):
            self.num_shared_captures += 1

    # ---- replay -------------------------------------------------------------------------
    def fits(self, batch: Batch) -> bool:
        return (
            batch.is_decode
            and len(batch.seq_lens) <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def shared_key(self, n: int, groups) -> tuple | None:
        """The graph for a batch of n rows with these (CPU) groups, or None: the plain one."""
        if not self.shared_prefix:
            return None
        key = shared_graph_key(n, groups, self.sizes, self.min_shared_batch, self.max_blocks)
        if key is not None and key not in self.graphs and self.num_shared_captures >= MAX_SHARED_GRAPHS:
            return None
        return key

    def run(self, batch: Batch, groups=None) -> torch.Tensor:
        """Logits [n, vocab] of the n decode rows of `batch`; `groups`: its PrefixGroups (CPU)."""
        n = len(batch.seq_lens)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        w = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(torch.from_numpy(batch.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(batch.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(batch.slot_mapping), non_blocking=True)
        self.block_tables[:n, :w].copy_(torch.from_numpy(batch.block_tables), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(batch.seq_lens), non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.positions[n:bs].zero_()
        key = self.shared_key(n, groups)
        if key is not None:
            self._fill_groups(groups, n, key)
            if key not in self.graphs:
                logger.info("capturing a shared-prefix decode graph for batch %d, %d groups, %d splits", *key)
                t0 = time.perf_counter()
                self._capture(key)
                self.shared_capture_s += time.perf_counter() - t0
        self.graphs[bs if key is None else key].replay()
        self.last_shared = key is not None
        return self.logits[:n]

    def _fill_groups(self, groups, n: int, key: tuple) -> None:
        """Static group inputs <- `groups` in the graph's padded layout (skipped when they hold it)."""
        if self._filled is not None and self._filled[0] is groups and self._filled[1:] == (n, key):
            return
        bs, g_pad, _ = key
        padded = pad_groups(groups, n, bs, g_pad)
        g, w = groups.num_groups, groups.block_tables.shape[1]
        self.g_tables[:g, :w].copy_(groups.block_tables, non_blocking=True)
        for dst, name in ((self.g_lens, "shared_lens"), (self.g_cu, "cu_members"), (self.g_members, "members"),
                          (self.g_slots, "seq_slots"), (self.g_pstart, "private_start")):
            src = padded[name]
            dst[: src.shape[0]].copy_(torch.from_numpy(src), non_blocking=True)
        self._filled = (groups, n, key)


def pad_groups(groups, n: int, bs: int, num_groups: int) -> dict[str, np.ndarray]:
    """The fields of `groups` (CPU, a batch of n rows) but its block tables, padded for a graph
    of bs rows, num_groups groups + 1 padding group and LEVELS * bs member slots, laid out as
    PrefixGroups.padded lays them: extra groups are empty, the last holds the unused member
    slots (no row names them), extra levels and padding rows are -1, padding rows private."""
    g, lv = groups.num_groups, groups.num_levels
    m, m_pad = groups.members.shape[0], LEVELS * bs
    assert g <= num_groups and lv <= LEVELS and m <= m_pad and n <= bs
    cu = np.full(num_groups + 2, m, np.int32)
    cu[: g + 1] = groups.cu_members.numpy()
    cu[-1] = m_pad
    lens = np.zeros(num_groups + 1, np.int32)
    lens[:g] = groups.shared_lens.numpy()
    members = np.zeros(m_pad, np.int32)
    members[:m] = groups.members.numpy()
    slots = np.full((bs, LEVELS), -1, np.int32)
    slots[:n, :lv] = groups.seq_slots.numpy()
    pstart = np.zeros(bs, np.int32)
    pstart[:n] = groups.private_start.numpy()
    return {"shared_lens": lens, "cu_members": cu, "members": members, "seq_slots": slots, "private_start": pstart}
