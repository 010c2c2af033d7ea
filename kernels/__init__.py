"""Paged-KV kernels: Triton on CUDA (and in Triton's interpreter), pure-torch references
in kernels.reference with the same signatures."""

from kernels.copy_blocks import copy_blocks
from kernels.paged_attention import paged_attention
from kernels.store_kv import store_kv

__all__ = ["store_kv", "copy_blocks", "paged_attention"]
