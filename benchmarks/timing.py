"""Eager timing shared by the kernel benchmarks."""

import time

import triton


def eager_ms(fn, device: str) -> float:
    """Median milliseconds of fn, launch overhead included: triton's do_bench on CUDA (L2
    flushed before every run); one wall-clock run on the CPU (smoke runs)."""
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3
