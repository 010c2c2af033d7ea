"""Where a Triton kernel can run: on CUDA tensors, or on CPU tensors when the kernel
was built by Triton's interpreter (TRITON_INTERPRET=1 set before kernels was imported)."""

from triton.runtime.interpreter import InterpretedFunction


def ensure_runnable(fn_name: str, kernel, device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and isinstance(kernel, InterpretedFunction)):
        return
    raise RuntimeError(
        f"{fn_name}: Triton needs CUDA tensors (got {device}); on the CPU call "
        f"kernels.reference.{fn_name}_ref, or set TRITON_INTERPRET=1 before importing kernels")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
