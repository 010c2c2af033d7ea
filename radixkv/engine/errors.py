"""The engine's two kinds of error: a request it refuses, and a device it cannot go on with.

ParamError: add_request refuses bad input; `param` names the field at fault, for the API's
error body. Anything else a request's handling raises fails that request only (the engine
finishes it with "error"), except a device-level error: after one, every later kernel fails
too, so the process must end and a fresh one take over.
"""

from __future__ import annotations

import sys


class ParamError(ValueError):
    """A bad request field. The message names the field too, for readers of the text alone."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# Errors after which the CUDA context is unusable (the driver makes them sticky). Matched in the
# message of older torch's RuntimeError and of Triton's launcher, which raise no typed error.
DEVICE_ERROR_MESSAGES = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ECC error",
    "launch timed out",
)


def is_device_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or what it was raised from) leaves the accelerator unusable.

    torch.AcceleratorError (torch >= 2.8) is raised for every failed CUDA call; older torch and
    Triton raise RuntimeError with the driver's message. Running out of memory is not
    device-level: the allocation failed, the context lives, and a smaller batch may fit."""
    # torch not imported: nothing on the device ran, and this module stays importable without it
    torch = sys.modules.get("torch")
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        oom = torch is not None and isinstance(exc, torch.OutOfMemoryError)
        if not oom:
            accelerator_error = getattr(torch, "AcceleratorError", None)
            if accelerator_error is not None and isinstance(exc, accelerator_error):
                return True
            if isinstance(exc, RuntimeError) and any(m in str(exc) for m in DEVICE_ERROR_MESSAGES):
                return True
        exc = exc.__cause__ or exc.__context__
    return False
