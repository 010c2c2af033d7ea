"""EngineConfig: everything the engine is built from. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "lpm")


@dataclass
class EngineConfig:
    model_dir: str | None  # an HF folder, a .gguf file, or a folder holding one .gguf
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: the checkpoint's dtype on cuda (bfloat16 for float32 ones), float32 on cpu
    load_format: str = "safetensors"  # "dummy": seeded random weights of the config's shape
    seed: int = 0  # dummy weights and requests without a seed
    block_size: int = 16
    num_blocks: int | None = None  # KV pool size; None: sized from memory
    gpu_memory_utilization: float = 0.9  # share of the card the engine may fill (weights + activations + KV)
    cpu_kv_cache_gib: float = 0.25  # KV pool size on cpu when num_blocks is None
    max_model_len: int | None = None  # None: the model's (and at most what the pool holds)
    max_num_seqs: int = 256  # running sequences at once
    max_num_batched_tokens: int = 8192  # tokens per step (prefill chunks + decodes)
    max_prefill_chunk: int | None = None  # prompt tokens of one sequence per step; None: the step budget
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "lpm": admit the longest cached prefix first
    hash_algo: str = "sha256"
    hash_seed: int = 0
    enable_cache_events: bool = False
    attention_backend: str = "auto"  # kernels/backend.py; auto: "triton" on cuda, "torch" on cpu
    enforce_eager: bool = False  # no CUDA graphs
    max_cuda_graph_batch: int = 256  # decode batches up to this size replay captured graphs
    # Decode rows that share cached prefix blocks read them once per step for the whole group
    # (kernels/shared_prefix/, radixkv/engine/shared_prefix.py). Applies with the backends whose
    # table asks for prefix groups (Triton, the default on CUDA), when the batch's groups skip at
    # least shared_prefix_min_saved_tokens KV tokens per layer. On an H200 (Llama-3-8B shape,
    # bf16) its logits match the plain kernel's within bf16 tolerance (tests/test_engine_gpu.py);
    # 256 requests of 1,024 shared + 128 own prompt tokens ran 1.24x faster in that test
    # (benchmarks/results/gpu_tests.log, 2026-11-29) and gave 1.15x the output tok/s in
    # `python -m benchmarks.throughput` (benchmarks/results/throughput.md).
    enable_shared_prefix_attention: bool = True
    # on an H200 small groups (16 rows) ran slower than the plain kernel; the engine shares only
    # where >= 64k KV-token reads per layer are skipped (benchmarks/results/shared_prefix.md)
    shared_prefix_min_saved_tokens: int = 65536
    check_invariants: bool = True  # check the cache's invariants whenever the engine goes idle
    # Launch step N+1 before step N's tokens reach the host, settle N while N+1 runs (engine.py's
    # NOTE); None: on for CUDA, off on the CPU (where nothing runs beside the host).
    async_scheduling: bool | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def positive_int(name, value, allow_none=False):
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.model_dir is None:
            raise ValueError("model_dir is required (an HF model folder or a .gguf file)")
        positive_int("block_size", self.block_size)
        positive_int("num_blocks", self.num_blocks, allow_none=True)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        positive_int("max_prefill_chunk", self.max_prefill_chunk, allow_none=True)
        positive_int("max_cuda_graph_batch", self.max_cuda_graph_batch)
        if not isinstance(self.enable_shared_prefix_attention, bool):
            raise ValueError("enable_shared_prefix_attention must be a bool, "
                             f"got {self.enable_shared_prefix_attention!r}")
        v = self.shared_prefix_min_saved_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"shared_prefix_min_saved_tokens must be a non-negative int, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in every step, or some starve
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        if self.hash_algo not in ("sha256", "xxh3_128"):
            raise ValueError(f"hash_algo must be 'sha256' or 'xxh3_128', got {self.hash_algo!r}")
        if self.attention_backend not in ("auto", "triton", "torch", "reference"):
            raise ValueError("attention_backend must be 'auto', 'triton', 'torch' or 'reference', "
                             f"got {self.attention_backend!r}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
