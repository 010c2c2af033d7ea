"""Building blocks of the Llama-style decoder: RMSNorm, linear layers, gated MLP.

Parameters are created empty (no random init: the loader fills them). Merged projections
(q|k|v and gate|up) are one matmul each; `shards` tells the loader where each HF tensor goes.
With fused=True (the Triton backend) the element-wise steps run as the kernels of fused.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _fused(name: str):
    from radixkv.models import fused  # imports triton: only models built for the Triton backend

    return getattr(fused, name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self._add_norm = _fused("add_rms_norm") if fused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 and scale in the model dtype, the order HF uses (bit-for-bit in fp32)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(h), h) with h = x + residual, the new residual stream (h = x when None)."""
        if self._add_norm is not None:
            return self._add_norm(x, residual, self.weight, self.eps)
        h = x if residual is None else x + residual
        return self.forward(h), h


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
    def __init__(self, hidden: int, intermediate: int, bias: bool, fused: bool = False):
        super().__init__()
        self._silu_mul = _fused("silu_mul") if fused else None
        shards = merged_shards(["gate_proj", "up_proj"], [intermediate, intermediate])
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, shards)
        self.down_proj = Linear(intermediate, hidden, bias)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self._silu_mul is not None:
            return self.down_proj(self._silu_mul(gate_up, self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
