"""Paged attention (Triton, run by the interpreter on the CPU) against the torch reference.

Shapes are small: the interpreter costs ~ms per program x KV tile. Outputs are poisoned
with NaN before each run; references run in float64 on the same (rounded) inputs.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import paged_attention
from kernels.attention_config import AttentionConfig
from kernels.reference import paged_attention_ref, store_kv_ref
from test_kernels_cases import TOL, assert_close, fresh_seed, make_case, poisoned_out


def run_and_check(case, dtype, config=None, what=""):
    out = poisoned_out(case.q)
    res = paged_attention(*case.args(), scale=case.scale, max_seqlen_q=case.max_seqlen_q,
                          out=out, config=config)
    assert res is out
    ref = paged_attention_ref(*case.args(torch.float64), scale=case.scale,
                              max_seqlen_q=case.max_seqlen_q)
    assert_close(out, ref, TOL[dtype], case.seed, what)


# (n_q per sequence, context per sequence) with block size 8 in mind: contexts that end
# exactly on a block boundary (16, 32), just past one (17, 33), a single token, chunks with
# an empty prefix (n_q == ctx) and chunks over a cached prefix.
MIXED = ([5, 1, 16, 1, 3, 9, 0], [5, 32, 16, 17, 33, 24, 8])
DECODE = ([1, 1, 1, 1, 1], [1, 16, 17, 40, 33])


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch(block_size, dtype):
    case = make_case(*MIXED, block_size=block_size, kv_heads=2, group=2, head_dim=16, dtype=dtype)
    run_and_check(case, dtype, what=f"mixed B={block_size} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch(dtype):
    case = make_case(*DECODE, block_size=16, kv_heads=2, group=2, head_dim=16, dtype=dtype)
    run_and_check(case, dtype, what="decode")


@pytest.mark.parametrize("kv_heads,group,head_dim", [(1, 8, 64), (2, 4, 128), (4, 1, 40), (1, 3, 16)])
def test_gqa_mqa_and_head_dims(kv_heads, group, head_dim):
    # MQA (one kv head), GQA 4 at head dim 128, plain MHA with a padded head dim, odd group.
    case = make_case([3, 1, 6], [11, 20, 6], block_size=8, kv_heads=kv_heads, group=group,
                     head_dim=head_dim, dtype=torch.float16)
    run_and_check(case, torch.float16, what=f"kvh={kv_heads} g={group} d={head_dim}")


def test_full_cache_prefix():
    # Every slot of every table is used: contexts fill max_blocks * block_size exactly.
    case = make_case([1, 4, 2], [32, 32, 32], block_size=8, kv_heads=2, group=2, head_dim=16,
                     dtype=torch.float32, spare_blocks=0)
    assert case.block_tables.min() >= 0
    run_and_check(case, torch.float32, what="full cache")


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("decode", [True, False])
def test_split_kv(splits, decode):
    # Some splits are empty for short contexts: the reduce must ignore them.
    n_q, ctx = (DECODE if decode else MIXED)
    case = make_case(n_q, ctx, block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.bfloat16)
    cfg = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=splits)
    run_and_check(case, torch.bfloat16, config=cfg, what=f"splits={splits}")


def test_default_config_splits_small_decode_batch():
    # Two long decodes on the interpreter's pretend 4-SM device: the default takes split-KV.
    case = make_case([1, 1], [1030, 600], block_size=32, kv_heads=1, group=2, head_dim=16,
                     dtype=torch.float32)
    from kernels.attention_config import default_config
    cfg = default_config(case.q.device, num_seqs=2, kv_heads=1, group=2, head_dim=16,
                         max_seqlen_q=1, max_context=case.block_tables.shape[1] * 32, is_decode=True)
    assert cfg.num_splits > 1
    run_and_check(case, torch.float32, what="default split")


def test_larger_tiles_than_context():
    # block_n spans several paged blocks and more than the whole context.
    case = make_case(*MIXED, block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    run_and_check(case, torch.float32, config=AttentionConfig(32, 64, 4, 1), what="big tiles")


def test_reference_matches_sdpa_on_contiguous_kv():
    # The reference itself, against torch SDPA on contiguous K/V written through store_kv_ref.
    g = torch.Generator().manual_seed(fresh_seed())
    kvh, group, d, bs = 2, 3, 16, 8
    ctx, n_q = [13, 24, 1], [4, 24, 1]
    k_cache = torch.zeros(12, bs, kvh, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.randperm(12, generator=g)[:9].view(3, 3).to(torch.int32)
    qs, outs = [], []
    for i, (c, n) in enumerate(zip(ctx, n_q)):
        k = torch.randn(c, kvh, d, generator=g, dtype=torch.float64)
        v = torch.randn(c, kvh, d, generator=g, dtype=torch.float64)
        q = torch.randn(n, kvh * group, d, generator=g, dtype=torch.float64)
        pos = torch.arange(c)
        slots = (tables[i, pos // bs].long() * bs + pos % bs)
        store_kv_ref(k, v, k_cache, v_cache, slots)
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=True)
        qs.append(q)
        outs.append(o.transpose(0, 1))
    cu = torch.tensor([0, 4, 28, 29], dtype=torch.int32)
    ref = paged_attention_ref(torch.cat(qs), k_cache, v_cache, tables, cu,
                              torch.tensor(ctx, dtype=torch.int32), scale=d ** -0.5, max_seqlen_q=24)
    torch.testing.assert_close(ref, torch.cat(outs), rtol=1e-10, atol=1e-10)


ATTENTION_FNS = pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref], ids=["triton", "reference"])

# argument name -> its bad value, made from the good arguments
BAD_ARGUMENTS = {
    "q": lambda good: good["q"][:, :3],                                       # 3 heads over 2 kv heads
    "v_cache": lambda good: good["v_cache"].half(),
    "block_tables": lambda good: good["block_tables"].long(),
    "cu_seqlens_q": lambda good: torch.tensor([0, 2, 4], dtype=torch.int32),  # overshoots T = 3
    "seq_lens": lambda good: torch.tensor([1, 9], dtype=torch.int32),         # shorter than its chunk
}


def _good_arguments():
    case = make_case([2, 1], [5, 9], block_size=8, kv_heads=2, group=2, head_dim=16,
                     dtype=torch.float32)
    q, kc, vc, bt, cu, sl = case.args()
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, cu_seqlens_q=cu, seq_lens=sl)


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
@ATTENTION_FNS
def test_bad_arguments_name_the_argument(fn, name):
    good = _good_arguments()
    out = poisoned_out(good["q"])
    with pytest.raises(ValueError, match=name):
        fn(**{**good, name: BAD_ARGUMENTS[name](good)}, scale=0.25, max_seqlen_q=2, out=out)
    assert torch.isnan(out).all(), f"{name}: output touched by a rejected call"


@ATTENTION_FNS
def test_a_max_seqlen_q_below_a_chunk_is_refused(fn):
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fn(**_good_arguments(), scale=0.25, max_seqlen_q=1)


@ATTENTION_FNS
def test_a_max_seqlen_q_past_32_bit_offsets_is_refused(fn):
    good = _good_arguments()
    with pytest.raises(ValueError, match="max_seqlen_q.*2\\^31"):  # in-chunk offsets are 32-bit
        fn(**good, scale=0.25, max_seqlen_q=2 ** 31 // good["q"].stride(0))


@ATTENTION_FNS
def test_a_negative_scale_is_refused(fn):
    with pytest.raises(ValueError, match="scale"):
        fn(**_good_arguments(), scale=-1.0, max_seqlen_q=2)


@ATTENTION_FNS
def test_an_out_of_the_wrong_shape_is_refused(fn):
    with pytest.raises(ValueError, match="out"):
        fn(**_good_arguments(), scale=0.25, max_seqlen_q=2, out=torch.empty(3, 4, 8))


def test_random_ragged_batches():
    # Fresh shapes every run: block sizes, ragged contexts, decode/chunk/full-prompt mixes.
    import random
    seed = fresh_seed()
    rng = random.Random(seed)
    for _ in range(4):
        bs = rng.choice([8, 16, 32])
        ctx = [rng.randint(1, 150) for _ in range(rng.randint(1, 6))]
        n_q = [rng.choice([1, c, rng.randint(1, c), 0]) for c in ctx]
        if not any(n_q):
            n_q[0] = 1
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        case = make_case(n_q, ctx, block_size=bs, kv_heads=rng.randint(1, 2),
                         group=rng.choice([1, 2, 4]), head_dim=rng.choice([16, 32]), dtype=dtype,
                         seed=rng.randrange(2**31))
        cfg = None
        if rng.random() < 0.5:
            cfg = AttentionConfig(block_m=rng.choice([16, 32]), block_n=rng.choice([16, 32, 64]),
                                  num_warps=4, num_stages=1, num_splits=rng.choice([1, 2, 4]))
        run_and_check(case, dtype, config=cfg,
                      what=f"batch seed={seed} B={bs} n_q={n_q} ctx={ctx} cfg={cfg}")
