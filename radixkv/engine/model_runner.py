"""ModelRunner: owns the model and its paged KV cache on the device; runs one step.

A step: COW block copies first (a sample about to write into a block it shared gets its own
copy before anyone writes), then the forward over the flattened batch, then the logits of
the rows that sample. Decode batches replay CUDA graphs on the GPU. The kernels are the
backend table's (kernels/backend.py), chosen once here and handed to the model at load. When
the table asks for prefix groups (Triton), a decode batch whose rows share enough cached prefix
blocks attends with shared-prefix attention (each shared block read once per group); its
groups come from the block tables (radixkv/engine/shared_prefix.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from radixkv.engine.batch import Batch, build_batch
from radixkv.engine.block_tables import BlockTables
from radixkv.engine.config import EngineConfig
from radixkv.engine.staging import HostStaging
from radixkv.engine.shared_prefix import PrefixGroupCache, max_private_len
from radixkv.engine.sequence import Sequence
from radixkv.models.attention import AttentionMetadata
from radixkv.models.config import ModelConfig
from radixkv.models.loader import load_model

logger = logging.getLogger("radixkv.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAPH_POOL_MARGIN = 512 << 20  # bytes kept free for CUDA graph pools and allocator slack
# NOTE: a CPU step of at most this many tokens (a decode of a few sequences) runs on one intra-op
# thread. Its ops take microseconds to a fraction of a millisecond, and every OpenMP region among
# them waits for the second thread: on a 2-core machine at a load average of 3, `python -m
# benchmarks.cpu_linear --threads 2` took 36-860 ms per step for one row, against 35-38 ms with
# --threads 1. An idle machine gives up its second core for these steps.
SMALL_STEP_TOKENS = 4


def resolve_dtype(name: str, model_dtype: str, device: str) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device == "cpu":
        return torch.float32
    dt = DTYPES.get(model_dtype, torch.bfloat16)
    return torch.bfloat16 if dt == torch.float32 else dt


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, device: str):
        self.config, self.model_cfg, self.device = config, model_cfg, torch.device(device)
        self.dtype = resolve_dtype(config.dtype, model_cfg.dtype, device)
        from kernels.backend import ops_for

        self.ops = ops_for(config.attention_backend, self.device)  # the one place a backend is chosen
        self.backend = self.ops.name
        self.block_size = config.block_size
        self.staging = HostStaging(self.device)
        self.max_positions = min(model_cfg.max_model_len, config.max_model_len or model_cfg.max_model_len)
        self.model = load_model(config.model_dir, model_cfg, device=device, dtype=self.dtype, backend=self.ops,
                                load_format=config.load_format, max_positions=self.max_positions, seed=config.seed)
        self._copy_blocks = self.ops.copy_blocks
        self.last_step_shared = False  # whether the last step used shared-prefix attention
        self.num_blocks = config.num_blocks or self._auto_num_blocks()
        self.kv_cache = torch.zeros(
            (model_cfg.num_layers, 2, self.num_blocks, self.block_size, model_cfg.num_kv_heads, model_cfg.head_dim),
            dtype=self.dtype, device=self.device,
        )
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        # a sequence can never outgrow the pool: the context is capped there too
        self.max_model_len = min(self.max_positions, self.num_blocks * self.block_size)
        # the device-side mirror of the running sequences' block tables (the cache manager's are the truth)
        self.block_tables = BlockTables(config.max_num_seqs, -(-self.max_model_len // self.block_size),
                                        self.block_size)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", self.num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, self.dtype)
        if self.device.type == "cuda":
            # The host's tensor work here is small (batch tensors, prefix groups): intra-op
            # threads only add wake-up latency, 100x on a loaded machine (derive_groups).
            torch.set_num_threads(1)
        self.prefix_groups = None
        if config.enable_shared_prefix_attention and self.ops.prefix_groups:
            self.prefix_groups = PrefixGroupCache(self.block_size, config.shared_prefix_min_saved_tokens,
                                                  device=self.device)
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from radixkv.engine.cuda_graph import DecodeGraphs

            max_blocks = -(-self.max_positions // self.block_size)
            self.graphs = DecodeGraphs(self.model, min(config.max_cuda_graph_batch, config.max_num_seqs),
                                       max_blocks, self.device, shared_prefix=self.prefix_groups is not None,
                                       stage=self.staging.pinned)
        if self.device.type == "cuda":
            self._warmup()

    # ---- sizing -----------------------------------------------------------------------
    def _block_bytes(self) -> int:
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * self.model_cfg.kv_bytes_per_token(itemsize)

    def _auto_num_blocks(self) -> int:
        cfg = self.config
        # never more than every running sequence at full length needs
        cap = cfg.max_num_seqs * -(-self.max_positions // self.block_size)
        if self.device.type != "cuda":
            return max(1, min(cap, int(cfg.cpu_kv_cache_gib * 2**30) // self._block_bytes()))
        activations = self._profile_peak_activations()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * cfg.gpu_memory_utilization - (total - free) - activations - GRAPH_POOL_MARGIN
        blocks = int(budget // self._block_bytes())
        if blocks < 1:
            raise ValueError(
                f"gpu_memory_utilization {cfg.gpu_memory_utilization}: no memory left for the KV cache "
                f"(weights and activations take {(total - free + activations) / 2**30:.1f} GiB of {total / 2**30:.1f})"
            )
        logger.info("memory: %.1f GiB in use after loading, %.2f GiB peak activations, %d KV blocks fit",
                    (total - free) / 2**30, activations / 2**30, blocks)
        return min(blocks, cap)

    @torch.inference_mode()
    def _profile_peak_activations(self) -> int:
        """Peak extra memory of a forward at the largest step (all batched tokens, max logits rows)."""
        cfg, mc = self.config, self.model_cfg
        tokens = min(cfg.max_num_batched_tokens, self.max_positions)
        nb = -(-tokens // self.block_size)
        scratch = torch.zeros((mc.num_layers, 2, nb, self.block_size, mc.num_kv_heads, mc.head_dim),
                              dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = scratch[i, 0], scratch[i, 1]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, device=self.device),
            block_tables=torch.arange(nb, dtype=torch.int32, device=self.device)[None],
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            max_seqlen_q=tokens,
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, torch.arange(tokens, device=self.device), meta)
        rows = torch.full((min(cfg.max_num_seqs, tokens),), tokens - 1, device=self.device)
        self.model.compute_logits(hidden[rows]).float().log_softmax(-1)  # what the sampler holds
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, hidden, meta
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _warmup(self) -> None:
        """Mixed prefill + decode steps on scratch inputs before serving. On an H200 the first
        full-size mixed step of a fresh process took 2.5 s instead of 0.2 s (kernel variants
        compiled, memory pools grown inside it). Covers the Triton specialisations that vary
        between steps (row count and table width, multiples of 16 or not; short and long
        tables pick different tiles). Nothing is written (slots -1); reads hit block 0."""
        cfg, bs = self.config, self.block_size
        tokens = min(cfg.max_num_batched_tokens, self.max_positions)
        max_blocks = -(-self.max_positions // bs)
        # (rows, table width, tokens in the step)
        cases = [(rows, width, rows + 2 * bs) for rows in (64, 63) for width in (16, 17)]
        cases += [(63, max_blocks, tokens), (64, max_blocks - 1, tokens)]  # long tables; a full-size step
        for rows, width, total in cases:
            rows = max(1, min(rows, cfg.max_num_seqs, tokens - 1))
            width = max(1, min(width, max_blocks))
            chunk = max(2, min(total, tokens) - (rows - 1))
            chunk = min(chunk, width * bs)
            lens = np.array([chunk] + [1] * (rows - 1), np.int32)  # one prefill chunk, the rest decodes
            cu = np.zeros(rows + 1, np.int32)
            np.cumsum(lens, out=cu[1:])
            total = int(cu[-1])
            positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens)
            meta = AttentionMetadata(
                slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=self.device),
                block_tables=torch.zeros((rows, width), dtype=torch.int32, device=self.device),
                cu_seqlens_q=self._tensor(cu), seq_lens=self._tensor(lens), max_seqlen_q=int(lens.max()))
            ids = torch.zeros(total, dtype=torch.int64, device=self.device)
            hidden = self.model(ids, self._tensor(positions), meta)
            self.model.compute_logits(hidden[self._tensor(cu[1:] - 1)]).float().log_softmax(-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- the step ---------------------------------------------------------------------
    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        return self.staging.to_device(arr)

    @torch.inference_mode()
    def release_rows(self, seq_ids: list[int]) -> None:
        """Sequences freed in the cache: their block-table rows go back."""
        for seq_id in seq_ids:
            self.block_tables.release(seq_id)

    def execute(self, scheduled: list[tuple[Sequence, int]], block_table, copy_ops: list[tuple[int, int]],
                feed: tuple[torch.Tensor, list[int]] | None = None) -> tuple[Batch, torch.Tensor | None]:
        """Run one step; block_table(seq_id) gives a sequence's table (the cache manager's).
        feed: (the last step's drawn tokens on the device, rows of it): the input tokens not
        known on the host yet (negative ids, one at the end of a sequence's chunk), in the
        order of the sequences that have one. Returns the batch and the logits
        [len(batch.sample_seqs), vocab] (None if empty)."""
        self.staging.next_step()
        if copy_ops:
            self._copy_blocks(self.kv_cache, torch.tensor(copy_ops, dtype=torch.int64))
        batch = build_batch(scheduled, self.block_tables, self.block_tables.sync_step(scheduled, block_table))
        input_ids = None if feed is None else self._fed_input_ids(batch, *feed)
        groups = dev_groups = None
        if self.prefix_groups is not None and batch.is_decode:
            groups, dev_groups = self.prefix_groups.get(tuple(s.seq_id for s, _ in scheduled), batch.block_tables,
                                                        batch.seq_lens)
        self.last_step_shared = groups is not None
        if self.graphs is not None and self.graphs.fits(batch):
            logits = self.graphs.run(batch, groups, input_ids)
            self.last_step_shared = self.graphs.last_shared
            if len(batch.sample_seqs) == len(batch.seq_lens):  # every decode row samples: rows in order
                return batch, logits
            return batch, logits[self._tensor(batch.sample_rows)] if len(batch.sample_seqs) else None
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads == 1 or len(batch.input_ids) > SMALL_STEP_TOKENS:
            return batch, self._forward(batch, groups, dev_groups, input_ids)
        torch.set_num_threads(1)
        try:
            return batch, self._forward(batch, groups, dev_groups, input_ids)
        finally:
            torch.set_num_threads(threads)

    def _fed_input_ids(self, batch: Batch, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        at = np.flatnonzero(batch.input_ids < 0)
        assert len(at) == len(rows), f"{len(at)} input tokens not known on the host, {len(rows)} fed"
        known = batch.input_ids.copy()
        known[at] = 0
        ids = self._tensor(known)
        if len(at):
            ids[self._tensor(at)] = tokens[self._tensor(np.asarray(rows, dtype=np.int64))]
        return ids

    def _forward(self, batch: Batch, groups, dev_groups, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        meta = AttentionMetadata(
            slot_mapping=self._tensor(batch.slot_mapping),
            block_tables=self._tensor(batch.block_tables),
            cu_seqlens_q=self._tensor(batch.cu_seqlens_q),
            seq_lens=self._tensor(batch.seq_lens),
            max_seqlen_q=batch.max_seqlen_q,
        )
        if dev_groups is not None:
            meta.prefix_groups = dev_groups
            meta.max_private_len = max_private_len(groups, batch.seq_lens)
        if input_ids is None:
            input_ids = self._tensor(batch.input_ids)
        hidden = self.model(input_ids, self._tensor(batch.positions), meta)
        if not batch.sample_seqs:
            return None
        return self.model.compute_logits(hidden[self._tensor(batch.sample_rows)])
