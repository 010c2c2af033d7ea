"""The CPU attention path (kernels/cpu_attention.py) against the per-sequence reference.

Fresh random problems every run (the seed is in each failure message): shuffled blocks, stale
(-1) table tails, mixed prefill chunks and decodes, chunks over cached prefixes, GQA / MQA /
MHA, contexts on and just past block boundaries, shared prefixes read once, every grouping.
References run in float64 on the same (rounded) inputs.
"""

import random

import pytest
import torch

from kernels.cpu_attention import paged_attention_cpu, plan_attention, store_kv_cpu
from kernels.reference import paged_attention_ref, store_kv_ref
from test_kernels_cases import TOL, assert_close, fresh_seed, make_case, poisoned_out

TOL64 = 1e-10


def _share(case, donor: int, rows, blocks: int):
    """Rows take the donor's first `blocks` physical blocks: they share that prefix exactly."""
    for r in rows:
        case.block_tables[r, :blocks] = case.block_tables[donor, :blocks]


def _check(case, dtype, what="", **plan_kw):
    bs, kvh = case.k_cache.shape[1], case.k_cache.shape[2]
    plan = plan_attention(case.block_tables, case.cu_seqlens_q, case.seq_lens, block_size=bs, kv_heads=kvh, **plan_kw)
    out = poisoned_out(case.q)
    res = paged_attention_cpu(*case.args(), scale=case.scale, max_seqlen_q=case.max_seqlen_q, out=out, plan=plan)
    assert res is out
    ref = paged_attention_ref(*case.args(torch.float64), scale=case.scale, max_seqlen_q=case.max_seqlen_q)
    assert_close(out, ref, TOL64 if dtype == torch.float64 else TOL[dtype], case.seed, what)
    return plan


# (n_q, ctx) with block size 8 in mind: on a boundary (16, 32), just past one (17, 33), one
# token, whole prompts (n_q == ctx), chunks over a cached prefix, a sequence with no query.
MIXED = ([5, 1, 16, 1, 3, 9, 0, 1], [5, 32, 16, 17, 33, 24, 8, 1])


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mixed_batch(block_size, dtype):
    case = make_case(*MIXED, block_size=block_size, kv_heads=2, group=2, head_dim=16, dtype=dtype)
    _check(case, dtype, f"mixed B={block_size} {dtype}")


@pytest.mark.parametrize("kv_heads,group,head_dim", [(1, 8, 64), (3, 3, 64), (4, 1, 40), (1, 1, 16)])
def test_gqa_mqa_mha(kv_heads, group, head_dim):
    case = make_case([3, 1, 6, 1], [11, 20, 6, 47], block_size=8, kv_heads=kv_heads, group=group,
                     head_dim=head_dim, dtype=torch.float32)
    _check(case, torch.float32, f"kvh={kv_heads} g={group} d={head_dim}")


RAGGED_DECODES = [1, 7, 8, 9, 16, 17, 40, 64, 65, 3]  # contexts of one-token decodes


def _decode_group_sizes(group_tokens):
    """Checks ragged decodes against the reference under `group_tokens`; their group sizes, sorted."""
    ctx = RAGGED_DECODES
    case = make_case([1] * len(ctx), ctx, block_size=8, kv_heads=3, group=3, head_dim=16, dtype=torch.float32)
    plan = _check(case, torch.float32, f"group_tokens={group_tokens}", group_tokens=group_tokens)
    return sorted(g.n for g in plan.groups)


@pytest.mark.parametrize("group_tokens", [1, 40, 2048, 1 << 40])
def test_every_grouping_of_decodes(group_tokens):
    # ragged decodes: one row per group, a few per group, all in one padded group
    assert sum(_decode_group_sizes(group_tokens)) == len(RAGGED_DECODES)


def test_one_token_groups_put_each_decode_alone():
    assert _decode_group_sizes(1) == [1] * len(RAGGED_DECODES)


def test_an_unbounded_group_holds_every_decode():
    assert _decode_group_sizes(1 << 40) == [len(RAGGED_DECODES)]


def test_decode_rows_out_of_order_in_a_mixed_batch():
    # decodes scattered between chunks: a group's rows are not consecutive in q
    case = make_case([1, 4, 1, 1, 7, 1], [30, 12, 9, 31, 40, 2], block_size=4, kv_heads=2, group=2, head_dim=16,
                     dtype=torch.float32)
    plan = _check(case, torch.float32, "scattered", group_tokens=1 << 40)
    assert isinstance(plan.groups[0].rows, torch.Tensor)


def test_shared_prefix_read_once():
    """Rows sharing a prefix (same physical blocks) beside rows that do not, a second sharing
    group, a chunk over the shared prefix and rows whose shared part ends right before their
    last token: cascades on, equal to the reference."""
    B = 8
    ctx = [70, 41, 57, 65, 33, 90, 26, 50, 40]
    n_q = [1, 1, 1, 1, 1, 1, 1, 1, 6]
    case = make_case(n_q, ctx, block_size=B, kv_heads=3, group=3, head_dim=16, dtype=torch.float32)
    _share(case, 0, [1, 2, 3, 4, 8], 4)  # 32 tokens; row 4 (33 tokens) keeps one private token
    _share(case, 5, [6, 7], 3)
    plan = _check(case, torch.float32, "shared", min_shared_tokens=1)
    members = sorted(sorted(c.rows.tolist()) for c in plan.cascades)
    cu = case.cu_seqlens_q.tolist()
    assert members == [[cu[i] for i in (0, 1, 2, 3, 4)], [cu[i] for i in (5, 6, 7)]]  # the chunk stays plain
    assert sorted(c.tokens for c in plan.cascades) == [24, 32]
    # below the threshold nothing is shared, and the result is the same
    plan = _check(case, torch.float32, "shared off", min_shared_tokens=10**9)
    assert not plan.cascades


def test_shared_prefix_where_rows_diverge():
    # same first block, then the rows part: only the common leading columns are shared
    B = 4
    case = make_case([1] * 5, [30, 30, 29, 25, 18], block_size=B, kv_heads=1, group=4, head_dim=32,
                     dtype=torch.float64)
    _share(case, 0, [1, 2, 3, 4], 2)
    _share(case, 0, [1, 2, 3], 5)
    plan = _check(case, torch.float64, "diverge", min_shared_tokens=1)
    assert [c.tokens for c in plan.cascades] == [2 * B]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_batches(dtype):
    seed = fresh_seed()
    rng = random.Random(seed)
    for _ in range(12):
        bs = rng.choice([1, 2, 8, 16, 32])
        ctx = [rng.randint(1, 160) for _ in range(rng.randint(1, 9))]
        n_q = [rng.choice([1, 1, 1, c, rng.randint(1, c), 0]) for c in ctx]
        if not any(n_q):
            n_q[0] = 1
        case = make_case(n_q, ctx, block_size=bs, kv_heads=rng.randint(1, 3), group=rng.choice([1, 2, 3]),
                         head_dim=rng.choice([16, 64]), dtype=dtype, seed=rng.randrange(2**31))
        donor = max(range(len(ctx)), key=ctx.__getitem__)
        s = rng.randint(0, (ctx[donor] - 1) // bs)
        _share(case, donor, [i for i in range(len(ctx)) if (ctx[i] - n_q[i]) // bs >= s and rng.random() < 0.7], s)
        kw = dict(group_tokens=rng.choice([1, 64, 2048]), min_shared_tokens=rng.choice([0, 1, 1024]))
        _check(case, dtype, f"seed={seed} B={bs} n_q={n_q} ctx={ctx} shared={s} {kw}", **kw)


def test_plan_built_inside_when_not_given():
    case = make_case(*MIXED, block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    out = paged_attention_cpu(*case.args(), scale=case.scale, max_seqlen_q=case.max_seqlen_q)
    ref = paged_attention_ref(*case.args(torch.float64), scale=case.scale, max_seqlen_q=case.max_seqlen_q)
    assert_close(out, ref, TOL[torch.float32], case.seed)


def test_a_given_plan_is_checked_against_the_batch():
    case = make_case(*MIXED, block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    other = make_case([1, 1], [5, 9], block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    plan = plan_attention(other.block_tables, other.cu_seqlens_q, other.seq_lens, block_size=8, kv_heads=2)
    with pytest.raises(ValueError, match="plan"):
        paged_attention_cpu(*case.args(), scale=case.scale, max_seqlen_q=case.max_seqlen_q, plan=plan)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _attend_threads(monkeypatch, what):
    """Checks a small layer against the reference; the intra-op thread count each _attend call saw."""
    import kernels.cpu_attention as ca

    case = make_case([1, 1, 3], [40, 9, 12], block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    seen = []
    real = ca._attend  # no public hook sees the thread count inside the kernel
    monkeypatch.setattr(ca, "_attend", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    _check(case, torch.float32, what)
    return seen


def test_small_layers_run_on_one_thread_and_restore_the_count(monkeypatch, two_threads):
    assert _attend_threads(monkeypatch, "one thread") == [1] and torch.get_num_threads() == 2


def test_large_layers_keep_the_threads(monkeypatch, two_threads):
    import kernels.cpu_attention as ca

    monkeypatch.setattr(ca, "ONE_THREAD_WORK", 0)  # every layer "large": the threads stay
    assert _attend_threads(monkeypatch, "two threads") == [2]


# argument name -> its bad value, made from the good arguments
BAD_ARGUMENTS = {
    "q": lambda good: good["q"][:, :3],
    "v_cache": lambda good: good["v_cache"].half(),
    "block_tables": lambda good: good["block_tables"].long(),
    "seq_lens": lambda good: torch.tensor([1, 9], dtype=torch.int32),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_name_the_argument(name):
    case = make_case([2, 1], [5, 9], block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    q, kc, vc, bt, cu, sl = case.args()
    good = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, cu_seqlens_q=cu, seq_lens=sl)
    out = poisoned_out(q)
    with pytest.raises(ValueError, match=name):
        paged_attention_cpu(**{**good, name: BAD_ARGUMENTS[name](good)}, scale=0.25, max_seqlen_q=2, out=out)
    assert torch.isnan(out).all(), f"{name}: output touched by a rejected call"


def test_non_contiguous_cache_falls_back_to_the_reference():
    case = make_case([3, 1], [7, 20], block_size=8, kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    q, kc, vc, bt, cu, sl = case.args()
    kn, vn = torch.cat([kc, kc], 2)[:, :, :2], torch.cat([vc, vc], 2)[:, :, :2]  # same values, strided blocks
    assert not kn.is_contiguous()
    out = paged_attention_cpu(q, kn, vn, bt, cu, sl, scale=case.scale, max_seqlen_q=case.max_seqlen_q)
    ref = paged_attention_ref(q, kc, vc, bt, cu, sl, scale=case.scale, max_seqlen_q=case.max_seqlen_q)
    torch.testing.assert_close(out, ref)


STORE_SHAPE = (6, 4, 2, 8)
STORE_SLOTS = torch.tensor([3, -1, 17, 0, 22])


def _store_problem(contiguous):
    """(key, value, k_cache, v_cache, reference k_cache, reference v_cache): caches equal, in
    the layout asked for (non-contiguous: strided views of wider tensors)."""
    g = torch.Generator().manual_seed(fresh_seed())
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    kc_ref, vc_ref = torch.randn(STORE_SHAPE, generator=g), torch.randn(STORE_SHAPE, generator=g)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    if not contiguous:
        kc, vc = torch.cat([kc, kc], -1)[..., :8], torch.cat([vc, vc], -1)[..., :8]
        assert not kc.is_contiguous()
    return key, value, kc, vc, kc_ref, vc_ref


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_store_kv_matches_reference(contiguous):
    key, value, kc, vc, kc_ref, vc_ref = _store_problem(contiguous)
    store_kv_ref(key, value, kc_ref, vc_ref, STORE_SLOTS)
    store_kv_cpu(key, value, kc, vc, STORE_SLOTS)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_kv_through_a_plan():
    """The plan's slots were checked once for the step; each kept token lands in its slot."""
    key, value, *_ = _store_problem(True)
    slots = STORE_SLOTS
    kc2, vc2 = torch.zeros(STORE_SHAPE), torch.zeros(STORE_SHAPE)
    plan = plan_attention(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32), block_size=4, kv_heads=2, slot_mapping=slots)
    store_kv_cpu(key, value, kc2, vc2, slots, plan)
    keep = slots >= 0
    assert torch.equal(kc2.view(-1, 2, 8)[slots[keep]], key[keep])


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_store_kv_refuses_the_same_slot_twice(contiguous):
    key, value, kc, vc, _, _ = _store_problem(contiguous)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cpu(key, value, kc, vc, torch.tensor([3, 3, 1, 2, 4]))


def test_engine_plans_once_per_step_and_matches_the_reference_backend(tiny_llama_dir, monkeypatch,
                                                                      one_torch_thread):
    """Chats after a shared system prompt through the engine: the torch backend (one plan per
    step, shared prefixes read once) gives the reference backend's tokens."""
    import kernels.cpu_attention as ca
    from radixkv.engine.engine import Engine
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.sampling_params import SamplingParams

    plans = []
    real = ca.plan_attention
    monkeypatch.setattr(ca, "plan_attention", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    monkeypatch.setattr(ca, "MIN_SHARED_TOKENS", 64)
    rng = random.Random(0)
    system = [rng.randrange(3, 2048) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 2048) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    got = {}
    for backend in ("torch", "reference"):
        e = Engine(EngineConfig(model_dir=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=8,
                                num_blocks=96, attention_backend=backend, seed=0))
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        steps, done = 0, {}
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
        got[backend] = [done[f"r{i}"] for i in range(len(prompts))]
        if backend == "torch":
            assert 0 < len(plans) <= steps  # one plan per step, not one per layer
            assert any(p.cascades for p in plans)
    assert got["torch"] == got["reference"]


def test_small_cpu_steps_run_on_one_thread(tiny_llama_dir):
    """A decode of a few rows runs on one intra-op thread (model_runner's NOTE); a prefill keeps
    the caller's threads, and the count is restored after every step."""
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.engine.model_runner import SMALL_STEP_TOKENS
    from radixkv.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        e = Engine(EngineConfig(model_dir=str(tiny_llama_dir), device="cpu", dtype="float32", num_blocks=64))
        model, seen = e.runner.model, []
        forward = model.forward
        model.forward = lambda ids, *a: seen.append((ids.shape[0], torch.get_num_threads())) or forward(ids, *a)
        e.add_request("r", list(range(3, 3 + 2 * SMALL_STEP_TOKENS)), SamplingParams(temperature=0.0, max_tokens=4))
        while e.has_unfinished_requests():
            e.step()
            assert torch.get_num_threads() == 2
        assert seen[0] == (2 * SMALL_STEP_TOKENS, 2) and seen[1:] == [(1, 1)] * 3
    finally:
        torch.set_num_threads(threads)
