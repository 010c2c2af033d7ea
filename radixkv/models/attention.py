"""Paged attention as the decoder sees it: write this step's K/V into their slots, then attend
over each sequence's block table (cached prefix + new tokens, causal).

The kernels package supplies the backends with one signature: Triton on CUDA; "torch", the
batched CPU path of kernels/cpu_attention.py (its host-side plan made by the first layer of a
step and kept in the metadata for the others); "reference", the per-sequence torch oracle.
A decode batch whose rows share cached prefix blocks may come with prefix groups
(kernels.shared_prefix.PrefixGroups, Triton): then the shared blocks are read once per group
instead of once per row (shared-prefix / cascade attention); the torch backend finds such
rows in the block tables itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BACKENDS = ("triton", "torch", "reference")


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


def shared_prefix_op(backend: str):
    """shared_prefix_decode for a backend name."""
    if backend == "triton":
        from kernels.shared_prefix import shared_prefix_decode

        return shared_prefix_decode
    if backend in ("torch", "reference"):
        from kernels.shared_prefix import shared_prefix_decode_ref

        return shared_prefix_decode_ref
    raise ValueError(f"attention backend {backend!r} not in {BACKENDS}")


def attention_ops(backend: str):
    """(store_kv, paged_attention) for a backend name."""
    if backend == "triton":
        from kernels import paged_attention, store_kv

        return store_kv, paged_attention
    if backend == "torch":
        from kernels.cpu_attention import paged_attention_cpu, store_kv_cpu

        return store_kv_cpu, paged_attention_cpu
    if backend == "reference":
        from kernels.reference import paged_attention_ref, store_kv_ref

        return store_kv_ref, paged_attention_ref
    raise ValueError(f"attention backend {backend!r} not in {BACKENDS}")


class PagedAttention(nn.Module):
    """Holds its layer's K/V cache views; the model runner binds them after allocation."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.store_kv, self.paged_attention = attention_ops(backend)
        self.backend = backend
        self._shared_prefix_decode = None  # resolved on first use: most models never need it
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.k_cache is not None, "KV cache not bound to the attention layer"
        if self.backend == "torch" and meta.prefix_groups is None:
            return self._forward_planned(q, k, v, meta)
        self.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.prefix_groups is not None:
            assert meta.max_seqlen_q == 1 and q.shape[0] == meta.seq_lens.shape[0], "prefix groups: decode only"
            if self._shared_prefix_decode is None:
                self._shared_prefix_decode = shared_prefix_op(self.backend)
            # q as its kernels were validated on the GPU with: contiguous rows (2 MB per layer at 256)
            return self._shared_prefix_decode(q.contiguous(), self.k_cache, self.v_cache, meta.prefix_groups,
                                              meta.block_tables, meta.seq_lens, scale=self.scale,
                                              max_private_len=meta.max_private_len)
        return self.paged_attention(
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
        if meta.plan is None:
            from kernels.cpu_attention import plan_step

            meta.plan = plan_step(q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.block_tables,
                                  meta.cu_seqlens_q, meta.seq_lens, scale=self.scale, max_seqlen_q=meta.max_seqlen_q)
        self.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.plan)
        return self.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                    meta.seq_lens, scale=self.scale, max_seqlen_q=meta.max_seqlen_q, plan=meta.plan)
