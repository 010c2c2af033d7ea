"""derive_groups: every group it reports is really shared, and with min_shared_blocks=1 it
finds every row's longest shared prefix (checked against brute-force pairwise LCPs)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.shared_prefix import PrefixGroups, derive_groups
from kernels.shared_prefix.groups import check_groups
from test_shared_prefix_cases import as_tensors, lcp, random_forest

BS = 4


def check_sound(groups, rows, lens, min_blocks, max_levels):
    """Each member's own table holds its group's segment right after its earlier levels."""
    batch = len(rows)
    check_groups(groups, batch=batch, block_size=BS, num_blocks=10**6,
                 device=torch.device("cpu"), seq_lens=torch.tensor(lens, dtype=torch.int32))
    cu = groups.cu_members.tolist()
    seg_lens = groups.shared_lens.tolist()
    members = groups.members.tolist()
    group_of = {s: g for g in range(len(seg_lens)) for s in range(cu[g], cu[g + 1])}
    for g in range(len(seg_lens)):
        assert cu[g + 1] - cu[g] >= 2, "a derived group has fewer than two members"
        assert len(set(members[cu[g]:cu[g + 1]])) == cu[g + 1] - cu[g]
        assert seg_lens[g] % BS == 0 and seg_lens[g] >= min_blocks * BS
    saved = 0
    for b in range(batch):
        pos = 0
        slots = [s for s in groups.seq_slots[b].tolist() if s >= 0]
        assert len(slots) <= max_levels
        for s in slots:
            g = group_of[s]
            n = seg_lens[g] // BS
            assert rows[b][pos:pos + n] == groups.block_tables[g, :n].tolist()
            pos += n
        assert groups.private_start[b] == pos * BS < lens[b]
    for g in range(len(seg_lens)):
        saved += (cu[g + 1] - cu[g] - 1) * seg_lens[g]
    assert groups.saved_tokens == saved


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), min_blocks=st.integers(1, 3), max_levels=st.integers(1, 4))
def test_groups_are_sound(seed, min_blocks, max_levels):
    rows, lens = random_forest(random.Random(seed), block_size=BS, num_blocks=200, max_rows=14)
    groups = derive_groups(rows, lens, block_size=BS, min_shared_blocks=min_blocks,
                           max_levels=max_levels)
    check_sound(groups, rows, lens, min_blocks, max_levels)
    bt, sl = as_tensors(rows, lens, width=max(len(r) for r in rows) + 2)
    again = derive_groups(bt, sl, block_size=BS, min_shared_blocks=min_blocks, max_levels=max_levels)
    for f in ("block_tables", "shared_lens", "cu_members", "members", "seq_slots", "private_start"):
        assert torch.equal(getattr(groups, f), getattr(again, f)), f


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_min_one_block_finds_every_longest_shared_prefix(seed):
    rows, lens = random_forest(random.Random(seed), block_size=BS, num_blocks=200, max_rows=14)
    groups = derive_groups(rows, lens, block_size=BS, min_shared_blocks=1, max_levels=99)
    check_sound(groups, rows, lens, 1, 99)
    caps = [(n - 1) // BS for n in lens]
    for b, row in enumerate(rows):
        best = max([lcp(row, other, min(caps[b], caps[c]))
                    for c, other in enumerate(rows) if c != b] + [0])
        assert groups.private_start[b] == best * BS, f"row {b}; seed={seed}"


def test_one_system_prompt():
    shared = list(range(100, 132))
    rows = [shared + [200 + i, 300 + i] for i in range(8)]
    lens = [33 * BS + 1 + i % BS for i in range(8)]
    g = derive_groups(torch.tensor(rows, dtype=torch.int32), lens, block_size=BS,
                      min_shared_blocks=8)
    assert g.num_groups == 1 and g.num_levels == 1 and g.max_members == 8
    assert g.block_tables[0].tolist() == shared and g.shared_lens.tolist() == [32 * BS]
    assert g.private_start.tolist() == [32 * BS] * 8 and g.saved_tokens == 7 * 32 * BS
    short = derive_groups(rows, lens, block_size=BS, min_shared_blocks=33)
    assert short.num_groups == 0 and short.private_start.tolist() == [0] * 8


def test_tables_that_break_the_prefix_rule_share_nothing_wrong():
    # Block 2 under two parents; block 9 and block 1 at two depths: no shared prefix there.
    rows = [[1, 2, 3, 7], [4, 2, 3, 8], [5, 6, 11], [5, 6, 12], [1, 13, 9, 6], [9, 1, 14, 10]]
    lens = [16, 16, 12, 12, 16, 16]
    g = derive_groups(rows, lens, block_size=BS, min_shared_blocks=1)
    check_sound(g, rows, lens, 1, 4)
    assert g.block_tables.tolist() == [[5, 6]] and g.members.tolist() == [2, 3]


def test_newest_token_block_is_never_shared():
    rows = [[1, 2, 3], [1, 2, 3]]  # forked rows that have not yet diverged
    g = derive_groups(rows, [12, 9], block_size=BS, min_shared_blocks=1)
    assert g.shared_lens.tolist() == [8] and g.private_start.tolist() == [8, 8]


def test_empty_and_device():
    assert derive_groups([], [], block_size=BS).batch == 0
    g = derive_groups([[1], [1]], [3, 4], block_size=BS, device="cpu")
    assert isinstance(g, PrefixGroups) and g.num_groups == 0 and g.seq_slots.shape == (2, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_tables=[[1, 2]], seq_lens=[5, 6]), "^seq_lens"),
    (dict(block_tables=[[1, 2]], seq_lens=[0]), "^seq_lens"),
    (dict(block_tables=[[1, 2]], seq_lens=[9]), "^seq_lens"),
    (dict(block_tables=[[1, -2, 3], [1, -2, 4]], seq_lens=[9, 9]), "^block_tables"),
    (dict(block_tables=[[1, "x"]], seq_lens=[5]), "^block_tables"),
    (dict(block_tables=torch.ones(2, 2), seq_lens=[5, 5]), "^block_tables"),
    (dict(block_tables="nope", seq_lens=[5]), "^block_tables"),
    (dict(block_tables=[[1, 2]], seq_lens=[5], min_shared_blocks=0), "^min_shared_blocks"),
    (dict(block_tables=[[1, 2]], seq_lens=[5], max_levels=0), "^max_levels"),
    (dict(block_tables=[[1, 2]], seq_lens=[5], block_size=0), "^block_size"),
])
def test_bad_input(kwargs, match):
    kwargs.setdefault("block_size", BS)
    with pytest.raises(ValueError, match=match):
        derive_groups(**kwargs)
