"""CUDA graphs for decode steps: one graph per batch size, replayed with the batch padded up.

Padding rows write nowhere (slot -1) and attend to one token of block 0, so they cost little
and touch no sequence's KV. The block table width is fixed at the model length.
"""

from __future__ import annotations

import bisect

import torch

from radixkv.engine.batch import Batch
from radixkv.models.attention import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_blocks: int, device):
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.cu_seqlens_q[: bs + 1],
                                 self.seq_lens[:bs], max_seqlen_q=1)

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            self._run(bs)  # warm-up (Triton compiles, cuBLAS picks algorithms) outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._run(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, batch: Batch) -> bool:
        return (
            batch.is_decode
            and len(batch.seq_lens) <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [n, vocab] of the n decode rows of `batch`."""
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
        self.graphs[bs].replay()
        return self.logits[bs][:n]
