"""CUDA graphs for decode steps: one graph per batch size, replayed with the batch padded up.

Padding rows write nowhere (slot -1) and attend to one token of block 0, so they cost little
and touch no sequence's KV. The block table width is fixed at the model length. Every graph
writes its logits into one static buffer (no per-graph output held in the pool).

With shared-prefix attention, a batch whose rows share cached blocks replays a graph whose
attention reads each shared segment once per group. Graphs are keyed by GraphKey (batch,
groups, splits); the shapes, the padded group layout and the static group inputs live in
radixkv/engine/shared_prefix.py. Graphs for one group and one split are captured at start for
every size from `min_shared_batch` up, and for the largest size with every split count (so
every kernel variant compiles at start); other shapes when first seen.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from radixkv.engine.batch import Batch
from radixkv.engine.shared_prefix import (MAX_SHARED_GRAPHS, MIN_SHARED_BATCH, GraphGroups, GraphKey,
                                          shared_graph_key, start_up_shared_keys)
from radixkv.models.attention import AttentionMetadata

logger = logging.getLogger("radixkv.engine")


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_blocks: int, device, *, shared_prefix: bool = False,
                 min_shared_batch: int = MIN_SHARED_BATCH, stage=torch.from_numpy):
        self.model = model
        self.stage = stage  # numpy -> a host tensor to copy into the static inputs (the runner's pinned staging)
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
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.shared_prefix = shared_prefix
        self.min_shared_batch = min_shared_batch
        self.num_shared_captures = 0
        self.shared_capture_s = 0.0  # wall time of shared-prefix captures made while serving
        self.last_shared = False  # whether the last replay was a shared-prefix graph
        self.group_inputs = GraphGroups(n, max_blocks, device) if shared_prefix else None
        self._filled = None  # (groups, n, key) whose content the static group inputs hold
        self._pool = None  # one memory pool for every graph, made at the first capture
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            self._capture(GraphKey(bs))
        if shared_prefix:
            for key in start_up_shared_keys(self.sizes, min_shared_batch):
                self._capture(key)

    # ---- capture ------------------------------------------------------------------------
    def _meta(self, key: GraphKey) -> AttentionMetadata:
        bs = key.batch
        meta = AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.cu_seqlens_q[: bs + 1],
                                 self.seq_lens[:bs], max_seqlen_q=1)
        if key.shared:
            meta.prefix_groups = self.group_inputs.view(key)
        return meta

    def _run(self, key: GraphKey) -> None:
        bs = key.batch
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(key))
        self.model.compute_logits(hidden, out=self.logits[:bs])

    @torch.inference_mode()
    def _capture(self, key: GraphKey) -> None:
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
        if key.shared:
            self.num_shared_captures += 1

    # ---- replay -------------------------------------------------------------------------
    def fits(self, batch: Batch) -> bool:
        return (
            batch.is_decode
            and len(batch.seq_lens) <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def key(self, n: int, groups) -> GraphKey:
        """The graph for a batch of n rows with these (CPU) groups: a shared-prefix one, or the
        plain one of its size."""
        key = shared_graph_key(n, groups, self.sizes, self.min_shared_batch, self.max_blocks) \
            if self.shared_prefix else None
        if key is None or (key not in self.graphs and self.num_shared_captures >= MAX_SHARED_GRAPHS):
            return GraphKey(self.sizes[bisect.bisect_left(self.sizes, n)])
        return key

    def run(self, batch: Batch, groups=None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, vocab] of the n decode rows of `batch`; `groups`: its PrefixGroups (CPU);
        input_ids: the rows' tokens already on the device (else batch.input_ids)."""
        n = len(batch.seq_lens)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        w = batch.block_tables.shape[1]
        stage = self.stage
        self.input_ids[:n].copy_(stage(batch.input_ids) if input_ids is None else input_ids, non_blocking=True)
        self.positions[:n].copy_(stage(batch.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(stage(batch.slot_mapping), non_blocking=True)
        self.block_tables[:n, :w].copy_(stage(batch.block_tables), non_blocking=True)
        self.seq_lens[:n].copy_(stage(batch.seq_lens), non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.positions[n:bs].zero_()
        key = self.key(n, groups)
        if key.shared:
            if self._filled is None or self._filled[0] is not groups or self._filled[1:] != (n, key):
                self.group_inputs.fill(groups, key)
                self._filled = (groups, n, key)
            if key not in self.graphs:
                logger.info("capturing a shared-prefix decode graph for batch %d, %d groups, %d splits", *key)
                t0 = time.perf_counter()
                self._capture(key)
                self.shared_capture_s += time.perf_counter() - t0
        self.graphs[key].replay()
        self.last_shared = key.shared
        return self.logits[:n]
