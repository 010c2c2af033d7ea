"""Tile shapes and the split-KV decision for paged attention, chosen on the host from
shapes alone (no tensor values, so no sync and the same choice inside a CUDA graph)."""

import functools
from dataclasses import dataclass

import torch

from kernels.runtime import next_pow2

MAX_SPLITS = 64


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
    """Tile shapes from host-known sizes. is_decode: every query chunk is at most one token.

    Measured on an H200 (benchmarks/kernels.py --sweep): decode with at least one program
    (sequence x kv head) per SM streams at ~0.95 of the copy bandwidth unsplit; with fewer,
    each program's chain of dependent loads sets the time, and short splits win: one tile
    each, unpipelined (num_stages 1), at batch 1 x 4k (11.8 us against 13.3 for two-tile
    splits with 2 stages); long contexts get MAX_SPLITS splits of several tiles.
    """
    block_d = max(16, next_pow2(head_dim))
    fp32 = dtype == torch.float32  # tests only: exact IEEE dots need small tiles or spill
    if is_decode:
        block_m = max(16, next_pow2(group))
        tuned = device.type == "cuda" and not fp32
        programs, sms = max(1, num_seqs * kv_heads), num_sms(device)
        if programs >= sms:
            block_n = (64 if programs >= 4 * sms else 128) if tuned else 32  # fewer: more bytes each
            return AttentionConfig(block_m, block_n, num_warps=4, num_stages=2)
        # One 128-token tile per split while MAX_SPLITS of them cover the context; longer
        # contexts get splits of several 64-token tiles, pipelined (32k: 42 vs 47 us).
        block_n = (128 if 4096 <= max_context <= 128 * MAX_SPLITS else 64) if tuned else 32
        splits = min(MAX_SPLITS, -(-4 * sms // programs), max(1, max_context // block_n))
        splits = 1 << (splits.bit_length() - 1)  # round down to a power of two
        stages = 1 if tuned and max_context <= 2 * block_n * splits else 2
        return AttentionConfig(block_m, block_n, num_warps=4, num_stages=stages, num_splits=splits)
    if device.type != "cuda":
        return AttentionConfig(max(16, next_pow2(group)), 16, num_warps=4, num_stages=1)
    if fp32:
        return AttentionConfig(max(32, next_pow2(group)), 32, num_warps=4, num_stages=2)
    if block_d > 128:
        return AttentionConfig(max(64, next_pow2(group)), 64, num_warps=8, num_stages=2)
    # 64 query tokens x 4 heads per program, 64-key tiles in 3 stages: of 11 tile shapes
    # (benchmarks/kernels.py --sweep prefill), fastest for 2k tokens over no prefix (85 us)
    # and within 2% over an 8k prefix (656 us; 128 x 128 tiles: 690).
    return AttentionConfig(max(256, next_pow2(group)), 64, num_warps=8, num_stages=3)
