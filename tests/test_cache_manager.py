"""KVCacheManager rules: hits, caps, salts, all-or-nothing reservation, dedup, accounting,
events, reset, and errors that change nothing. Block size 4 throughout."""

import subprocess
import sys

import pytest

from radixkv.cache import BlockRemoved, BlockStored, KVCacheManager, prompt_block_keys
from test_cache_cases import B, make  # noqa: F401 - make is a fixture


def run(m, sid, prompt, **kw):
    """Add and compute a whole prompt; returns the hit."""
    hit = m.add_sequence(sid, prompt, **kw)
    assert m.try_reserve(sid, len(prompt) - hit)
    m.mark_tokens_computed(sid, prompt[hit:])
    m.check_invariants()
    return hit


def snapshot(m, sids):
    return m.stats(), {s: (m.block_table(s), m.num_computed_tokens(s), m.num_tokens(s)) for s in sids}


def test_hit_while_first_owner_still_running(make):
    m = make()
    run(m, "a", list(range(14)))  # 3 full blocks + 2 tokens, still live
    hit = m.add_sequence("b", list(range(12)) + [99, 98, 97])
    assert hit == 12
    assert m.block_table("b") == m.block_table("a")[:3]
    assert m.stats().in_use_blocks == 4  # shared, not copied
    m.check_invariants()


def test_hit_is_capped_so_one_token_is_computed(make):
    m = make()
    run(m, "a", list(range(8)))
    m.free("a")
    assert m.peek_prefix(list(range(8))) == 4  # (8 - 1) // 4 * 4
    assert m.peek_prefix(list(range(4))) == 0  # exactly one cached block: nothing
    assert m.peek_prefix(list(range(9))) == 8
    assert m.add_sequence("b", list(range(8))) == 4
    assert m.num_computed_tokens("b") == 4


def test_lookup_pins_but_takes_no_free_block_and_counts(make):
    m = make()
    run(m, "a", list(range(10)))
    m.free("a")
    before = m.stats()
    assert m.peek_prefix(list(range(10))) == 8
    assert m.stats() == before  # a peek pins nothing and counts nothing
    assert m.add_sequence("b", list(range(10))) == 8
    after = m.stats()
    assert after.free_blocks == before.free_blocks
    assert after.evictable_blocks == before.evictable_blocks - 2
    assert (after.prefix_query_tokens - before.prefix_query_tokens, after.prefix_hit_tokens - before.prefix_hit_tokens) == (10, 8)


def test_no_hit_across_salts_or_adapters(make):
    m = make()
    prompt = list(range(13))
    run(m, "a", prompt, salt="t1")
    assert m.peek_prefix(prompt) == 0
    assert m.peek_prefix(prompt, salt="t2") == 0
    assert m.peek_prefix(prompt, salt="t1", adapter_id=2) == 0
    assert m.peek_prefix(prompt, salt="t1") == 12
    assert m.peek_prefix(prompt, salt=b"t1") == 12  # str salts are their UTF-8 bytes
    assert run(m, "b", prompt, salt="t2") == 0
    st = m.stats()
    assert st.per_salt["t1"].cached_blocks == 3 and st.per_salt["t2"].cached_blocks == 3
    assert st.per_salt["t2"].prefix_hit_tokens == 0 and st.per_salt["t2"].num_sequences == 1


def test_prefix_caching_off_never_hits_and_frees_everything(make):
    m = make(enable_prefix_caching=False)
    run(m, "a", list(range(10)))
    m.free("a")
    assert run(m, "b", list(range(10))) == 0
    m.free("b")
    assert m.stats().free_blocks == 32 and m.stats().cached_blocks == 0


def test_failed_reservation_changes_nothing_and_says_what_is_missing(make):
    m = make(6)
    run(m, "a", list(range(8)))  # 2 blocks held
    m.add_sequence("b", [50] * 3)
    snap = snapshot(m, ["a", "b"])
    assert m.num_blocks_needed("b", 30) == 8
    assert m.try_reserve("b", 30) is False and m.blocks_short("b", 30) == 8 - 4  # 4 free, 0 evictable
    assert snapshot(m, ["a", "b"]) == snap
    with pytest.raises(ValueError, match="try_reserve first"):
        m.mark_tokens_computed("b", [50])
    assert m.try_reserve("b", 16) and len(m.block_table("b")) == 4


def test_free_blocks_are_used_before_evicting(make):
    m = make(8)
    run(m, "a", list(range(16)))
    m.free("a")  # 4 evictable, 4 free
    m.add_sequence("b", [70] * 16)
    assert m.try_reserve("b", 16)
    assert m.stats().evicted_blocks == 0 and m.peek_prefix(list(range(16))) == 12
    m.mark_tokens_computed("b", [70] * 16)
    m.add_sequence("c", [80] * 4)
    assert m.try_reserve("c", 4)
    assert m.stats().evicted_blocks == 1  # now one had to go
    m.check_invariants()


def test_own_hit_blocks_are_never_evicted_for_the_same_request(make):
    m = make(5)
    run(m, "a", list(range(16)))
    m.free("a")  # 4 evictable, 1 free
    assert m.add_sequence("b", list(range(16)) + [1, 2, 3, 4, 5]) == 16
    # Needs 2 blocks: 1 free, and the only evictable ones are its own hits.
    assert not m.try_reserve("b", 5) and m.blocks_short("b", 5) == 1
    assert m.block_table("b") == m.block_table("b")[:4] and m.stats().evicted_blocks == 0


def test_duplicate_block_is_deduplicated_at_commit(make):
    m = make(16)
    prompt = list(range(9))
    for s in ("a", "b"):  # both miss: neither has committed yet
        assert m.add_sequence(s, prompt) == 0
        assert m.try_reserve(s, 9)
    m.mark_tokens_computed("a", prompt)
    free_before = m.num_free_blocks
    m.mark_tokens_computed("b", prompt)
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] != m.block_table("a")[2]  # partial blocks stay private
    assert m.num_free_blocks == free_before + 2  # b's two duplicates freed at once
    assert m.stats().deduplicated_blocks == 2 and m.stats().cached_blocks == 2
    m.check_invariants()


def test_recomputed_single_block_prompt_switches_to_cached_twin(make):
    m = make(8)
    run(m, "a", list(range(4)))
    m.free("a")
    twin = m.stats()
    assert run(m, "b", list(range(4))) == 0  # capped: the block is computed again
    assert m.stats().deduplicated_blocks == 1 and m.stats().cached_blocks == twin.cached_blocks
    assert m.stats().evictable_blocks == 0 and m.stats().in_use_blocks == 1


def test_accounting(make):
    m = make(16)
    run(m, "a", list(range(6)))  # 2 blocks, 6 tokens
    m.add_sequence("b", [9] * 3)
    assert m.try_reserve("b", 3)
    st = m.stats()
    assert (st.free_blocks, st.evictable_blocks, st.in_use_blocks, st.cached_blocks) == (13, 0, 3, 1)
    assert st.slot_utilization == pytest.approx(9 / 12) and st.last_block_slack == 3
    assert st.num_sequences == 2 and st.copy_on_write_blocks == 0
    m.free("a")
    m.free("b")
    st = m.stats()
    assert (st.free_blocks, st.evictable_blocks, st.in_use_blocks) == (15, 1, 0)
    assert st.slot_utilization == 1.0 and st.hit_rate == 0.0


def with_events(make):
    """A manager with events on whose sequence "a" computed 10 prompt tokens, then 2 more
    (3 blocks: 2 from the prompt, 1 from the decode); the events so far are not taken."""
    m = make(6, enable_events=True)
    prompt = list(range(10))
    run(m, "a", prompt)
    assert m.try_reserve("a", 2)
    m.mark_tokens_computed("a", [1, 2])
    keys = prompt_block_keys(prompt + [1, 2], B, hash_algo=m.hasher.algo)
    return m, prompt, keys


def test_stored_events_carry_keys_and_parent_keys(make):
    m, prompt, keys = with_events(make)
    e1, e2 = m.take_events()
    table = m.block_table("a")
    assert e1 == BlockStored(tuple(keys[:2]), None, tuple(prompt[:8]), B, None, None, tuple(table[:2]))
    assert e2.block_ids == (table[2],)
    assert e2.block_keys == (keys[2],) and e2.parent_key == keys[1] and e2.token_ids == (8, 9, 1, 2)


def test_events_are_taken_once(make):
    m, _, _ = with_events(make)
    m.take_events()
    assert m.take_events() == []


def test_eviction_emits_a_removed_event_for_the_lru_leaf_tail(make):
    m, _, keys = with_events(make)
    table = m.block_table("a")
    m.take_events()
    m.free("a")
    run(m, "b", [40] * 16)  # 4 blocks: 3 free, then the LRU leaf's tail goes
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.block_keys, e.block_ids, e.salt, e.adapter_id) for e in removed] == [((keys[2],), (table[2],), None, None)]
    assert table[2] in m.block_table("b")  # the evicted block was handed to b


def test_reset_emits_one_removed_event_for_every_cached_block(make):
    m, _, keys = with_events(make)
    table = m.block_table("a")
    m.free("a")
    run(m, "b", [40] * 16)  # evicts a's tail block (as above)
    b_table = m.block_table("b")
    m.free("b")
    m.take_events()
    assert m.reset_prefix_cache()
    (gone,) = m.take_events()
    assert set(gone.block_keys) == set(keys[:2]) | set(prompt_block_keys([40] * 16, B, hash_algo=m.hasher.algo))
    assert set(gone.block_ids) == set(table[:2]) | set(b_table) and len(gone.block_ids) == len(gone.block_keys)
    assert dict(zip(gone.block_keys, gone.block_ids))[keys[0]] == table[0]


def test_no_events_unless_enabled(make):
    m = make()
    run(m, "a", list(range(9)))
    assert m.take_events() == []


def test_reset_is_refused_while_a_block_is_referenced(make):
    m = make(8)
    run(m, "a", list(range(9)))
    snap = snapshot(m, ["a"])
    assert m.reset_prefix_cache() is False
    assert snapshot(m, ["a"]) == snap
    m.free("a")
    assert m.reset_prefix_cache() is True
    st = m.stats()
    assert (st.free_blocks, st.cached_blocks, st.evictable_blocks) == (8, 0, 0)
    assert m.peek_prefix(list(range(9))) == 0
    m.check_invariants()


# (exception, message, bad call) on a manager whose "a" computed 6 tokens; ids name the call
BAD_CALLS = [
    pytest.param(KeyError, "'zz'", lambda m: m.free("zz"), id="free-unknown"),
    pytest.param(KeyError, "'zz'", lambda m: m.try_reserve("zz", 1), id="try_reserve-unknown"),
    pytest.param(KeyError, "'zz'", lambda m: m.mark_tokens_computed("zz", [1]), id="mark_tokens_computed-unknown"),
    pytest.param(KeyError, "'zz'", lambda m: m.block_table("zz"), id="block_table-unknown"),
    pytest.param(KeyError, "'zz'", lambda m: m.fork("zz", "y"), id="fork-unknown-parent"),
    pytest.param(ValueError, "already in use", lambda m: m.add_sequence("a", [1]), id="add_sequence-live-id"),
    pytest.param(ValueError, "already in use", lambda m: m.fork("a", "a"), id="fork-live-child-id"),
    pytest.param(ValueError, "empty", lambda m: m.add_sequence("n", []), id="add_sequence-empty"),
    pytest.param(ValueError, r"token_ids\[1\]", lambda m: m.add_sequence("n", [1, -2]), id="add_sequence-negative-token"),
    pytest.param(ValueError, r"token_ids\[0\]", lambda m: m.add_sequence("n", [2**32]), id="add_sequence-token-over-32-bit"),
    pytest.param(ValueError, r"token_ids\[0\]", lambda m: m.append_tokens("a", [0.5]), id="append_tokens-float-token"),
    pytest.param(ValueError, "salt", lambda m: m.add_sequence("n", [1, 2], salt=7), id="add_sequence-int-salt"),
    pytest.param(ValueError, "adapter_id", lambda m: m.add_sequence("n", [1, 2], adapter_id=[1]), id="add_sequence-list-adapter"),
    pytest.param(ValueError, "hashable", lambda m: m.add_sequence(["n"], [1, 2]), id="add_sequence-unhashable-id"),
    pytest.param(ValueError, "num_tokens", lambda m: m.try_reserve("a", -1), id="try_reserve-negative"),
    pytest.param(ValueError, "num_tokens", lambda m: m.try_reserve("a", 1.0), id="try_reserve-float"),
    pytest.param(ValueError, "num_tokens", lambda m: m.blocks_short("a", True), id="blocks_short-bool"),
    pytest.param(ValueError, "try_reserve first", lambda m: m.mark_tokens_computed("a", [1]), id="mark_tokens_computed-unreserved"),
    pytest.param(ValueError, r"token_ids\[0\]", lambda m: m.mark_tokens_computed("a", [-1]), id="mark_tokens_computed-negative-token"),
    pytest.param(ValueError, "block_id", lambda m: m.ref_count(8), id="ref_count-out-of-range"),
    pytest.param(ValueError, "block_id", lambda m: m.ref_count(True), id="ref_count-bool"),
]


@pytest.mark.parametrize("exc, match, call", BAD_CALLS)
def test_errors_name_the_argument_and_change_nothing(make, exc, match, call):
    m = make(8)
    run(m, "a", list(range(6)))
    snap = snapshot(m, ["a"])
    with pytest.raises(exc, match=match):
        call(m)
    assert snapshot(m, ["a"]) == snap


def test_freeing_twice_says_already_freed(make):
    m = make(8)
    run(m, "a", list(range(6)))
    m.free("a")
    with pytest.raises(KeyError, match="already freed"):
        m.free("a")
    m.check_invariants()


@pytest.mark.parametrize("kw, name", [
    (dict(num_blocks=0), "num_blocks"), (dict(num_blocks=4, block_size=0), "block_size"),
    (dict(num_blocks=4, block_size=2.0), "block_size"), (dict(num_blocks=4, hash_algo="md5"), "hash_algo"),
    (dict(num_blocks=4, hash_seed=-1), "hash_seed"),
])
def test_bad_construction(kw, name):
    with pytest.raises(ValueError, match=name):
        KVCacheManager(**kw)


# These two corrupt the pool's and the tree's private state on purpose: no public call can.
def test_check_invariants_detects_a_wrong_ref_count(make):
    m = make(8)
    run(m, "a", list(range(9)))
    m.pool.ref[m.block_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="ref count"):
        m.check_invariants()


def test_check_invariants_detects_a_wrong_block_key(make):
    m = make(8)
    run(m, "a", list(range(9)))
    node = m.tree.node_of[m.block_table("a")[0]]
    node.keys[0] = b"x" * len(node.keys[0])
    with pytest.raises(AssertionError, match="key"):
        m.check_invariants()


def test_import_does_not_load_torch():
    code = "import sys, radixkv.cache; print(sorted(m for m in ('torch', 'numpy', 'radixkv.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
