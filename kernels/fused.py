"""Fused element-wise steps of the decoder, for the Triton backend.

At a decode batch of 256 tokens every element-wise op of a layer is a separate ~2-3 us launch
(RMSNorm alone is seven in fp32), about 40 per layer: milliseconds per step, and at a prefill
chunk of 8k tokens each of them re-reads the activations. Three kernels replace them:

  add_rms_norm   residual add + RMSNorm (one read of x and the residual, two writes)
  rope_qk_       rotary embedding of q and k, in place in the fused qkv projection output
  silu_mul       silu(gate) * up of the merged gate|up projection

Each rounds where HF's eager code rounds (the residual sum, the normalised value before the
weight, cos/sin to the model dtype, silu before the product), computing in fp32 between.
The pure-torch functions beside them are the reference (the CPU path of the decoder,
radixkv/models/layers.py and rope.py, computes the same in torch ops); kernels/backend.py puts
the kernels in the Triton backend's table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.runtime import next_pow2
from triton.runtime.interpreter import InterpretedFunction


def _check_device(t: torch.Tensor, kernel) -> None:
    if t.device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(f"fused decoder ops need CUDA tensors (got {t.device}); build the model with "
                           f"backend='torch' on the CPU, or set TRITON_INTERPRET=1 before importing triton kernels")


# ---- references -------------------------------------------------------------------------
def add_rms_norm_ref(x, residual, weight, eps):
    """(weight * rmsnorm(h), h) with h = x + residual (or x when residual is None)."""
    h = x if residual is None else x + residual
    dtype = h.dtype
    f = h.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(dtype), h


def rope_ref(x, cos, sin):
    """x [T, heads, D]; cos/sin [T, 1, D/2] in x's dtype: rotates the two halves (HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_mul_ref(gate_up, intermediate):
    gate, up = gate_up.split(intermediate, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- kernels ----------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, stride_x, stride_r, stride_o, stride_h,
                         n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        h = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(x.dtype)  # the residual stream is kept in the model dtype, as HF keeps it
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    else:
        h = x
    f = h.to(tl.float32)
    var = tl.sum(f * f, 0) / n
    normed = (f * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_pos, num_heads,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program per token: all its q and k heads (they sit side by side in qkv) at once.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    mask = (h < num_heads) & d_ok
    base = qkv_ptr + t * stride_t + h * HEAD_DIM + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    # cos/sin rounded to the model dtype first, like HF's cos.to(x.dtype)
    c = tl.load(cos_ptr + pos * stride_pos + d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_pos + d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(base, (a * c - b * s).to(dt), mask=mask)
    tl.store(base + HALF, (b * c + a * s).to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gu_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + n + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2


def add_rms_norm(x, residual, weight, eps):
    """Fused add_rms_norm_ref: x, residual [T, n] (residual may be None), weight [n]."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == (x.shape[1],)
    _check_device(x, _add_rms_norm_kernel)
    t, n = x.shape
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    if t:
        res = x if residual is None else residual
        assert res.shape == x.shape and res.stride(-1) == 1
        block = next_pow2(n)
        _add_rms_norm_kernel[(t,)](x, res, weight, out, h, x.stride(0), res.stride(0), out.stride(0),
                                   h.stride(0), n, float(eps), HAS_RES=residual is not None, BLOCK=block,
                                   num_warps=_warps(block))
    return out, h


def rope_qk_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim):
    """Rotates q and k in place inside qkv [T, (Hq + 2 Hkv) * D] (q heads, then k, then v);
    cos/sin: the fp32 tables [max_positions, D/2]; positions [T]."""
    assert qkv.dim() == 2 and qkv.stride(-1) == 1 and head_dim % 2 == 0
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    _check_device(qkv, _rope_kernel)
    t = qkv.shape[0]
    if t:
        heads = num_q_heads + num_kv_heads
        half = head_dim // 2
        _rope_kernel[(t,)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), heads,
                           HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_H=next_pow2(heads),
                           num_warps=4)
    return qkv


def silu_mul(gate_up, intermediate):
    """Fused silu_mul_ref: gate_up [T, 2 * intermediate] -> [T, intermediate]."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] == 2 * intermediate
    _check_device(gate_up, _silu_mul_kernel)
    t = gate_up.shape[0]
    out = torch.empty((t, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, next_pow2(intermediate))
        _silu_mul_kernel[(t, triton.cdiv(intermediate, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                intermediate, BLOCK=block, num_warps=4)
    return out
