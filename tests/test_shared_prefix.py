"""Shared-prefix decode against its torch reference and the plain paged reference.

Without CUDA the kernels run in Triton's interpreter (fp32 exact); with CUDA the same
tests run on the GPU. Every case draws a fresh seed, printed on failure.
"""

import random
from dataclasses import replace

import pytest
import torch

from kernels.reference import paged_attention_ref
from kernels.shared_prefix import (PrefixGroups, SharedPrefixConfig, derive_groups,
                                   shared_prefix_decode, shared_prefix_decode_ref)
from test_kernels_cases import assert_close, fresh_seed, poisoned_out
from test_shared_prefix_cases import hand_groups, make_problem, random_forest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 is exact in the interpreter; on the GPU a fp32 tl.dot runs in TF32.
TOL32 = 1e-5 if DEVICE == "cpu" else 2e-3
SMALL = SharedPrefixConfig(block_m=16, block_n=16, shared_split_len=16, private_block_n=16)


def plain(p):
    cu = torch.arange(p.q.shape[0] + 1, dtype=torch.int32, device=p.q.device)
    return paged_attention_ref(p.q.double(), p.k_cache.double(), p.v_cache.double(),
                               p.block_tables, cu, p.seq_lens, scale=p.scale, max_seqlen_q=1)


def run_both(p, groups, tol, config=None, **kw):
    """Every launch path: one launch then a merge, two streams then a merge, and shared then
    private programs that merge."""
    ref = shared_prefix_decode_ref(p.q.double(), p.k_cache.double(), p.v_cache.double(), groups,
                                   p.block_tables, p.seq_lens, scale=p.scale)
    assert_close(ref, plain(p), 1e-12, p.seed, "shared reference vs plain paged reference")
    config = config or SharedPrefixConfig()
    for cfg in (config, replace(config, overlap=not config.overlap),
                replace(config, streams=not config.streams)):
        out = poisoned_out(p.q)
        got = shared_prefix_decode(p.q, p.k_cache, p.v_cache, groups, p.block_tables, p.seq_lens,
                                   scale=p.scale, out=out, config=cfg, **kw)
        assert got is out
        assert_close(out, ref, tol, p.seed,
                     f"kernel (overlap={cfg.overlap}, streams={cfg.streams}) vs shared reference")
    return out


@pytest.mark.parametrize("kv_heads,qpk,head_dim,block_size,min_blocks,config", [
    (2, 2, 16, 4, 1, SMALL),
    (1, 5, 24, 8, 2, SMALL),
    (2, 3, 32, 4, 1, SharedPrefixConfig(block_m=32, block_n=32, shared_split_len=24,
                                        private_split_len=8, private_block_n=16)),
    (2, 4, 16, 2, 3, None),
    # several rows per private program: ragged parts, a partial last tile of rows, keys per
    # row and step (16 / 4) that do not align with the block size 8, and with splits
    (1, 3, 16, 8, 1, SharedPrefixConfig(block_m=16, block_n=16, private_block_n=16, private_rows=4)),
    (2, 2, 16, 4, 1, SharedPrefixConfig(block_m=16, block_n=16, private_block_n=32, private_rows=8,
                                        private_split_len=8)),
])
def test_random_groupings_match_references(kv_heads, qpk, head_dim, block_size, min_blocks, config):
    seed = fresh_seed()
    rng = random.Random(seed)
    while True:  # redraw until something is shared
        rows, lens = random_forest(rng, block_size=block_size, num_blocks=80)
        if derive_groups(rows, lens, block_size=block_size, min_shared_blocks=min_blocks).num_groups:
            break
    p = make_problem(rows, lens, block_size=block_size, num_blocks=80, kv_heads=kv_heads,
                     qpk=qpk, head_dim=head_dim, dtype=torch.float32, device=DEVICE, seed=seed)
    groups = derive_groups(p.block_tables.cpu(), p.seq_lens.cpu(), block_size=block_size,
                           min_shared_blocks=min_blocks, device=DEVICE)
    run_both(p, groups, TOL32, config)


def test_tree_of_three_levels():
    # system prompt -> two few-shot sets -> pairs of chats -> private tails
    seed = fresh_seed()
    rows = [[0, 1, 2, 10, 11, 20, 30], [0, 1, 2, 10, 11, 20, 31, 32], [0, 1, 2, 10, 11, 21, 33],
            [0, 1, 2, 12, 34], [0, 1, 2, 12, 35, 36], [0, 1, 2, 10, 11, 20, 37]]
    lens = [(len(r) - 1) * 4 + 1 + i % 4 for i, r in enumerate(rows)]
    p = make_problem(rows, lens, block_size=4, num_blocks=40, kv_heads=2, qpk=2, head_dim=16,
                     dtype=torch.float32, device=DEVICE, seed=seed)
    groups = derive_groups(p.block_tables.cpu(), p.seq_lens.cpu(), block_size=4,
                           min_shared_blocks=1, device=DEVICE)
    assert groups.num_levels == 3
    assert sorted(groups.shared_lens.tolist()) == [4, 4, 8, 12]  # {20}, {12}, {10,11}, {0,1,2}
    run_both(p, groups, TOL32, SMALL)


def test_group_of_one_and_no_groups():
    seed = fresh_seed()
    rows = [[5, 6, 7, 1], [5, 6, 2], [3, 8]]
    lens = [13, 10, 7]
    p = make_problem(rows, lens, block_size=4, num_blocks=10, kv_heads=2, qpk=2, head_dim=16,
                     dtype=torch.float32, device=DEVICE, seed=seed)
    one = hand_groups([([5, 6, 7], 12, [0])], 3, DEVICE)  # a single member, longer than row 1's share
    run_both(p, one, TOL32, SMALL)
    out = run_both(p, PrefixGroups.empty(3, DEVICE), TOL32, SMALL)
    run_both(p, one, TOL32, max_private_len=1024)  # default config: a small batch splits
    assert derive_groups([[1, 2]], [5], block_size=4).num_groups == 0  # a batch of one
    assert out.shape == p.q.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    seed = fresh_seed()
    rows, lens = random_forest(random.Random(seed), block_size=8, num_blocks=60, max_rows=6)
    p = make_problem(rows, lens, block_size=8, num_blocks=60, kv_heads=2, qpk=4, head_dim=32,
                     dtype=dtype, device=DEVICE, seed=seed)
    groups = derive_groups(p.block_tables.cpu(), p.seq_lens.cpu(), block_size=8,
                           min_shared_blocks=1, device=DEVICE)
    run_both(p, groups, 1e-2, SMALL)


def test_wide_gqa_and_private_splits():
    # 16 query heads per kv head: one member per shared tile; the private part in splits.
    seed = fresh_seed()
    rows = [[0, 1, 2, 3, 9], [0, 1, 2, 3, 8, 7], [0, 1, 4]]
    p = make_problem(rows, [18, 22, 9], block_size=4, num_blocks=10, kv_heads=1, qpk=16,
                     head_dim=16, dtype=torch.float32, device=DEVICE, seed=seed)
    groups = derive_groups(p.block_tables.cpu(), p.seq_lens.cpu(), block_size=4,
                           min_shared_blocks=1, device=DEVICE)
    assert groups.num_levels == 2
    cfg = SharedPrefixConfig(block_m=16, block_n=16, shared_split_len=4, private_split_len=4,
                             private_block_n=16)
    run_both(p, groups, TOL32, cfg, max_private_len=40)  # 3 splits, some of them empty


def test_bad_input_names_the_argument_and_writes_nothing():
    seed = fresh_seed()
    rows = [[0, 1, 2], [0, 1, 3]]
    p = make_problem(rows, [10, 11], block_size=4, num_blocks=4, kv_heads=2, qpk=2, head_dim=16,
                     dtype=torch.float32, device="cpu", seed=seed)
    groups = derive_groups(p.block_tables, p.seq_lens, block_size=4)
    out = torch.zeros_like(p.q)
    args = dict(q=p.q, k_cache=p.k_cache, v_cache=p.v_cache, groups=groups,
                block_tables=p.block_tables, seq_lens=p.seq_lens)

    def bad(match, **change):
        kw = {**args, **change}
        with pytest.raises(ValueError, match=match):
            shared_prefix_decode(kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), kw.pop("groups"),
                                 kw.pop("block_tables"), kw.pop("seq_lens"),
                                 scale=kw.pop("scale", p.scale), out=out)
        assert not out.any(), "a rejected call wrote its output"

    bad("^scale", scale=0.0)
    bad("^block_tables", block_tables=p.block_tables.long())
    bad("^seq_lens", seq_lens=p.seq_lens[:1])
    bad("^seq_lens", seq_lens=torch.tensor([10, 99], dtype=torch.int32))
    bad("^q", q=p.q[:, :3])
    bad("^groups$|^groups:", groups="not groups")
    bad("^groups.private_start", groups=PrefixGroups(**{**vars(groups),
        "private_start": groups.private_start + 4}))
    bad("^groups.seq_slots", groups=PrefixGroups(**{**vars(groups),
        "seq_slots": groups.seq_slots.flip(0)}))
    bad("^groups.max_members", groups=PrefixGroups(**{**vars(groups), "max_members": 1}))
    bad("^groups.block_tables", groups=PrefixGroups(**{**vars(groups),
        "block_tables": groups.block_tables + 9}))
    long_share = hand_groups([([0, 1, 2], 11, [0, 1])], 2)  # would leave row 0 nothing private
    bad("^groups.private_start", groups=long_share)
    with pytest.raises(ValueError, match="^config.block_m"):
        shared_prefix_decode(p.q, p.k_cache, p.v_cache, groups, p.block_tables, p.seq_lens,
                             scale=p.scale, out=out, config=SharedPrefixConfig(block_m=24))
    assert not out.any()


def test_padded_groups_give_the_same_result():
    # Fixed shapes for a captured graph: extra empty groups, unnamed slots, extra levels.
    seed = fresh_seed()
    rng = random.Random(seed)
    while True:
        rows, lens = random_forest(rng, block_size=4, num_blocks=60, max_rows=7)
        groups = derive_groups(rows, lens, block_size=4, min_shared_blocks=1)
        if groups.num_groups:
            break
    p = make_problem(rows, lens, block_size=4, num_blocks=60, kv_heads=2, qpk=2, head_dim=16,
                     dtype=torch.float32, device=DEVICE, seed=seed)
    g, m, lv = groups.num_groups, groups.members.shape[0], groups.num_levels
    padded = groups.to(DEVICE).padded(num_groups=g + 2, num_members=m + 5, num_levels=lv + 1,
                                      max_members=groups.max_members + 9,
                                      max_shared_len=groups.max_shared_len + 40)
    assert padded.cu_members.tolist()[-3:] == [m, m, m + 5] and padded.num_levels == lv + 1
    run_both(p, padded, TOL32, SMALL)
    with pytest.raises(ValueError, match="^num_groups"):
        groups.padded(num_groups=g - 1, num_members=m, num_levels=lv)
    with pytest.raises(ValueError, match="^num_groups"):
        groups.padded(num_groups=g, num_members=m + 1, num_levels=lv)
    with pytest.raises(ValueError, match="^max_members"):
        groups.padded(num_groups=g + 1, num_members=m + 1, num_levels=lv, max_members=0)


def test_short_hints_stay_correct():
    # Private parts of ~40 tokens under a 20-token hint in 16-token splits; a shared length
    # bound below the real one. The last split of each runs to the end.
    seed = fresh_seed()
    rows = [[0, 1, 2, 3] + list(range(10 + 11 * i, 21 + 11 * i)) for i in range(3)]
    p = make_problem(rows, [58, 60, 57], block_size=4, num_blocks=60, kv_heads=2, qpk=2,
                     head_dim=16, dtype=torch.float32, device=DEVICE, seed=seed)
    groups = derive_groups(p.block_tables.cpu(), p.seq_lens.cpu(), block_size=4,
                           min_shared_blocks=1, device=DEVICE)
    short = replace(groups, max_shared_len=8)  # passes on a device, where nothing is checked
    cfg = replace(SMALL, shared_split_len=4, private_split_len=16)
    out = poisoned_out(p.q)
    shared_prefix_decode(p.q, p.k_cache, p.v_cache, short if DEVICE != "cpu" else groups,
                         p.block_tables, p.seq_lens, scale=p.scale, out=out, config=cfg,
                         max_private_len=20)
    assert_close(out, plain(p), TOL32, seed, "short hints")
    # A hint of one token asks for the most rows per private program: still at least one key
    # per row and step (multi-head attention: one query head per kv head).
    mha = make_problem(rows, [58, 60, 57], block_size=4, num_blocks=60, kv_heads=2, qpk=1,
                       head_dim=16, dtype=torch.float32, device=DEVICE, seed=seed)
    out = poisoned_out(mha.q)
    shared_prefix_decode(mha.q, mha.k_cache, mha.v_cache, groups, mha.block_tables, mha.seq_lens,
                         scale=mha.scale, out=out, config=SMALL, max_private_len=1)
    assert_close(out, plain(mha), TOL32, seed, "one-token hint, MHA")
    with pytest.raises(ValueError, match="^groups.max_shared_len|^groups.shared_lens"):
        shared_prefix_decode(p.q.cpu(), p.k_cache.cpu(), p.v_cache.cpu(), replace(groups.to("cpu"),
                             max_shared_len=8), p.block_tables.cpu(), p.seq_lens.cpu(), scale=p.scale)
    with pytest.raises(ValueError, match="^max_private_len"):
        shared_prefix_decode(p.q, p.k_cache, p.v_cache, groups, p.block_tables, p.seq_lens,
                             scale=p.scale, max_private_len=0)
