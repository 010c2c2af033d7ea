"""Batch tensors of one step, built with numpy (no per-token Python loop)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, getitem, itemgetter

import numpy as np

from radixkv.engine.block_tables import BlockTables
from radixkv.engine.sequence import Sequence

_first, _second, _last = itemgetter(0), itemgetter(1), itemgetter(-1)
_num_computed, _token_ids = attrgetter("num_computed_tokens"), attrgetter("token_ids")


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
    rows: each sequence's row in `tables` (synced for this step). Per sequence, Python fetches
    its computed count, its token list and the tokens of its chunk
    (a decode's: the last one); the rest is numpy over the whole batch."""
    nseq = len(scheduled)
    assert nseq > 0 and len(rows) == nseq
    block_size = tables.block_size
    seqs = list(map(_first, scheduled))
    starts = np.fromiter(map(_num_computed, seqs), np.int64, nseq)
    lens = np.fromiter(map(_second, scheduled), np.int64, nseq)
    toks = list(map(_token_ids, seqs))
    num_tokens = np.fromiter(map(len, toks), np.int64, nseq)
    seq_lens = starts + lens
    max_len = int(lens.max())
    tails = seq_lens == num_tokens  # chunks that end at the sequence's last token: they sample
    all_tails = bool(tails.all())
    if max_len == 1:  # a decode step: one token per sequence
        cu = np.arange(nseq + 1, dtype=np.int64)
        input_ids = np.fromiter(map(_last, toks) if all_tails else map(getitem, toks, starts.tolist()), np.int64, nseq)
        positions = starts
        tok_seq = np.arange(nseq)
    else:
        cu = np.zeros(nseq + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        total = int(cu[-1])
        input_ids = np.fromiter(
            chain.from_iterable(t[a : a + n] for t, a, n in zip(toks, starts.tolist(), lens.tolist())), np.int64, total
        )
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, lens)
        tok_seq = np.repeat(np.arange(nseq), lens)
    row_idx = np.asarray(rows, dtype=np.int64)
    width = int(tables.lens[row_idx].max())
    block_tables = tables.table[row_idx, :width]  # a gathered copy
    slot_mapping = block_tables[tok_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    if all_tails:
        sample_rows, sample_seqs = cu[1:] - 1, seqs
    else:
        samples = np.flatnonzero(tails)
        sample_rows, sample_seqs = cu[1:][samples] - 1, [seqs[i] for i in samples.tolist()]
    return Batch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        cu_seqlens_q=cu.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        max_seqlen_q=max_len,
        sample_rows=sample_rows,
        sample_seqs=sample_seqs,
    )
