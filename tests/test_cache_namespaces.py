"""Namespaces live only while they hold a cached block or a live sequence: one-shot salts
leave the manager's memory and the cost of stats() flat. Block size 4."""

import tracemalloc

import pytest

from radixkv.cache import KVCacheManager
from test_cache_cases import B, make  # noqa: F401 - make is a fixture


def one_shot(m, i, length):
    """A tenant seen once: its own salt, a prompt computed whole, then gone."""
    prompt = [i % 1000, 7, 8, 9, 10, 11][:length]
    assert m.try_admit(i, prompt, salt=f"user-{i}")
    m.mark_tokens_computed(i, prompt[m.num_computed_tokens(i) :])
    m.free(i)


def internal_sizes(m):
    """Sizes of every structure that could grow per tenant (the LRU has no public size)."""
    return (m.num_namespaces, m.num_sequences, len(m.tree.lru), m.num_cached_blocks, m.num_free_blocks,
            len(m.stats().per_salt))


def test_namespace_goes_with_its_last_sequence_and_block(make):
    m = make(8)
    m.add_sequence("a", [1, 2, 3], salt="t")  # less than a block: nothing to cache
    assert m.num_namespaces == 1
    m.fork("a", "b")
    m.free("a")
    assert m.num_namespaces == 1  # b still lives in it
    m.free("b")
    assert m.num_namespaces == 0 and m.stats().per_salt == {}
    assert m.try_admit("c", list(range(9)), salt="t")
    m.mark_tokens_computed("c", list(range(9)))
    m.free("c")
    assert m.num_namespaces == 1 and m.stats().per_salt["t"].cached_blocks == 2  # cached: kept
    assert m.peek_prefix(list(range(9)), salt="t") == 8
    m.add_sequence("d", [5] * 32)  # another tenant takes the whole pool: t's blocks are evicted
    assert m.try_reserve("d", 32)
    assert m.num_namespaces == 1 and "t" not in m.stats().per_salt  # only d's (no salt)
    m.check_invariants()


def test_reset_drops_namespaces_without_a_live_sequence(make):
    m = make(16)
    for salt in ("x", "y"):
        assert m.try_admit(salt, list(range(9)), salt=salt)
        m.mark_tokens_computed(salt, list(range(9)))
    m.free("x")
    m.add_sequence("z", [1], salt="z")  # a live sequence that holds no block
    m.free("y")
    assert m.num_namespaces == 3
    assert m.reset_prefix_cache()
    assert m.num_namespaces == 1 and set(m.stats().per_salt) == {"z"}
    m.free("z")
    assert m.num_namespaces == 0
    m.check_invariants()


def test_refused_admission_leaves_no_namespace(make):
    m = make(2)
    assert not m.try_admit("a", list(range(13)), salt="new")  # 4 blocks, 2 in the pool
    assert m.num_namespaces == 0 and "a" not in m
    assert m.blocks_short_to_admit(list(range(13)), salt="new") == 2


@pytest.fixture(scope="module")
def one_shots():
    """100,000 tenants seen once each, half caching a block that later ones evict. Returns
    (the manager, {"sizes": (after 1k, after 100k), "memory": (after 1k, after 100k)})."""
    m = KVCacheManager(64, B)
    tracemalloc.start()
    try:
        for i in range(1_000):
            one_shot(m, i, 1 + i % 6)  # lengths 1-6: 0 or 1 cached block each
        sizes_1k = internal_sizes(m)
        mem_1k = tracemalloc.get_traced_memory()[0]
        for i in range(1_000, 100_000):
            one_shot(m, i, 1 + i % 6)
        sizes_100k = internal_sizes(m)
        mem_100k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return m, {"sizes": (sizes_1k, sizes_100k), "memory": (mem_1k, mem_100k)}


def test_one_shot_salts_hold_at_most_one_namespace_per_cached_block(one_shots):
    m, _ = one_shots
    assert m.num_namespaces <= 64


def test_one_shot_salts_leave_the_structures_flat(one_shots):
    """What the manager holds after 1,000 tenants is what it holds after 100,000."""
    _, seen = one_shots
    sizes_1k, sizes_100k = seen["sizes"]
    assert sizes_100k == sizes_1k


def test_one_shot_salts_leave_memory_flat(one_shots):
    _, seen = one_shots
    mem_1k, mem_100k = seen["memory"]
    assert mem_100k - mem_1k < 16 * 1024, (mem_1k, mem_100k)  # no per-tenant residue


def test_one_shot_salts_count_every_query_token(one_shots):
    m, _ = one_shots
    assert m.stats().prefix_query_tokens == sum(1 + i % 6 for i in range(100_000))


def test_one_shot_salts_leave_a_consistent_manager(one_shots):
    m, _ = one_shots
    m.check_invariants()
