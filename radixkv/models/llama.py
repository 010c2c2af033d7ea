"""The Llama-style decoder, shared by the supported families.

Variants are config flags, set per family in config.py:
  Llama    attention_bias / mlp_bias as configured
  Qwen2    q/k/v biases, no o bias
  Qwen3    RMSNorm over each q and k head before RoPE
  Mistral  plain Llama; a sliding window caps the context at the window (exact there)

The forward runs over a flattened variable-length batch: input_ids and positions are [T],
attention reads and writes the paged KV cache through AttentionMetadata. No padding.
The kernels come from the backend table (kernels/backend.py, KernelOps) the model is built
with. Where it has fused element-wise ops (the Triton backend, kernels/fused.py) the residual
add goes into the next RMSNorm, RoPE rotates q and k in place in the qkv projection's output
(no copies of q, k, v), and silu(gate) * up is one kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixkv.models.attention import AttentionMetadata, PagedAttention
from radixkv.models.config import ModelConfig
from radixkv.models.layers import GatedMLP, Linear, RMSNorm, linear, merged_shards
from radixkv.models.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from kernels.backend import KernelOps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        # in-place fused RoPE needs q and k as they leave the projection (no per-head norm first)
        self._rope = ops.rope_qk_
        self.fused_rope = ops.rope_qk_ is not None and not cfg.qk_norm
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = h * d, kvh * d
        shards = merged_shards(["q_proj", "k_proj", "v_proj"], [self.q_size, self.kv_size, self.kv_size])
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, shards)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = PagedAttention(h, kvh, d, ops)

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        """rope: (positions, cos table, sin table) when fused_rope, else gathered (cos, sin)."""
        t = x.shape[0]
        attn = self.attn
        if self.fused_rope:
            qkv = self._rope(self.qkv_proj(x), *rope, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            q = qkv[:, : self.q_size].view(t, attn.num_heads, attn.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, attn.num_kv_heads, attn.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(t, attn.num_kv_heads, attn.head_dim)
            return self.o_proj(attn(q, k, v, meta).reshape(t, self.q_size))
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.attn.num_heads, self.attn.head_dim)
        k = k.reshape(t, self.attn.num_kv_heads, self.attn.head_dim)
        v = v.reshape(t, self.attn.num_kv_heads, self.attn.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = self.attn(q, k, v.contiguous(), meta)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.add_rms_norm)
        self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.add_rms_norm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops.silu_mul)

    def forward(self, x, residual, rope, meta):
        """(this layer's MLP output, the residual stream before it); their sum is the layer's output."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(cfg, max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        if self.layers[0].self_attn.fused_rope:
            rope = (positions, self.rotary_emb.cos, self.rotary_emb.sin)
        else:
            rope = self.rotary_emb(positions, x.dtype)  # gathered once, used by every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return x + residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: KernelOps | str = "torch", max_positions: int | None = None):
        """backend: the kernel table (kernels.backend.ops_for), or a backend name to look up."""
        super().__init__()
        if isinstance(backend, str):
            from kernels.backend import ops_for

            backend = ops_for(backend, torch.get_default_device())
        self.config = cfg
        self.ops = backend
        self.model = LlamaModel(cfg, backend, max_positions or cfg.max_model_len)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the given rows; the final norm is per token, so only those rows pay for it.
        out: a [rows, vocab] buffer to write them into (a captured graph's static output)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if out is None:
            return linear(self.model.norm(hidden), weight)
        return torch.mm(self.model.norm(hidden), weight.t(), out=out)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
