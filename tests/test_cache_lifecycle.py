"""A block's lifecycle has one owner: the BlockPool. Its transitions, each exactly once (ref
falls to 0: an uncached block is released, a cached one becomes evictable and the tree is
told; ref rises from 0: no longer evictable), and, through the manager, that no other code
writes a ref count or the evictable count, and that the LRU clock moves through
RadixTree.advance_clock() only. Block size 4."""

import sys

import pytest

from radixkv.cache import KVCacheManager
from radixkv.cache.block_pool import BlockPool
from radixkv.cache.radix_tree import RadixTree
from test_cache_cases import B, make  # noqa: F401 - make is a fixture


class StubTree:
    """What the pool asks of its tree: which blocks are cached, and ears for new evictable ones."""

    def __init__(self, n):
        self.node_of = [None] * n
        self.heard = []  # ("block", b) per unreferenced(), ("chain", end) per release_chain()

    def unreferenced(self, b):
        self.heard.append(("block", b))

    def release_chain(self, end):
        self.heard.append(("chain", end))


def pool_with_tree(n=8):
    pool, tree = BlockPool(n), StubTree(n)
    pool.attach(tree)
    return pool, tree


def test_uncached_block_is_released_at_its_last_holder_only():
    pool, tree = pool_with_tree()
    (b,) = pool.allocate(1)
    pool.incref(b)
    free = pool.num_free
    pool.decref(b)
    assert pool.ref[b] == 1 and pool.num_free == free and not pool.is_free(b)
    pool.decref(b)
    assert pool.ref[b] == 0 and pool.num_free == free + 1 and pool.is_free(b)
    assert pool.num_evictable == 0 and tree.heard == []  # the tree hears nothing of uncached blocks
    with pytest.raises(AssertionError):
        pool.decref(b)  # below 0: a contract, not a state


def test_cached_block_becomes_evictable_once_per_fall_to_zero():
    pool, tree = pool_with_tree()
    a, b = pool.allocate(2)
    tree.node_of[b] = "node"
    free = pool.num_free
    pool.decref_many([a, b])
    assert pool.num_free == free + 1 and pool.is_free(a)  # a: released
    assert not pool.is_free(b) and pool.num_evictable == 1 and tree.heard == [("block", b)]  # b: evictable
    pool.incref(b)  # 0 -> 1: out of the evictable count, the tree is not told
    assert pool.num_evictable == 0 and pool.ref[b] == 1 and tree.heard == [("block", b)]
    pool.incref(b)
    pool.decref(b)  # 2 -> 1: no transition
    assert pool.num_evictable == 0 and len(tree.heard) == 1
    pool.decref(b)
    assert pool.num_evictable == 1 and tree.heard == [("block", b)] * 2
    tree.node_of[b] = None  # the tree drops it (eviction): free again
    pool.evicted([b])
    assert pool.num_evictable == 0 and pool.is_free(b) and pool.num_free == free + 2


def test_incref_of_a_free_block_is_refused():
    pool, _ = pool_with_tree()
    with pytest.raises(AssertionError, match="free"):
        pool.incref(3)


@pytest.mark.parametrize("held", [0, 1, 3, 5, 6])
def test_chain_transitions_counted_from_the_tail(held):
    """A chain (held blocks first: no orphans) pinned and released: the 0 <-> 1 transitions
    are exactly its unreferenced tail, whatever its length."""
    pool, tree = pool_with_tree(8)
    chain = pool.allocate(6)
    for b in chain:
        tree.node_of[b] = "node"
    pool.decref_chain(chain, "end")  # all six fall to 0
    assert pool.num_evictable == 6 and tree.heard == [("chain", "end")]  # told once, per chain
    pool.incref_many(chain[:held])
    assert pool.num_evictable == 6 - held
    pool.incref_many(chain)  # pins the unheld tail
    assert pool.num_evictable == 0 and [pool.ref[b] for b in chain] == [2] * held + [1] * (6 - held)
    pool.decref_chain(chain, "end")
    assert pool.num_evictable == 6 - held and [pool.ref[b] for b in chain] == [1] * held + [0] * (6 - held)
    assert tree.heard == [("chain", "end")] * 2
    pool.incref_many([])  # nothing to pin: no change
    assert pool.num_evictable == 6 - held


def run(m, sid, prompt):
    hit = m.add_sequence(sid, prompt)
    assert m.try_reserve(sid, len(prompt) - hit)
    m.mark_tokens_computed(sid, prompt[hit:])
    return hit


def counts(m):
    return m.num_free_blocks, m.num_evictable_blocks, m.num_in_use_blocks


def test_free_releases_uncached_and_makes_cached_evictable_exactly_once(make):
    m = make(8)
    run(m, "a", list(range(9)))  # 2 full blocks (cached) + 1 partial (uncached)
    table = m.block_table("a")
    m.fork("a", "b")  # b holds all three too
    assert counts(m) == (5, 0, 3)
    m.free("a")
    assert counts(m) == (5, 0, 3)  # b still holds every block: no transition
    m.free("b")
    assert counts(m) == (6, 2, 0)  # the partial block released, the two cached ones evictable
    assert [m.ref_count(b) for b in table] == [0, 0, 0]
    assert [m.is_cached(b) for b in table] == [True, True, False]
    assert run(m, "c", list(range(9))) == 8  # a hit pins them again: 0 -> 1, out of evictable
    assert m.num_evictable_blocks == 0 and m.block_table("c")[:2] == table[:2]
    m.check_invariants()


def cached_under_a_kid(m, sid, kids, base=100):
    """`sid` had its partial block's slots reserved (and written) before `kids` forked from
    it, so its commit needs no copy: the kids then hold, uncommitted, a block the tree
    caches. `sid` is freed; the kids are left holding it."""
    prompt = list(range(base, base + 6))
    m.add_sequence(sid, prompt)
    assert m.try_reserve(sid, 8)
    m.mark_tokens_computed(sid, prompt)
    for kid in kids:
        m.fork(sid, kid)
    m.mark_tokens_computed(sid, [base + 6, base + 7])  # block 1 full: committed, cached
    x = m.block_table(sid)[1]
    m.free(sid)
    assert m.is_cached(x) and m.ref_count(x) == len(kids) and m.num_computed_tokens(kids[0]) == 6
    return x


def test_an_uncommitted_block_someone_cached_becomes_evictable_once_at_free(make):
    m = make(8)
    x = cached_under_a_kid(m, "p", ["k1", "k2"])
    before = counts(m)
    m.free("k1")
    assert counts(m) == before and m.ref_count(x) == 1
    m.free("k2")  # block 0 (committed) and x (uncommitted, cached) both fall to 0
    assert counts(m) == (before[0], before[1] + 2, before[2] - 2)
    m.check_invariants()


def test_a_copy_off_a_cached_block_makes_it_evictable_once(make):
    m = make(8)
    x = cached_under_a_kid(m, "p", ["k"])
    ev = m.num_evictable_blocks
    assert m.try_reserve("k", 1)  # k writes into x, which is cached: it gets a copy
    assert m.take_copy_ops() == [(x, m.block_table("k")[1])]
    assert m.ref_count(x) == 0 and m.is_cached(x) and m.num_evictable_blocks == ev + 1
    m.check_invariants()


class WriteSpy(list):
    """A ref-count list that notes the code object of every write."""

    def __init__(self, data, writers):
        super().__init__(data)
        self.writers = writers

    def __setitem__(self, i, v):
        self.writers.add(sys._getframe(1).f_code)
        super().__setitem__(i, v)


def _methods(cls):
    return {f.__code__ for f in vars(cls).values() if hasattr(f, "__code__")}


def spied_manager(num_blocks):
    """A manager whose pool's ref counts and evictable count, and tree's clock, note who
    writes them."""
    m = KVCacheManager(num_blocks, B)
    writers = {"ref": set(), "num_evictable": set(), "tick": set()}

    class SpyPool(BlockPool):
        def __setattr__(self, name, value):
            if name == "num_evictable":
                writers[name].add(sys._getframe(1).f_code)
            super().__setattr__(name, value)

    class SpyTree(RadixTree):
        def __setattr__(self, name, value):
            if name == "tick":
                writers[name].add(sys._getframe(1).f_code)
            super().__setattr__(name, value)

    m.pool.ref = WriteSpy(m.pool.ref, writers["ref"])
    m.pool.__class__, m.tree.__class__ = SpyPool, SpyTree
    return m, writers


@pytest.fixture(scope="module")
def spied_run():
    """Every path that moves a ref count, on a spied manager: allocation, a hit (lock), fork,
    copy-on-write, dedup at commit, free (committed chain, and an uncommitted block another
    sequence cached), eviction, reset. Returns (the stats before the reset, the writers)."""
    m, writers = spied_manager(12)
    run(m, "a", list(range(9)))
    run(m, "hit", list(range(9)) + [50])  # pins a's 2 cached blocks
    m.fork("a", "kid")  # shares a's partial block 2
    assert m.try_reserve("a", 3)  # a writes into it: copy-on-write
    m.take_copy_ops()
    m.mark_tokens_computed("a", [9, 10, 11])  # a's copy of block 2 is committed and cached
    m.add_sequence("d1", [70] * 8)
    m.add_sequence("d2", [70] * 8)
    assert m.try_reserve("d1", 8)
    assert m.try_reserve("d2", 8)
    m.mark_tokens_computed("d1", [70] * 8)
    m.mark_tokens_computed("d2", [70] * 8)  # twins of d1's blocks: dedup
    for sid in ("a", "hit", "kid", "d1", "d2"):
        m.free(sid)
        m.check_invariants()
    cached_under_a_kid(m, "p", ["k1", "k2"])
    assert m.try_reserve("k1", 1)  # a copy off the cached block
    m.take_copy_ops()
    m.free("k2")  # the cached block, uncommitted in k2, falls to 0
    m.free("k1")
    m.check_invariants()
    run(m, "big", [90] * 40)  # takes the whole pool: evicts every cached block
    m.free("big")
    stats = m.stats()
    assert m.reset_prefix_cache()
    m.check_invariants()
    return stats, writers


# the run covers eviction, dedup and copy-on-write, so the writer checks below are not vacuous
def test_the_spied_run_evicts(spied_run):
    stats, _ = spied_run
    assert stats.evicted_blocks > 0


@pytest.mark.parametrize("counter", ["deduplicated_blocks", "copy_on_write_blocks"])
def test_the_spied_run_dedups_and_copies_twice(spied_run, counter):
    stats, _ = spied_run
    assert getattr(stats, counter) == 2


def test_only_the_pool_writes_ref_counts(spied_run):
    _, writers = spied_run
    pool_code = _methods(BlockPool)
    assert writers["ref"] and writers["ref"] <= pool_code, [c.co_qualname for c in writers["ref"] - pool_code]


def test_only_the_pool_writes_the_evictable_count(spied_run):
    _, writers = spied_run
    pool_code = _methods(BlockPool)
    assert writers["num_evictable"] <= pool_code, [c.co_qualname for c in writers["num_evictable"] - pool_code]


def test_the_spies_saw_every_pool_transition(spied_run):
    """So that the two checks above are not vacuous."""
    _, writers = spied_run
    names = {c.co_name for c in writers["ref"] | writers["num_evictable"]}
    assert {"allocate", "incref", "incref_many", "decref", "decref_many", "decref_chain", "evicted"} <= names


def test_only_advance_clock_moves_the_clock(spied_run):
    _, writers = spied_run
    assert {c.co_qualname for c in writers["tick"]} == {"RadixTree.advance_clock"}
