"""Tile shapes and the split-KV decision for paged attention, chosen on the host from
shapes alone (no tensor values, so no sync and the same choice inside a CUDA graph)."""

import functools
from dataclasses import dataclass

import torch

from kernels.runtime import next_pow2

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 512  # below this a split's fixed cost (partials + reduce) outweighs its gain


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int      # tile rows = query tokens x query heads of one kv head (padded)
    block_n: int      # KV tokens per iteration, gathered across paged blocks
    num_warps: int
    num_stages: int
    num_splits: int = 1  # > 1: split-KV (flash-decoding) with a reduce launch

    def validate(self, group: int):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"config.{name}: must be a power of two >= 16, got {v}")
        if self.block_m < group:
            raise ValueError(f"config.block_m: {self.block_m} rows cannot hold a group of {group} heads")
        if self.num_splits < 1 or self.num_splits & (self.num_splits - 1) or self.num_splits > MAX_SPLITS:
            raise ValueError(f"config.num_splits: power of two in [1, {MAX_SPLITS}], got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"config: bad num_warps={self.num_warps} / num_stages={self.num_stages}")


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so the CPU tests take the split path too
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=1024)  # a pure function of shapes, called every step
def default_config(device, *, num_seqs, kv_heads, group, head_dim, max_seqlen_q, max_context,
                   is_decode, dtype=torch.bfloat16):
    """is_decode: every query chunk is at most one token (max_seqlen_q == 1)."""
    block_d = max(16, next_pow2(head_dim))
    # fp32 (tests, exact IEEE dots) needs small tiles on the GPU or its registers spill.
    fp32 = dtype == torch.float32
    if is_decode:
        block_m = max(16, next_pow2(group))
        block_n = 64 if device.type == "cuda" and not fp32 else 32
        programs = max(1, num_seqs * kv_heads)
        want = -(-4 * num_sms(device) // programs)  # aim for ~4 programs per SM
        by_len = max(1, max_context // MIN_SPLIT_TOKENS)
        splits = min(MAX_SPLITS, want, by_len)
        splits = 1 if splits <= 1 else 1 << (splits.bit_length() - 1)  # round down to 2^k
        return AttentionConfig(block_m, block_n, num_warps=4, num_stages=2, num_splits=splits)
    if device.type != "cuda":
        return AttentionConfig(max(16, next_pow2(group)), 16, num_warps=4, num_stages=1)
    if fp32:
        return AttentionConfig(max(32, next_pow2(group)), 32, num_warps=4, num_stages=2)
    if block_d > 128:
        return AttentionConfig(max(64, next_pow2(group)), 64, num_warps=8, num_stages=2)
    return AttentionConfig(max(128, next_pow2(group)), 128, num_warps=8, num_stages=3)
