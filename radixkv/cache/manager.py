"""KVCacheManager: the façade an engine drives (see docs/embedding.md for the rules).

The manager owns the sequences (tables, token ids, counters) and says where each of its
operations starts (tree.advance_clock()); it writes no ref count and no block state. A
block's lifecycle (ref counts, free / evictable / parked) is the BlockPool's, what is
cached and in what LRU order is the RadixTree's.
"""

import warnings
from array import array

from .block_pool import BlockPool
from .hashing import TOKEN_TYPECODE, BlockHasher, adapter_bytes, extra_keys, le_bytes, normalize_salt, tokens_to_array
from .invariants import check_manager
from .radix_tree import RadixTree
from .sequence import Namespace, Sequence, count_arg
from .stats import CacheStats, build_stats

_NO_TENANT = (None, None)  # the namespace key of salt=None, adapter_id=None


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"KVCacheManager.{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=3)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, *, hash_algo: str = "sha256", hash_seed: int = 0,
                 enable_prefix_caching: bool = True, enable_events: bool = False):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hasher = BlockHasher(hash_algo, hash_seed)
        self.pool = BlockPool(num_blocks)
        self._events: list | None = [] if enable_events else None
        self.tree = RadixTree(self.pool, block_size, self.hasher, self._events)
        self._seqs: dict[object, Sequence] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.copy_on_write_blocks = 0

    # ---- admission --------------------------------------------------------------------------

    def add_sequence(self, seq_id, token_ids, *, salt=None, adapter_id=None) -> int:
        """Register a prompt; returns its cached tokens, pinned (block aligned, capped at
        (len - 1) // B * B so one token is left to compute). Takes no free block."""
        self._new_id(seq_id, "seq_id")
        tokens = tokens_to_array(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty")
        key = self._ns_key(salt, adapter_id)
        ns = self.tree.namespaces.get(key)
        if ns is None:
            ns = self._new_namespace(key, salt, adapter_id)
        path, n = self._match(ns, tokens)
        return self._add(seq_id, tokens, ns, path, n)

    def try_admit(self, seq_id, token_ids, *, salt=None, adapter_id=None, num_lookahead_tokens: int = 0) -> bool:
        """add_sequence + try_reserve of every uncached prompt token (plus lookahead slots),
        as one step. True: the sequence is live with its hit pinned (num_computed_tokens()
        says how many tokens it hit) and its prompt's slots reserved. False: nothing
        changed: no sequence, no counter, no LRU position, no namespace."""
        self._new_id(seq_id, "seq_id")
        tokens = tokens_to_array(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty")
        count_arg(num_lookahead_tokens, "num_lookahead_tokens")
        key = self._ns_key(salt, adapter_id)
        ns = self.tree.namespaces.get(key)
        path, n = self._match(ns, tokens) if ns is not None else ([], 0)
        if self._admit_short(tokens, path, n, num_lookahead_tokens):
            return False
        if ns is None:
            ns = self._new_namespace(key, salt, adapter_id)
        hit = self._add(seq_id, tokens, ns, path, n)
        missing = self._reserve(self._seqs[seq_id], len(tokens) - hit + num_lookahead_tokens)
        if missing:  # _admit_short said it fits: a broken count, not a full pool
            raise AssertionError(f"admission check was wrong: {missing} blocks missing after it said none")
        return True

    def blocks_short_to_admit(self, token_ids, *, salt=None, adapter_id=None, num_lookahead_tokens: int = 0) -> int:
        """Blocks missing for try_admit of this prompt now (0: it would be admitted). Exact:
        the prompt's own hit blocks count as pinned, not as available. Pins nothing,
        counts nothing."""
        tokens = tokens_to_array(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty")
        count_arg(num_lookahead_tokens, "num_lookahead_tokens")
        ns = self.tree.namespaces.get(self._ns_key(salt, adapter_id))
        path, n = self._match(ns, tokens) if ns is not None else ([], 0)
        return self._admit_short(tokens, path, n, num_lookahead_tokens)

    def peek_prefix(self, token_ids, *, salt=None, adapter_id=None) -> int:
        """What add_sequence would return now; pins nothing, counts nothing."""
        tokens = tokens_to_array(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty")
        ns = self.tree.namespaces.get(self._ns_key(salt, adapter_id))
        if ns is None:
            return 0
        return self._match(ns, tokens)[1] * self.block_size

    # ---- reservations -----------------------------------------------------------------------

    def num_blocks_needed(self, seq_id, num_tokens: int) -> int:
        """New blocks try_reserve(seq_id, num_tokens) would take, copy-on-write included."""
        seq = self._seq(seq_id)
        new, cow = self._plan(seq, count_arg(num_tokens, "num_tokens"))
        return new + (cow >= 0)

    def blocks_short(self, seq_id, num_tokens: int) -> int:
        """Blocks missing for try_reserve(seq_id, num_tokens) now (0: it would succeed)."""
        return max(0, self.num_blocks_needed(seq_id, num_tokens) - self.num_available_blocks)

    def try_reserve(self, seq_id, num_tokens: int) -> bool:
        """Slots for tokens [computed, computed + num_tokens). All or nothing: True when
        done; False when the pool cannot give the blocks (nothing changed; blocks_short()
        says how many are missing)."""
        return self._reserve(self._seq(seq_id), count_arg(num_tokens, "num_tokens")) == 0

    # ---- tokens -------------------------------------------------------------------------------

    def append_tokens(self, seq_id, token_ids) -> None:
        """Tokens now known (e.g. sampled) but not computed yet."""
        seq = self._seq(seq_id)
        seq.tokens += tokens_to_array(token_ids)

    def mark_tokens_computed(self, seq_id, token_ids) -> None:
        """KV of `token_ids`, the tokens right after the computed ones, is written. Tokens
        the manager already knows (the prompt, appended ones) must be these very ids; the
        rest are appended. Full blocks enter the tree (a block identical to a cached one
        switches the table entry to its cached twin). ValueError, and nothing applied, on
        a mismatch or past the reserved slots."""
        seq = self._seq(seq_id)
        new = tokens_to_array(token_ids)
        done, known = seq.num_computed, len(seq.tokens)
        end = done + len(new)
        if end > seq.num_reserved:
            raise ValueError(f"{len(new)} tokens: {seq_id!r} has slots reserved up to token "
                             f"{seq.num_reserved} only (try_reserve first)")
        overlap = min(end, known) - done
        if overlap > 0 and seq.tokens[done : done + overlap] != new[:overlap]:
            i = next(i for i in range(overlap) if seq.tokens[done + i] != new[i])
            raise ValueError(f"token_ids[{i}] = {new[i]} but token {done + i} of {seq_id!r} is "
                             f"{seq.tokens[done + i]}")
        if end > known:
            seq.tokens += new[known - done :]
        self._computed(seq, end)

    # ---- forks, frees, copies, reset -------------------------------------------------------------

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block holding computed tokens, the partial last one too
        (copy-on-write later); blocks reserved but still empty stay with the parent."""
        parent = self._seq(parent_id)
        self._new_id(child_id, "child_id")
        shared = parent.table[: -(-parent.num_computed // self.block_size)]
        self.pool.incref_many(shared)  # all held by the parent: no state changes
        parent.ns.num_seqs += 1
        self._seqs[child_id] = Sequence(array(TOKEN_TYPECODE, parent.tokens), shared, parent.ns, parent.node,
                                        parent.num_computed, parent.num_committed, parent.num_computed)

    def free(self, seq_id) -> None:
        """Drop the sequence; its cached blocks stay in the tree (evictable once unheld)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        tree, pool = self.tree, self.pool
        tree.advance_clock()
        table, nc = seq.table, seq.num_committed
        if nc:  # committed: a chain of the tree, all cached
            pool.decref_chain(table[:nc], seq.node)
        if nc < len(table):
            pool.decref_many(table[nc:])
        ns = seq.ns
        ns.num_seqs -= 1
        if not ns.num_seqs and not ns.cached_blocks:
            tree.drop_if_unused(ns)

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs to run before the next forward; each block appears
        in one role only, and none of them is handed out again before this call."""
        return self.pool.take_copy_ops()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, and every namespace without a live sequence. Refused
        (returns False, nothing changes) while any block is held by a sequence."""
        referenced = self.pool.num_blocks - self.pool.num_free - self.pool.num_evictable - len(self.pool.parked)
        if referenced:
            return False
        self.tree.reset()
        return True

    # ---- queries ----------------------------------------------------------------------------

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_computed_tokens(self, seq_id) -> int:
        return self._seq(seq_id).num_computed

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id).tokens)

    def token_ids(self, seq_id) -> list[int]:
        """Every known token of the sequence: prompt, then appended or computed ones."""
        return self._seq(seq_id).tokens.tolist()

    def block_keys(self, seq_id) -> list[bytes]:
        """Keys of the sequence's committed blocks (block_table()[:len(keys)]), as
        prompt_block_keys() and the BlockStored events give them."""
        seq = self._seq(seq_id)
        keys, node = [], seq.node
        while node.parent is not None:
            keys[:0] = node.keys
            node = node.parent
        return keys

    def ref_count(self, block_id: int) -> int:
        """Number of live block tables holding physical block `block_id`."""
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.pool.num_blocks:
            raise ValueError(f"block_id must be an int in [0, {self.pool.num_blocks}), got {block_id!r}")
        return self.pool.ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether physical block `block_id` is in the radix tree (held or evictable)."""
        self.ref_count(block_id)  # validates
        return self.tree.node_of[block_id] is not None

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        return self.pool.num_evictable

    @property
    def num_in_use_blocks(self) -> int:
        """Held by a live sequence (or kept back until pending copy ops are taken)."""
        return self.pool.num_blocks - self.pool.num_free - self.pool.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self.tree.num_cached

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_namespaces(self) -> int:
        """(salt, adapter) namespaces held now: those with a cached block or a live sequence."""
        return len(self.tree.namespaces)

    @property
    def num_available_blocks(self) -> int:
        """Blocks a reservation can take: free, then evictable (minus pending copy sources,
        which are parked rather than freed when evicted)."""
        n = self.pool.num_free + self.pool.num_evictable
        if self.pool.pending_sources:
            ref, node_of = self.pool.ref, self.tree.node_of
            n -= sum(1 for b in self.pool.pending_sources if ref[b] == 0 and node_of[b] is not None)
        return n

    def stats(self) -> CacheStats:
        return build_stats(self)

    def take_events(self) -> list:
        """BlockStored / BlockRemoved events since the last call ([] unless enable_events)."""
        if self._events is None:
            return []
        events = self._events[:]
        self._events.clear()
        return events

    def check_invariants(self) -> None:
        """Full consistency check, O(blocks + table entries); AssertionError naming the fault."""
        check_manager(self)

    # ---- deprecated names (kept for one release) ---------------------------------------------------

    def reserve_slots(self, seq_id, num_tokens: int) -> int:
        """Deprecated: try_reserve() (bool) and blocks_short() (the shortfall). Returns 0 when
        done, else how many blocks are missing (and nothing changed)."""
        _deprecated("reserve_slots", "try_reserve() and blocks_short()")
        return self._reserve(self._seq(seq_id), count_arg(num_tokens, "num_tokens"))

    def mark_computed(self, seq_id, num_tokens: int) -> None:
        """Deprecated: mark_tokens_computed(seq_id, token_ids). Marks the next num_tokens
        known tokens computed."""
        _deprecated("mark_computed", "mark_tokens_computed(seq_id, token_ids)")
        seq = self._seq(seq_id)
        end = seq.num_computed + count_arg(num_tokens, "num_tokens")
        if end > len(seq.tokens):
            raise ValueError(f"num_tokens={num_tokens}: only {len(seq.tokens) - seq.num_computed} "
                             f"known tokens of {seq_id!r} are not computed yet (append_tokens first)")
        if end > seq.num_reserved:
            raise ValueError(f"num_tokens={num_tokens}: {seq_id!r} has slots reserved up to token "
                             f"{seq.num_reserved} only (reserve_slots first)")
        self._computed(seq, end)

    # ---- helpers --------------------------------------------------------------------------

    def _seq(self, seq_id) -> Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"seq_id {seq_id!r} is not a live sequence (never added, or already freed)") from None

    def _new_id(self, seq_id, name: str) -> None:
        try:
            in_use = seq_id in self._seqs
        except TypeError:
            raise ValueError(f"{name} must be hashable, got {type(seq_id).__name__}") from None
        if in_use:
            raise ValueError(f"{name} {seq_id!r} is already in use")

    @staticmethod
    def _ns_key(salt, adapter_id) -> tuple:
        if salt is None and adapter_id is None:  # the common case, without two calls
            return _NO_TENANT
        return normalize_salt(salt), adapter_bytes(adapter_id)

    def _new_namespace(self, key: tuple, salt, adapter_id) -> Namespace:
        ns = Namespace(key, key[0], adapter_id, salt, extra_keys(salt=salt, adapter_id=adapter_id))
        self.tree.add_namespace(ns)
        return ns

    def _match(self, ns: Namespace, tokens: array) -> tuple[list, int]:
        if not self.enable_prefix_caching or not ns.root.children:
            return [], 0
        return self.tree.match(ns.root, le_bytes(tokens), (len(tokens) - 1) // self.block_size)

    def _add(self, seq_id, tokens: array, ns: Namespace, path: list, n: int) -> int:
        tree = self.tree
        tree.advance_clock()
        if n:
            node, blocks = tree.lock(path)
        else:
            node, blocks = ns.root, []
        hit = n * self.block_size
        self._seqs[seq_id] = Sequence(tokens, blocks, ns, node, hit, n, hit)
        ns.num_seqs += 1
        self.prefix_query_tokens += len(tokens)
        self.prefix_hit_tokens += hit
        ns.query_tokens += len(tokens)
        ns.hit_tokens += hit
        return hit

    def _admit_short(self, tokens: array, path: list, n: int, lookahead: int) -> int:
        """Blocks missing to add this prompt with hit `path` (n blocks) and reserve the rest:
        the hit blocks that are evictable now are pinned by the add, so they do not count
        as available, and pending copy sources that would be parked do not either."""
        B = self.block_size
        need = -(-(len(tokens) + lookahead) // B) - n
        pool, tree = self.pool, self.tree
        available = pool.num_free + pool.num_evictable
        if n:
            available -= tree.unheld_blocks(path)
        if pool.pending_sources:
            ref, node_of = pool.ref, tree.node_of
            pinned = {b for node, k in path for b in node.blocks[:k]} if n else ()
            available -= sum(1 for b in pool.pending_sources
                             if ref[b] == 0 and node_of[b] is not None and b not in pinned)
        return max(0, need - available)

    def _reserve(self, seq: Sequence, num_tokens: int) -> int:
        """0 and the slots reserved, or the blocks missing and nothing changed."""
        new, cow = self._plan(seq, num_tokens)
        need = new + (cow >= 0)
        if need == 0:
            seq.num_reserved = max(seq.num_reserved, seq.num_computed + num_tokens)
            return 0
        available = self.num_available_blocks
        if need > available:
            return need - available
        self.tree.advance_clock()
        pool = self.pool
        while pool.num_free < need:  # nothing is evicted while a free block remains
            self.tree.evict(need - pool.num_free)
        blocks = pool.allocate(need)
        if cow >= 0:
            src, dst = seq.table[cow], blocks.pop()
            pool.add_copy(src, dst)
            seq.table[cow] = dst
            self.copy_on_write_blocks += 1
            pool.decref(src)
        seq.table += blocks
        seq.num_reserved = max(seq.num_reserved, seq.num_computed + num_tokens)
        return 0

    def _computed(self, seq: Sequence, end: int) -> None:
        """Tokens up to `end` (known, reserved) are computed; commit the new full blocks."""
        seq.num_computed = end
        full = end // self.block_size
        if self.enable_prefix_caching and full > seq.num_committed:
            B, first = self.block_size, seq.num_committed
            self.tree.advance_clock()
            seq.node = self.tree.commit(seq.node, seq.table, first, le_bytes(seq.tokens[first * B : full * B]))
            seq.num_committed = full

    def _plan(self, seq: Sequence, n: int) -> tuple[int, int]:
        """(new blocks, index of the block to copy first or -1) for reserving n slots."""
        B, done = self.block_size, seq.num_computed
        new = max(0, -(-(done + n) // B) - len(seq.table))
        cow = -1
        if n and done % B:
            # Writing into the partial block: copy it unless we are its last holder. A
            # cached block (another holder filled and committed it) is never written.
            b = seq.table[done // B]
            if self.pool.ref[b] > 1 or self.tree.node_of[b] is not None:
                cow = done // B
        return new, cow
