"""The kernel backends as tables of functions: the one place a backend name is resolved.

  triton     the Triton kernels (CUDA, or Triton's interpreter on the CPU), fused element-wise
             decoder steps, shared-prefix decode with prefix groups the engine derives
  torch      the batched CPU path of cpu_attention.py: a host plan per step (plan_step, made
             by the first layer and reused by the others); it finds shared prefixes itself
  reference  the per-sequence torch oracles of reference.py

NOTE: the model is built from a KernelOps table (ops_for(name, device), made once per name)
and calls its functions; no model or engine code compares backend names. A fused op left
None means "use the model's own torch ops": those are the definition the fused kernels are
tested against (kernels/fused.py), so a backend without fused kernels needs no stand-ins.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

NAMES = ("triton", "torch", "reference")


@dataclass(frozen=True)
class KernelOps:
    name: str
    store_kv: Callable             # (key, value, k_cache, v_cache, slot_mapping[, plan])
    paged_attention: Callable      # (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, scale,
                                   #  max_seqlen_q[, plan])
    copy_blocks: Callable          # (kv_cache, block_mapping): copy-on-write block copies
    shared_prefix_decode: Callable  # (q, k_cache, v_cache, groups, block_tables, seq_lens, *, scale, max_private_len)
    # The host plan of a step, shared by every layer (store_kv and paged_attention take it as
    # `plan`); None: the kernels need none.
    plan_step: Callable | None = None
    # Fused decoder steps (kernels/fused.py signatures); None: the model's torch ops.
    add_rms_norm: Callable | None = None
    silu_mul: Callable | None = None
    rope_qk_: Callable | None = None
    # Whether the engine derives prefix groups for decode batches (shared_prefix_decode then
    # reads each shared segment once per group); the torch backend finds them in its plan.
    prefix_groups: bool = False


def _triton() -> KernelOps:
    from kernels import copy_blocks, fused, paged_attention, store_kv
    from kernels.shared_prefix import shared_prefix_decode

    return KernelOps("triton", store_kv, paged_attention, copy_blocks, shared_prefix_decode,
                     add_rms_norm=fused.add_rms_norm, silu_mul=fused.silu_mul, rope_qk_=fused.rope_qk_,
                     prefix_groups=True)


def _torch() -> KernelOps:
    from kernels.cpu_attention import paged_attention_cpu, plan_step, store_kv_cpu
    from kernels.reference import copy_blocks_ref
    from kernels.shared_prefix import shared_prefix_decode_ref

    return KernelOps("torch", store_kv_cpu, paged_attention_cpu, copy_blocks_ref, shared_prefix_decode_ref,
                     plan_step=plan_step)


def _reference() -> KernelOps:
    from kernels.reference import copy_blocks_ref, paged_attention_ref, store_kv_ref
    from kernels.shared_prefix import shared_prefix_decode_ref

    return KernelOps("reference", store_kv_ref, paged_attention_ref, copy_blocks_ref, shared_prefix_decode_ref)


_BUILDERS = {"triton": _triton, "torch": _torch, "reference": _reference}


@functools.cache
def _table(name: str) -> KernelOps:
    return _BUILDERS[name]()


def ops_for(attention_backend: str, device="cpu") -> KernelOps:
    """The table of a backend name; "auto": triton on CUDA, torch elsewhere."""
    name = attention_backend
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ValueError(f"attention_backend: {attention_backend!r} not in {('auto',) + NAMES}")
    return _table(name)
