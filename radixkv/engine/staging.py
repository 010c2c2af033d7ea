"""Host-to-device copies of a step's inputs through pinned memory.

NOTE: a copy from pageable numpy memory is staged by the driver and, in the overlapped loop,
left the next step's inputs waiting behind the running step; from pinned memory the copy is
a DMA queued in stream order and the host goes on at once. Two pinned arenas alternate by
step: step k fills arena k % 2, whose last user, step k - 2, has finished (its tokens were
settled before step k was built), so no queued copy still reads it. An input larger than an
arena goes through pageable memory (correct, only slower).
"""

from __future__ import annotations

import numpy as np
import torch

ARENA_BYTES = 8 << 20  # a step's inputs at 8,192 tokens and 256 rows of 512 blocks take under 1 MiB
ALIGN = 64


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self._arenas = [torch.empty(ARENA_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)] \
            if device.type == "cuda" else None
        self._turn = 0
        self._used = 0

    def next_step(self) -> None:
        """A new step's inputs begin: switch arenas."""
        self._turn ^= 1
        self._used = 0

    def pinned(self, arr: np.ndarray) -> torch.Tensor:
        """`arr` as a host tensor to copy from with non_blocking=True: pinned on CUDA."""
        host = torch.from_numpy(np.ascontiguousarray(arr))
        n = host.numel() * host.element_size()
        if self._arenas is None or self._used + n > ARENA_BYTES:
            return host
        staged = self._arenas[self._turn][self._used : self._used + n].view(host.dtype).view(host.shape)
        self._used += -(-n // ALIGN) * ALIGN
        return staged.copy_(host)

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        return self.pinned(arr).to(self.device, non_blocking=True)
