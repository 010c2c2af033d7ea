"""Rotary position embedding with the scaling variants Llama checkpoints use.

The cos/sin table is precomputed once for every position up to the model length, so the
forward only gathers rows by position (no data-dependent shapes: CUDA-graph safe).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixkv.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = cfg.rope_parameters
    if cfg.rope_type == "linear":
        return inv_freq / float(p["factor"])
    if cfg.rope_type == "llama3" and "freq_factors" in p:
        # GGUF files store Llama 3's scaling as the divisor of each frequency
        return inv_freq / torch.tensor(p["freq_factors"], dtype=torch.float32)
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, p)
    assert cfg.rope_type == "default", cfg.rope_type
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin) [T, 1, D/2] in `dtype` for apply_rope, gathered by position."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]: rotates the two halves of the head dim (the HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
