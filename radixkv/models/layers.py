"""Building blocks of the Llama-style decoder: RMSNorm, linear layers, gated MLP.

Parameters are created empty (no random init: the loader fills them). Merged projections
(q|k|v and gate|up) are one matmul each; `shards` tells the loader where each HF tensor goes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 and scale in the model dtype, the order HF uses (bit-for-bit in fp32)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` maps an HF sub-name to (row offset, rows) inside W."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shards: dict | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = shards or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def merged_shards(names: list[str], sizes: list[int]) -> dict:
    out, offset = {}, 0
    for name, size in zip(names, sizes):
        out[name] = (offset, size)
        offset += size
    return out


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        shards = merged_shards(["gate_proj", "up_proj"], [intermediate, intermediate])
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, shards)
        self.down_proj = Linear(intermediate, hidden, bias)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
