"""Batch tensors of one step, built with numpy (no per-token Python loop)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from radixkv.engine.block_tables import BlockTables
from radixkv.engine.sequence import Sequence


@dataclass
class Batch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32 (entries past a table's end are stale ids)
    cu_seqlens_q: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    max_seqlen_q: int
    sample_rows: np.ndarray  # rows of the flattened batch whose logits are sampled
    sample_seqs: list[Sequence]  # the sequences those rows belong to

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1


def build_batch(scheduled: list[tuple[Sequence, int]], tables: BlockTables, rows: list[int]) -> Batch:
    """scheduled: (sequence, tokens to compute), tokens starting at the sequence's computed count;
    rows: each sequence's row in `tables` (synced for this step)."""
    nseq = len(scheduled)
    assert nseq > 0 and len(rows) == nseq
    block_size = tables.block_size
    starts = np.fromiter((s.num_computed_tokens for s, _ in scheduled), np.int64, nseq)
    lens = np.fromiter((n for _, n in scheduled), np.int64, nseq)
    cu = np.zeros(nseq + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    input_ids = np.fromiter(
        chain.from_iterable(s.token_ids[a : a + n] for (s, n), a in zip(scheduled, starts.tolist())), np.int64, total
    )
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, lens)
    row_idx = np.asarray(rows, dtype=np.int64)
    width = int(tables.lens[row_idx].max())
    block_tables = tables.table[row_idx, :width]  # a gathered copy
    tok_seq = np.repeat(np.arange(nseq), lens)
    slot_mapping = block_tables[tok_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = starts + lens
    samples = [i for i, (s, n) in enumerate(scheduled) if seq_lens[i] == s.num_tokens]
    return Batch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        cu_seqlens_q=cu.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        max_seqlen_q=int(lens.max()),
        sample_rows=cu[1:][samples] - 1,
        sample_seqs=[scheduled[i][0] for i in samples],
    )
