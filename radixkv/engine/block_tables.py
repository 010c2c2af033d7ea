"""Block tables of the running sequences, kept as rows of one numpy array across steps, and
the prefix groups of a decode batch derived from them.

Re-converting every table from Python lists each step costs ~40 ns per entry (0.7 ms for
256 sequences of 1k tokens), so each row is refreshed only from the first entry that can
have changed: entries of blocks computed before the last refresh are final (the cache only
rewrites a table at the block being written, by copy-on-write, and at blocks committed in
that step, by deduplication), so a decode step rewrites one or two entries per sequence.
"""

from __future__ import annotations

import time

import numpy as np


class BlockTables:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int):
        self.table = np.zeros((max_rows, max_blocks), np.int32)
        self.lens = np.zeros(max_rows, np.int64)
        self.block_size = block_size
        self._row: dict[int, int] = {}
        self._stable: dict[int, int] = {}  # entries of a row known final
        self._free = list(range(max_rows - 1, -1, -1))

    def sync(self, entries) -> list[int]:
        """entries: (seq_id, the cache's block table, computed tokens) per sequence of the step.
        Refreshes their rows with one scatter; returns the rows."""
        width, bs = self.table.shape[1], self.block_size
        row_of, stable = self._row, self._stable
        rows, lens, idx, vals = [], [], [], []
        for seq_id, table, num_computed in entries:
            row = row_of.get(seq_id)
            if row is None:
                assert self._free, "more running sequences than block-table rows"
                row = self._free.pop()
                row_of[seq_id] = row
                start = 0
            else:
                start = stable[seq_id]
            n = len(table)
            assert n <= width, f"block table of {n} blocks exceeds the model length"
            base = row * width
            idx.extend(range(base + start, base + n))
            vals.extend(table[start:] if start else table)
            stable[seq_id] = min(n, num_computed // bs)
            rows.append(row)
            lens.append(n)
        if idx:
            self.table.reshape(-1)[np.fromiter(idx, np.int64, len(idx))] = np.fromiter(vals, np.int32, len(vals))
        self.lens[rows] = lens
        return rows

    def release(self, seq_id: int) -> None:
        row = self._row.pop(seq_id, None)
        if row is not None:
            del self._stable[seq_id]
            self._free.append(row)


class PrefixGroupCache:
    """Prefix groups (kernels/shared_prefix.py) of the running decode batch.

    Deriving them from the block tables costs ~1 ms for 256 rows, and they stay valid while the
    batch holds the same sequences in the same order: decoding only appends private tokens,
    and blocks a group shares are committed, so no table entry under them changes. So they are
    derived again only when the batch's sequence ids change. Returns None when sharing would
    not pay (fewer than `min_saved_tokens` KV tokens per layer not re-read).
    """

    def __init__(self, block_size: int, min_saved_tokens: int, *, min_shared_blocks: int = 8, max_levels: int = 2,
                 device=None):
        from kernels.shared_prefix import derive_groups

        self._derive = derive_groups
        self.block_size, self.min_saved_tokens = block_size, min_saved_tokens
        self.min_shared_blocks, self.max_levels = min_shared_blocks, max_levels
        self.device = device
        self._key: tuple | None = None
        self._groups = self._on_device = None
        self.num_derived = 0  # how often groups were derived, and the host seconds it took
        self.derive_seconds = 0.0

    def get(self, seq_ids: tuple, block_tables: np.ndarray, seq_lens: np.ndarray):
        """(groups on the CPU, the same on `device`) for a decode batch, or (None, None)."""
        if seq_ids != self._key:
            import torch

            t = time.perf_counter()
            groups = self._derive(torch.from_numpy(block_tables), torch.from_numpy(seq_lens),
                                  block_size=self.block_size, min_shared_blocks=self.min_shared_blocks,
                                  max_levels=self.max_levels)
            self.num_derived += 1
            self.derive_seconds += time.perf_counter() - t
            self._key = seq_ids
            if groups.num_groups and groups.saved_tokens >= max(1, self.min_saved_tokens):
                self._groups = groups
                self._on_device = groups if self.device is None else groups.to(self.device, non_blocking=True)
            else:
                self._groups = self._on_device = None
        return self._groups, self._on_device

    @property
    def current(self):
        """The CPU groups of the last batch asked about (None: it does not share enough)."""
        return self._groups

    def clear(self) -> None:
        self._key = None
        self._groups = self._on_device = None
