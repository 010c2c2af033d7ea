"""store_kv and copy_blocks (Triton, interpreted on the CPU) against their references."""

import pytest
import torch

from kernels import copy_blocks, store_kv
from kernels.reference import copy_blocks_ref, store_kv_ref
from test_kernels_cases import fresh_seed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _store_problem(g, dtype, *, num_blocks=6, block_size=8, kv_heads=2, head_dim=16, tokens=20):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < 0.25] = -1  # skipped tokens (padding)
    # key/value as strided views of one fused projection output, like the model makes them
    kv = torch.randn(tokens, 3, kv_heads, head_dim, generator=g).to(dtype)
    return kv[:, 0], kv[:, 2], k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference(dtype, slot_dtype):
    seed = fresh_seed()
    key, value, kc, vc, slots = _store_problem(torch.Generator().manual_seed(seed), dtype)
    slots = slots.to(slot_dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(key, value, kc, vc, slots)
    store_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"seed={seed}"
    # every kept token landed where its slot says; skipped tokens wrote nothing
    bs = kc.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // bs, s % bs], key[t]) and torch.equal(vc[s // bs, s % bs], value[t])


def test_store_kv_head_dim_not_power_of_two():
    g = torch.Generator().manual_seed(fresh_seed())
    key, value, kc, vc, slots = _store_problem(g, torch.float16, kv_heads=3, head_dim=40)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(key, value, kc, vc, slots)
    store_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def _slot_past_the_cache(slots, kc):
    bad = slots.clone()
    bad[0] = kc.shape[0] * kc.shape[1]
    return bad


def _slot_twice(slots):
    bad = slots.clone()
    bad[1] = bad[0] = 3
    return bad


STORE_FNS = pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "reference"])

# (the argument the error names, bad arguments made from the good (key, value, kc, vc, slots))
BAD_STORES = [
    pytest.param("slot_mapping", lambda k, v, kc, vc, s: (k, v, kc, vc, _slot_past_the_cache(s, kc)), id="slot-past-the-cache"),
    pytest.param("slot_mapping", lambda k, v, kc, vc, s: (k, v, kc, vc, _slot_twice(s)), id="slot-twice"),
    pytest.param("slot_mapping", lambda k, v, kc, vc, s: (k, v, kc, vc, s[:-1]), id="slots-one-short"),
    pytest.param("slot_mapping", lambda k, v, kc, vc, s: (k, v, kc, vc, s.float()), id="float-slots"),
    pytest.param("key", lambda k, v, kc, vc, s: (k.half(), v, kc, vc, s), id="half-key"),
    pytest.param("key", lambda k, v, kc, vc, s: (k[:, :1], v, kc, vc, s), id="key-one-head"),
    pytest.param("value", lambda k, v, kc, vc, s: (k, v[:-1], kc, vc, s), id="value-one-token-short"),
    pytest.param("v_cache", lambda k, v, kc, vc, s: (k, v, kc, vc[:-1], s), id="v_cache-one-block-short"),
]


@pytest.mark.parametrize("name, bad_args", BAD_STORES)
@STORE_FNS
def test_store_kv_rejects_bad_input_and_changes_nothing(fn, name, bad_args):
    g = torch.Generator().manual_seed(fresh_seed())
    key, value, kc, vc, slots = _store_problem(g, torch.float32)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=name):
        fn(*bad_args(key, value, kc, vc, slots))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def _kv_cache(g, dtype, layers=3, num_blocks=10, block_size=8, kv_heads=2, head_dim=16):
    return torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    cache = _kv_cache(g, dtype)
    perm = torch.randperm(cache.shape[2], generator=g)
    mapping = torch.stack([perm[:4], perm[4:8]], dim=1)  # distinct srcs and dsts
    expect = cache.clone()
    copy_blocks_ref(expect, mapping)
    for layer in range(cache.shape[0]):
        for src, dst in mapping.tolist():
            assert torch.equal(expect[layer, :, dst], cache[layer, :, src])
    copy_blocks(cache, mapping)
    assert torch.equal(cache, expect), f"seed={seed}"


def test_copy_blocks_one_source_many_destinations_and_empty():
    # COW after a fork: one shared partial block copied for several children.
    g = torch.Generator().manual_seed(fresh_seed())
    cache = _kv_cache(g, torch.float16, layers=2, block_size=16)
    expect = cache.clone()
    mapping = torch.tensor([[2, 5], [2, 7], [0, 9]], dtype=torch.int64)
    copy_blocks(cache, mapping)
    copy_blocks_ref(expect, mapping)
    assert torch.equal(cache, expect)
    copy_blocks(cache, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(cache, expect)


COPY_FNS = pytest.mark.parametrize("fn", [copy_blocks, copy_blocks_ref], ids=["triton", "reference"])

BAD_MAPPINGS = [
    pytest.param(torch.tensor([[0, 10]]), id="dst-out-of-range"),
    pytest.param(torch.tensor([[1, 2], [3, 2]]), id="same-dst-twice"),
    pytest.param(torch.tensor([[1, 2], [2, 3]]), id="dst-also-a-src"),
    pytest.param(torch.tensor([[1, 2]], dtype=torch.int32), id="int32"),
    pytest.param(torch.tensor([1, 2]), id="one-dimensional"),
]


@pytest.mark.parametrize("mapping", BAD_MAPPINGS)
@COPY_FNS
def test_copy_blocks_rejects_a_bad_mapping_and_changes_nothing(fn, mapping):
    cache = _kv_cache(torch.Generator().manual_seed(fresh_seed()), torch.float32)
    before = cache.clone()
    with pytest.raises(ValueError, match="block_mapping"):
        fn(cache, mapping)
    assert torch.equal(cache, before)


@COPY_FNS
def test_copy_blocks_rejects_a_cache_of_keys_only_and_changes_nothing(fn):
    cache = _kv_cache(torch.Generator().manual_seed(fresh_seed()), torch.float32)
    before = cache.clone()
    with pytest.raises(ValueError, match="kv_cache"):
        fn(cache[:, :1], torch.tensor([[1, 2]]))
    assert torch.equal(cache, before)
