"""LRU leaf eviction and copy-on-write: order, no orphaned chains, forks of forks, pending
copies whose blocks must not be recycled. Block size 4 throughout."""

import pytest

from radixkv.cache import BlockRemoved, BlockStored
from test_cache_cases import B, make  # noqa: F401 - make is a fixture


def run(m, sid, prompt):
    hit = m.add_sequence(sid, prompt)
    assert m.try_reserve(sid, len(prompt) - hit)
    m.mark_tokens_computed(sid, prompt[hit:])
    return hit


def decode(m, sid, tok):
    assert m.try_reserve(sid, 1)
    ops = m.take_copy_ops()
    m.mark_tokens_computed(sid, [tok])
    return ops


def take_free(m, sid="filler"):
    """A sequence that holds every free block, so that the next reservation must evict."""
    m.add_sequence(sid, [6000] * 2)
    assert m.try_reserve(sid, m.num_free_blocks * B) and m.num_free_blocks == 0


def evict_one(m, sid):
    """Make the pool give up exactly one cached block to a fresh one-block sequence."""
    assert m.num_free_blocks == 0
    m.add_sequence(sid, [7000 + len(sid)] * 2)
    assert m.try_reserve(sid, 1)


def test_eviction_is_lru_among_leaves(make):
    m = make(9)
    chains = {name: [base + i for i in range(9)] for name, base in (("a", 100), ("b", 200), ("c", 300))}
    for name, prompt in chains.items():  # 2 full blocks each (+1 partial, freed at once)
        run(m, name, prompt)
    for name in ("a", "c", "b"):  # release order: a oldest, then c, then b
        m.free(name)
    assert m.add_sequence("hit-a", chains["a"]) == 8  # a hit is a use: a becomes newest
    m.free("hit-a")
    take_free(m)
    order = []
    for i in range(6):
        evict_one(m, f"x{i}")
        order.append(tuple(name for name, p in chains.items() if m.peek_prefix(p + [1]) < 8))
    # c goes first (tail then head), then b, then a; a chain loses its tail before its head.
    assert [m.peek_prefix(chains[n] + [1]) for n in "abc"] == [0, 0, 0]
    assert order[:2] == [("c",), ("c",)] and order[2:4] == [("b", "c"), ("b", "c")]
    m.check_invariants()


def test_eviction_never_orphans_a_cached_chain(make):
    """Shared head with two tails: every eviction leaves each cached key's parent cached."""
    m = make(12, enable_events=True)
    head = list(range(8))
    run(m, "x", head + [50] * 8 + [1])
    run(m, "y", head + [60] * 12 + [1])
    m.free("x")
    m.free("y")
    parent, cached = {}, set()
    for e in m.take_events():
        assert isinstance(e, BlockStored)
        prev = e.parent_key
        for k in e.block_keys:
            parent[k], prev = prev, k
            cached.add(k)
    assert len(cached) == 7
    take_free(m)
    m.take_events()
    for i in range(7):
        evict_one(m, f"f{i}")
        for e in m.take_events():
            if isinstance(e, BlockRemoved):
                cached -= set(e.block_keys)
        assert len(cached) == 6 - i
        assert all(parent[k] is None or parent[k] in cached for k in cached), i
        m.check_invariants()
    assert not cached


def test_commit_and_release_refresh_lru(make):
    m = make(6)
    run(m, "old", [1] * 8)  # committed first...
    run(m, "new", [2] * 8)
    m.free("new")
    m.free("old")  # ...but released last: "new" is now the least recently used
    m.add_sequence("z", [3] * 5)
    assert m.try_reserve("z", 5)  # takes the 2 free blocks
    m.add_sequence("w", [4] * 5)
    assert m.try_reserve("w", 5)  # evicts 2: the tail of "new" only
    assert m.peek_prefix([1] * 9) == 8 and m.peek_prefix([2] * 9) == 0


def test_cow_exactly_when_a_shared_partial_block_is_written(make):
    m = make()
    run(m, "p", list(range(6)))  # block 0 full, block 1 holds 2 tokens
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p")
    assert m.stats().in_use_blocks == 2
    ops = decode(m, "c", 9)
    (src, dst), = ops
    assert src == m.block_table("p")[1] and dst == m.block_table("c")[1]
    assert m.block_table("c")[0] == m.block_table("p")[0]  # full shared block never copied
    assert decode(m, "p", 8) == []  # the last holder writes in place
    assert m.stats().copy_on_write_blocks == 1
    m.check_invariants()


def test_no_copy_when_the_shared_blocks_are_all_full(make):
    m = make()
    run(m, "p", list(range(8)))
    m.fork("p", "c")
    assert decode(m, "c", 1) == [] and decode(m, "p", 2) == []
    assert m.block_table("c")[:2] == m.block_table("p")[:2]


def test_every_holder_but_the_last_copies(make):
    m = make()
    run(m, "p", list(range(5)))
    for c in ("c1", "c2", "c3"):
        m.fork("p", c)
    shared = m.block_table("p")[1]
    for c in ("c1", "c2", "c3"):
        assert m.num_blocks_needed(c, 1) == 1
        assert decode(m, c, 1) == [(shared, m.block_table(c)[1])]
    assert m.num_blocks_needed("p", 1) == 0 and decode(m, "p", 1) == []
    assert len({m.block_table(s)[1] for s in ("p", "c1", "c2", "c3")}) == 4
    m.check_invariants()


def test_fork_of_a_fork(make):
    m = make()
    run(m, "p", list(range(7)))
    m.fork("p", "c")
    m.fork("c", "g")
    assert m.stats().prefix_query_tokens == 7  # forks count no query
    assert m.ref_count(m.block_table("g")[1]) == 3
    decode(m, "g", 1)
    decode(m, "p", 2)
    decode(m, "c", 3)  # last holder of the original partial block
    assert len({m.block_table(s)[1] for s in "pcg"}) == 3
    for s in ("c", "p", "g"):
        m.free(s)
        m.check_invariants()
    st = m.stats()
    assert st.in_use_blocks == 0 and st.free_blocks + st.evictable_blocks == 32


def test_fork_leaves_empty_reserved_blocks_with_the_parent(make):
    m = make()
    run(m, "p", list(range(6)))
    m.append_tokens("p", [1] * 10)
    assert m.try_reserve("p", 10)  # 4 blocks, 2 of them empty
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p")[:2]
    with pytest.raises(ValueError, match="try_reserve first"):
        m.mark_tokens_computed("c", [1])  # the parent's reservation is not inherited


def test_copy_source_is_not_recycled_before_ops_are_taken(make):
    m = make(4)
    run(m, "p", list(range(6)))  # 2 blocks
    m.fork("p", "c")
    m.append_tokens("c", [9])
    assert m.try_reserve("c", 1)  # copy p[1] -> new block, pending
    src = m.block_table("p")[1]
    m.free("p")  # src loses its last holder before the copy ran
    assert m.stats().in_use_blocks == 3 and m.num_free_blocks == 1
    m.add_sequence("q", [5] * 3)
    assert m.try_reserve("q", 3)
    assert src not in m.block_table("q")
    m.add_sequence("r", [6] * 3)
    assert not m.try_reserve("r", 3) and m.blocks_short("r", 3) == 1  # the parked source is not available
    m.check_invariants()
    assert m.take_copy_ops() == [(src, m.block_table("c")[1])]
    assert m.num_free_blocks == 1 and m.try_reserve("r", 3)
    m.check_invariants()


def test_copy_into_a_freed_block_is_dropped(make):
    m = make(8)
    run(m, "p", list(range(6)))
    m.fork("p", "c")
    m.append_tokens("c", [9])
    assert m.try_reserve("c", 1)
    m.free("c")  # aborted before the copy ran
    assert m.take_copy_ops() == []
    m.check_invariants()


def test_copy_from_a_pending_destination_reads_its_source(make):
    m = make(8)
    run(m, "p", list(range(6)))
    m.fork("p", "c")
    m.append_tokens("c", [9])
    assert m.try_reserve("c", 1)  # p1 -> c1 pending
    m.fork("c", "g")  # g shares c1 before it holds any bytes
    m.append_tokens("g", [8])
    assert m.try_reserve("g", 1)
    src = m.block_table("p")[1]
    assert m.take_copy_ops() == [(src, m.block_table("c")[1]), (src, m.block_table("g")[1])]


def test_block_cached_by_a_sibling_is_held_and_never_written(make):
    """The parent reserved ahead, forked, then filled and committed the partial block the
    child still holds. The child's hold survives eviction; its next write copies."""
    m = make(4)
    run(m, "p", list(range(6)))
    assert m.try_reserve("p", 2)  # lookahead into the partial block
    m.fork("p", "c")
    m.mark_tokens_computed("p", [40, 41])  # block 1 full: committed while "c" holds it
    held = m.block_table("c")[1]
    m.free("p")
    m.check_invariants()
    assert m.stats().evictable_blocks == 0  # block 0 and 1: both held by c
    m.add_sequence("q", [5] * 9)
    assert not m.try_reserve("q", 9) and m.blocks_short("q", 9) == 3 - 2  # 2 free; nothing evictable
    assert m.peek_prefix(list(range(6)) + [40, 41, 0]) == 8
    assert decode(m, "c", 7) == [(held, m.block_table("c")[1])]  # cached: copied, not written
    assert m.stats().evictable_blocks == 1  # the committed block, now unheld
    m.check_invariants()
