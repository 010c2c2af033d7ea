"""radixkv/engine/shared_prefix.py: the decode-graph key, the one padding of prefix groups
and the one split length."""

import random

import numpy as np
import pytest
import torch

from kernels.shared_prefix import SharedPrefixConfig, derive_groups
from radixkv.engine.cuda_graph import capture_sizes
from radixkv.engine.shared_prefix import (LEVELS, MIN_SHARED_BATCH, SPLIT_LEN, GraphGroups, GraphKey, pad_groups,
                                          shared_graph_key, start_up_shared_keys)

BS = 4


def test_graph_key_is_frozen_and_hashable_and_a_plain_key_has_no_groups():
    key = GraphKey(64, 4, 2)
    assert hash(key) == hash(GraphKey(64, 4, 2)) and {key: 1}[GraphKey(64, 4, 2)] == 1
    with pytest.raises(AttributeError):
        key.batch = 8
    plain = GraphKey(64)
    assert plain == GraphKey(64, groups=0, splits=0) and hash(plain) == hash(GraphKey(64, 0, 0))
    assert not plain.shared and key.shared and plain != key
    assert key == (64, 4, 2) and str(key) == "(64, 4, 2)"  # as the benchmarks report shapes


def test_graph_key_of_a_batch():
    sizes = capture_sizes(256)
    rows = [list(range(100, 228)) + [i] for i in range(64)]  # 64 rows x 128 shared blocks
    lens = [len(r) * BS - 1 for r in rows]
    groups = derive_groups(rows, lens, block_size=BS, min_shared_blocks=8, max_levels=LEVELS)
    # 512 shared tokens: one split; 60 rows pad up to the graph of 64
    assert shared_graph_key(60, derive_groups(rows[:60], lens[:60], block_size=BS, min_shared_blocks=8),
                            sizes, MIN_SHARED_BATCH, 300) == GraphKey(64, 1, 1)
    assert shared_graph_key(64, groups, sizes, MIN_SHARED_BATCH, 300) == GraphKey(64, 1, 1)
    assert shared_graph_key(64, None, sizes, MIN_SHARED_BATCH, 300) is None  # the plain graph
    assert shared_graph_key(16, groups, sizes, MIN_SHARED_BATCH, 300) is None  # below MIN_SHARED_BATCH
    long = [list(range(1000, 1512)) + [i] for i in range(64)]  # 2,048 shared tokens: 2 splits of 1,024
    long_groups = derive_groups(long, [len(r) * BS - 1 for r in long], block_size=BS, min_shared_blocks=8)
    assert shared_graph_key(64, long_groups, sizes, MIN_SHARED_BATCH, 600) == GraphKey(64, 1, 2)
    keys = start_up_shared_keys(sizes, MIN_SHARED_BATCH)
    assert all(isinstance(k, GraphKey) and k.shared for k in keys) and keys[0] == GraphKey(256, 1, 1)


def test_the_split_length_is_the_kernels_default():
    assert SPLIT_LEN == SharedPrefixConfig().shared_split_len
    # the host bound a graph sets makes the kernel split exactly `splits` times
    groups = GraphGroups(max_batch=8, max_blocks=4, device="cpu")
    for splits in (1, 2, 4, 8):
        assert groups.view(GraphKey(8, 1, splits)).max_shared_len == splits * SharedPrefixConfig().shared_split_len


def _random_batch(rng):
    prefixes = [[rng.randrange(1000) * 8 + j for j in range(rng.randrange(1, 6))] for _ in range(rng.randrange(1, 4))]
    rows, fresh = [], 10_000
    for _ in range(rng.randrange(2, 12)):
        row = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
        for _ in range(rng.randrange(1, 4)):
            row.append(fresh)
            fresh += 1
        rows.append(row)
    lens = [len(r) * BS - rng.randrange(BS) for r in rows]
    return rows, lens


@pytest.mark.parametrize("seed", range(20))
def test_one_padding_the_engines_equals_the_kernels_groups_padding(seed):
    rng = random.Random(seed)
    rows, lens = _random_batch(rng)
    groups = derive_groups(rows, lens, block_size=BS, min_shared_blocks=1, max_levels=LEVELS)
    n = len(rows)
    bs = n + rng.randrange(4)
    g_pad = groups.num_groups + rng.randrange(3)
    got = pad_groups(groups, n, bs, g_pad)
    want = groups.padded(num_groups=g_pad + 1, num_members=LEVELS * bs, num_levels=LEVELS, batch=bs)
    for name, arr in got.items():
        assert isinstance(arr, np.ndarray)
        assert arr.tolist() == getattr(want, name).tolist(), name
    # padding rows: private from token 0, in no group
    assert (got["seq_slots"][n:] == -1).all() and (got["private_start"][n:] == 0).all()
    assert got["seq_slots"][:n, : groups.num_levels].tolist() == groups.seq_slots.tolist()
    # the static graph inputs take exactly that layout
    inputs = GraphGroups(max_batch=16, max_blocks=8, device="cpu")
    key = GraphKey(bs, g_pad, 1)
    inputs.fill(groups, key)
    view = inputs.view(key)
    for name, arr in got.items():
        assert getattr(view, name).tolist() == arr.tolist(), name
    g, w = groups.num_groups, groups.block_tables.shape[1]
    assert torch.equal(view.block_tables[:g, :w], groups.block_tables)


def test_padding_keeps_a_batch_without_extra_rows_as_it_was():
    groups = derive_groups([[1, 2, 5], [1, 2, 6]], [10, 11], block_size=BS, min_shared_blocks=1)
    same = groups.padded(num_groups=groups.num_groups + 1, num_members=4, num_levels=2)
    assert same.private_start is groups.private_start and same.batch == groups.batch
    with pytest.raises(ValueError, match="batch"):
        groups.padded(num_groups=groups.num_groups + 1, num_members=4, num_levels=2, batch=1)
