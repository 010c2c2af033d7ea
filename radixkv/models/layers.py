"""Building blocks of the Llama-style decoder: RMSNorm, linear layers, gated MLP.

Parameters are created empty (no random init: the loader fills them). Merged projections
(q|k|v and gate|up) are one matmul each; `shards` tells the loader where each HF tensor goes.
Given a fused op from the backend table (kernels/backend.py; the Triton backend has them, in
kernels/fused.py), the element-wise steps run as that kernel instead of the torch ops here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, add_norm=None):
        """add_norm: a fused add_rms_norm (kernels/fused.py) for add_forward; None: torch ops."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self._add_norm = add_norm

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


SMALL_ROWS = 4  # up to this many rows, a CPU fp32 linear runs as (W x^T)^T (NOTE below)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) = x W^T (+ b).

    NOTE: for a decode step's few rows on the CPU, MKL's x W^T streams the weights at half the
    speed of the same product taken as (W x^T)^T: on a 2-core EPYC, SmolLM2-135M's projections
    and tied head took 55 ms per step for 1 row, 105 ms for 2 and 97 ms for 4, against 36, 38
    and 65 ms (1 thread, `python -m benchmarks.cpu_linear`; a lone row is doubled, one column was
    as slow again). From 8 rows on, F.linear is as fast or faster. Both orders sum the same terms,
    in another order: results agree to fp32 rounding (HF's greedy tokens unchanged on SmolLM2,
    tests/test_gguf_fidelity.py)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= SMALL_ROWS:
        rows = x.shape[0]
        xx = x.expand(2, -1).contiguous() if rows == 1 else x
        y = torch.mm(weight, xx.t())[:, :rows].t()
        return (y + bias if bias is not None else y).contiguous()
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` maps an HF sub-name to (row offset, rows) inside W."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shards: dict | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = shards or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def merged_shards(names: list[str], sizes: list[int]) -> dict:
    out, offset = {}, 0
    for name, size in zip(names, sizes):
        out[name] = (offset, size)
        offset += size
    return out


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, silu_mul=None):
        """silu_mul: a fused silu(gate) * up (kernels/fused.py); None: torch ops."""
        super().__init__()
        self._silu_mul = silu_mul
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
