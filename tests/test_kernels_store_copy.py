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


def test_store_kv_rejects_bad_input_and_changes_nothing():
    g = torch.Generator().manual_seed(fresh_seed())
    key, value, kc, vc, slots = _store_problem(g, torch.float32)
    before = kc.clone(), vc.clone()
    too_far = slots.clone()
    too_far[0] = kc.shape[0] * kc.shape[1]
    dup = slots.clone()
    dup[1] = dup[0] = 3
    cases = {
        "slot_mapping": [(key, value, kc, vc, too_far), (key, value, kc, vc, dup),
                         (key, value, kc, vc, slots[:-1]), (key, value, kc, vc, slots.float())],
        "key": [(key.half(), value, kc, vc, slots), (key[:, :1], value, kc, vc, slots)],
        "value": [(key, value[:-1], kc, vc, slots)],
        "v_cache": [(key, value, kc, vc[:-1], slots)],
    }
    for fn in (store_kv, store_kv_ref):
        for name, arg_sets in cases.items():
            for args in arg_sets:
                with pytest.raises(ValueError, match=name):
                    fn(*args)
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


def test_copy_blocks_rejects_bad_input_and_changes_nothing():
    g = torch.Generator().manual_seed(fresh_seed())
    cache = _kv_cache(g, torch.float32)
    before = cache.clone()
    bad = [
        torch.tensor([[0, 10]]),            # dst out of range
        torch.tensor([[1, 2], [3, 2]]),     # same destination twice
        torch.tensor([[1, 2], [2, 3]]),     # a destination is also a source
        torch.tensor([[1, 2]], dtype=torch.int32),
        torch.tensor([1, 2]),
    ]
    for fn in (copy_blocks, copy_blocks_ref):
        for mapping in bad:
            with pytest.raises(ValueError, match="block_mapping"):
                fn(cache, mapping)
        with pytest.raises(ValueError, match="kv_cache"):
            fn(cache[:, :1], torch.tensor([[1, 2]]))
    assert torch.equal(cache, before)
