"""Paged attention as the decoder sees it: write this step's K/V into their slots, then attend
over each sequence's block table (cached prefix + new tokens, causal).

The kernels come from the model's backend table (kernels/backend.py, KernelOps): Triton on
CUDA; "torch", the batched CPU path of kernels/cpu_attention.py (its host-side plan made by the
first layer of a step and kept in the metadata for the others); "reference", the per-sequence
torch oracle. A decode batch whose rows share cached prefix blocks may come with prefix groups
(kernels.shared_prefix.PrefixGroups, derived by the engine when the table asks for them): then
the shared blocks are read once per group instead of once per row (shared-prefix / cascade
attention); the torch backend finds such rows in the block tables itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # kernels import Triton: only when a table is built
    from kernels.backend import KernelOps


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, slot of each new token (< 0: not written)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, query offsets into the flattened batch
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    max_seqlen_q: int
    prefix_groups: object | None = None  # PrefixGroups of a decode batch (one token per row), on the device
    max_private_len: int | None = None  # host bound on seq_lens - prefix_groups.private_start (None: any)
    plan: object | None = None  # the torch backend's CpuAttentionPlan of this step, made by its first layer


class PagedAttention(nn.Module):
    """Holds its layer's K/V cache views; the model runner binds them after allocation."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: KernelOps):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.ops = ops
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.k_cache is not None, "KV cache not bound to the attention layer"
        ops = self.ops
        if ops.plan_step is not None and meta.prefix_groups is None:
            return self._forward_planned(q, k, v, meta)
        ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.prefix_groups is not None:
            assert meta.max_seqlen_q == 1 and q.shape[0] == meta.seq_lens.shape[0], "prefix groups: decode only"
            # q as its kernels were validated on the GPU with: contiguous rows (2 MB per layer at 256)
            return ops.shared_prefix_decode(q.contiguous(), self.k_cache, self.v_cache, meta.prefix_groups,
                                            meta.block_tables, meta.seq_lens, scale=self.scale,
                                            max_private_len=meta.max_private_len)
        return ops.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            scale=self.scale,
            max_seqlen_q=meta.max_seqlen_q,
        )

    def _forward_planned(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        ops = self.ops
        if meta.plan is None:
            meta.plan = ops.plan_step(q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.block_tables,
                                      meta.cu_seqlens_q, meta.seq_lens, scale=self.scale,
                                      max_seqlen_q=meta.max_seqlen_q)
        ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.plan)
        return ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.seq_lens, scale=self.scale, max_seqlen_q=meta.max_seqlen_q, plan=meta.plan)
