"""Admission of pinned sequence groups (beam search): they are never preempted, so one is
admitted only while the worst cases of every admitted pinned group fit the pool together.

NOTE: a pinned group that cannot grow preempts sequences of unpinned requests instead, and
those always free enough: the reservations never exceed the pool, and the engine rejects up
front a group whose worst case exceeds the pool alone. So pinned groups never deadlock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.sequence import Request


class PinnedAdmission:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.reserved_blocks = 0  # worst cases of the admitted pinned groups, summed
        self._held: dict[str, int] = {}  # request id -> its reservation

    def fits(self, req: "Request") -> bool:
        return req.pinned_blocks == 0 or req.request_id in self._held \
            or self.reserved_blocks + req.pinned_blocks <= self.num_blocks

    def admit(self, req: "Request") -> None:
        if req.pinned_blocks and req.request_id not in self._held:
            self._held[req.request_id] = req.pinned_blocks
            self.reserved_blocks += req.pinned_blocks

    def release(self, req: "Request") -> None:
        """The group is over (finished, aborted or failed): its reservation goes back."""
        self.reserved_blocks -= self._held.pop(req.request_id, 0)
