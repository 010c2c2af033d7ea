"""The manager's API reads right: reservations answer True/False with the shortfall apart,
one call marks tokens computed (checked against the known ids, all or nothing), admission
is exact and its refusal touches nothing, cheap accessors, and the old names still work
with a DeprecationWarning. Block size 4."""

import pytest

from radixkv.cache import KVCacheManager, prompt_block_keys
from test_cache_cases import B, make  # noqa: F401 - make is a fixture


def state(m, sids=()):
    lru = [key[:2] for key in m.tree.lru._order]
    return m.stats(), lru, {s: (m.block_table(s), m.token_ids(s), m.num_computed_tokens(s)) for s in sids}


def test_try_reserve_is_a_bool_and_the_shortfall_is_apart(make):
    m = make(4)
    m.add_sequence("a", [1] * 3)
    assert m.blocks_short("a", 20) == 5 - 4 and m.num_blocks_needed("a", 20) == 5
    before = state(m, ["a"])
    assert m.try_reserve("a", 20) is False
    assert state(m, ["a"]) == before
    assert m.blocks_short("a", 16) == 0 and m.try_reserve("a", 16) is True
    assert len(m.block_table("a")) == 4


def test_mark_tokens_computed_checks_known_ids_and_appends_the_rest(make):
    m = make()
    prompt = [10, 11, 12, 13, 14, 15]
    m.add_sequence("a", prompt)
    assert m.try_reserve("a", 8)  # the prompt and two lookahead slots
    before = state(m, ["a"])
    with pytest.raises(ValueError, match=r"token_ids\[2\] = 99 but token 2 of 'a' is 12"):
        m.mark_tokens_computed("a", [10, 11, 99])
    with pytest.raises(ValueError, match="try_reserve first"):
        m.mark_tokens_computed("a", prompt + [1, 2, 3])  # 9 > 8 reserved
    assert state(m, ["a"]) == before  # nothing applied
    m.mark_tokens_computed("a", prompt[:5])
    m.mark_tokens_computed("a", [15, 40, 41])  # the last prompt token, then two new ones
    assert m.token_ids("a") == prompt + [40, 41] and m.num_computed_tokens("a") == 8
    assert m.block_keys("a") == prompt_block_keys(prompt + [40, 41], B, hash_algo=m.hasher.algo)
    m.mark_tokens_computed("a", [])  # nothing new: a no-op
    m.check_invariants()


def test_admission_counts_the_prompts_own_hit_blocks_as_pinned(make):
    """The prompt hits 4 evictable blocks and needs 2 more; the pool has 1 free. Counting
    its own hits as available (free 1 + evictable 4 >= 2) admits it, then it cannot
    reserve: the exact check refuses it, and the refusal touches nothing."""
    m = make(5)
    base = list(range(16))
    assert m.try_admit("a", base)
    m.mark_tokens_computed("a", base)
    m.free("a")  # 4 evictable, 1 free
    prompt = base + [1, 2, 3, 4, 5]
    need = -(-len(prompt) // B) - m.peek_prefix(prompt) // B
    assert need == 2 and need <= m.num_available_blocks  # the old, inexact check says yes
    assert m.blocks_short_to_admit(prompt) == 1
    before = state(m)
    assert m.try_admit("b", prompt) is False
    assert state(m) == before and "b" not in m  # counters, LRU order and blocks untouched
    assert m.blocks_short_to_admit(prompt[:17]) == 0  # one block more only: fits
    assert m.try_admit("b", prompt[:17]) and m.num_computed_tokens("b") == 16
    m.check_invariants()


def test_admission_with_lookahead_and_a_hit(make):
    m = make(8)
    assert m.try_admit("a", list(range(9)))
    m.mark_tokens_computed("a", list(range(9)))
    assert m.try_admit("b", list(range(9)), num_lookahead_tokens=3)
    assert m.num_computed_tokens("b") == 8 and len(m.block_table("b")) == 3
    st = m.stats()
    assert (st.prefix_query_tokens, st.prefix_hit_tokens) == (18, 8)


def test_admission_of_a_live_id_is_refused(make):
    m = make(8)
    assert m.try_admit("b", list(range(9)), num_lookahead_tokens=3)
    with pytest.raises(ValueError, match="already in use"):
        m.try_admit("b", [1])


def test_a_negative_lookahead_names_the_argument(make):
    m = make(8)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        m.blocks_short_to_admit([1], num_lookahead_tokens=-1)


def test_accessors(make):
    m = make(8)
    assert m.try_admit("a", list(range(10)))
    m.mark_tokens_computed("a", list(range(10)))
    m.fork("a", "b")
    t = m.block_table("a")
    assert [m.ref_count(b) for b in t] == [2, 2, 2]  # the partial block is shared too
    assert [m.is_cached(b) for b in t] == [True, True, False]
    assert (m.num_free_blocks, m.num_evictable_blocks, m.num_in_use_blocks, m.num_cached_blocks) == (5, 0, 3, 2)
    assert m.num_sequences == 2 and m.num_namespaces == 1 and m.num_blocks == 8
    assert m.token_ids("b") == list(range(10)) and m.block_keys("b") == m.block_keys("a")
    m.free("a")
    m.free("b")
    assert m.ref_count(t[0]) == 0 and m.num_evictable_blocks == 2 and m.num_in_use_blocks == 0


def old_names_manager():
    m = KVCacheManager(8, B)
    m.add_sequence("a", list(range(6)))
    return m


def test_reserve_slots_warns_and_returns_the_shortfall():
    m = old_names_manager()
    with pytest.warns(DeprecationWarning, match="try_reserve"):
        assert m.reserve_slots("a", 40) == 10 - 8  # blocks missing, nothing changed
    with pytest.warns(DeprecationWarning, match="try_reserve"):
        assert m.reserve_slots("a", 6) == 0


def test_mark_computed_warns_and_still_marks():
    m = old_names_manager()
    with pytest.warns(DeprecationWarning, match="try_reserve"):
        m.reserve_slots("a", 40)  # refused first: it must leave nothing behind
        m.reserve_slots("a", 6)
    with pytest.warns(DeprecationWarning, match="mark_tokens_computed"):
        m.mark_computed("a", 6)
    assert m.num_computed_tokens("a") == 6 and m.stats().cached_blocks == 1
    m.check_invariants()


def test_mark_computed_past_the_known_tokens_says_append_tokens_first():
    m = old_names_manager()
    with pytest.warns(DeprecationWarning):
        m.reserve_slots("a", 6)
        m.mark_computed("a", 6)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="append_tokens first"):
        m.mark_computed("a", 1)
    assert m.num_computed_tokens("a") == 6  # the refused call marked nothing
    m.check_invariants()
