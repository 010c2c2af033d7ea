"""KVCacheManager: the façade an engine drives (see docs/embedding.md for the rules)."""

from array import array

from .block_pool import BlockPool
from .hashing import TOKEN_TYPECODE, BlockHasher, adapter_bytes, extra_keys, le_bytes, normalize_salt, tokens_to_array
from .invariants import check_manager
from .radix_tree import RadixTree
from .sequence import Namespace, Sequence, count_arg
from .stats import CacheStats, build_stats


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
        self._namespaces: dict[tuple, Namespace] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.copy_on_write_blocks = 0

    # ---- sequences ------------------------------------------------------------------------

    def add_sequence(self, seq_id, token_ids, *, salt=None, adapter_id=None) -> int:
        """Register a prompt; returns its cached tokens, pinned (block aligned, capped at
        (len - 1) // B * B so one token is left to compute). Takes no free block."""
        self._new_id(seq_id, "seq_id")
        tokens = tokens_to_array(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty")
        ns = self._namespace(salt, adapter_id, create=True)
        self.tree.tick += 1
        node, blocks = ns.root, []
        if self.enable_prefix_caching:
            path, n = self.tree.match(ns.root, le_bytes(tokens), (len(tokens) - 1) // self.block_size)
            if n:
                node, blocks = self.tree.lock(path)
        hit = len(blocks) * self.block_size
        self._seqs[seq_id] = Sequence(tokens, blocks, ns, node, hit, len(blocks), hit)
        self.prefix_query_tokens += len(tokens)
        self.prefix_hit_tokens += hit
        ns.query_tokens += len(tokens)
        ns.hit_tokens += hit
        return hit

    def peek_prefix(self, token_ids, *, salt=None, adapter_id=None) -> int:
        """What add_sequence would return now; pins nothing, counts nothing."""
        tokens = tokens_to_array(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty")
        ns = self._namespace(salt, adapter_id, create=False)
        if ns is None or not self.enable_prefix_caching:
            return 0
        _, n = self.tree.match(ns.root, le_bytes(tokens), (len(tokens) - 1) // self.block_size)
        return n * self.block_size

    def append_tokens(self, seq_id, token_ids) -> None:
        """Tokens now known (e.g. sampled) but not computed yet."""
        seq = self._seq(seq_id)
        seq.tokens += tokens_to_array(token_ids)

    def num_blocks_needed(self, seq_id, num_tokens: int) -> int:
        """New blocks reserve_slots(seq_id, num_tokens) would take, copy-on-write included."""
        seq = self._seq(seq_id)
        new, cow = self._plan(seq, count_arg(num_tokens, "num_tokens"))
        return new + (cow >= 0)

    def reserve_slots(self, seq_id, num_tokens: int) -> int:
        """Slots for tokens [computed, computed + num_tokens). All or nothing: returns 0 when
        done, else how many blocks are missing (and nothing changed)."""
        seq = self._seq(seq_id)
        new, cow = self._plan(seq, count_arg(num_tokens, "num_tokens"))
        need = new + (cow >= 0)
        if need == 0:
            seq.num_reserved = max(seq.num_reserved, seq.num_computed + num_tokens)
            return 0
        available = self.num_available_blocks
        if need > available:
            return need - available
        self.tree.tick += 1
        pool = self.pool
        while pool.num_free < need:  # nothing is evicted while a free block remains
            self.tree.evict(need - pool.num_free)
        blocks = pool.allocate(need)
        if cow >= 0:
            src, dst = seq.table[cow], blocks.pop()
            pool.add_copy(src, dst)
            seq.table[cow] = dst
            self.copy_on_write_blocks += 1
            self._unref(src)
        seq.table += blocks
        seq.num_reserved = max(seq.num_reserved, seq.num_computed + num_tokens)
        return 0

    def mark_computed(self, seq_id, num_tokens: int) -> None:
        """KV of the next num_tokens tokens is written. Full blocks enter the tree (a block
        identical to a cached one switches the table entry to the cached twin)."""
        seq = self._seq(seq_id)
        end = seq.num_computed + count_arg(num_tokens, "num_tokens")
        if end > len(seq.tokens):
            raise ValueError(f"num_tokens={num_tokens}: only {len(seq.tokens) - seq.num_computed} "
                             f"known tokens of {seq_id!r} are not computed yet (append_tokens first)")
        if end > seq.num_reserved:
            raise ValueError(f"num_tokens={num_tokens}: {seq_id!r} has slots reserved up to token "
                             f"{seq.num_reserved} only (reserve_slots first)")
        seq.num_computed = end
        full = end // self.block_size
        if self.enable_prefix_caching and full > seq.num_committed:
            B, first = self.block_size, seq.num_committed
            self.tree.tick += 1
            seq.node = self.tree.commit(seq.node, seq.table, first, le_bytes(seq.tokens[first * B : full * B]))
            seq.num_committed = full

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block holding computed tokens, the partial last one too
        (copy-on-write later); blocks reserved but still empty stay with the parent."""
        parent = self._seq(parent_id)
        self._new_id(child_id, "child_id")
        shared = parent.table[: -(-parent.num_computed // self.block_size)]
        ref = self.pool.ref
        for b in shared:
            ref[b] += 1
        self._seqs[child_id] = Sequence(array(TOKEN_TYPECODE, parent.tokens), shared, parent.ns, parent.node,
                                        parent.num_computed, parent.num_committed, parent.num_computed)

    def free(self, seq_id) -> None:
        """Drop the sequence; its cached blocks stay in the tree (evictable once unheld)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        tree, pool, ref, node_of = self.tree, self.pool, self.pool.ref, self.tree.node_of
        tree.tick += 1
        table, nc = seq.table, seq.num_committed
        zeros = 0
        for i in range(nc):  # committed: all cached
            b = table[i]
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                zeros += 1
        tree.num_evictable += zeros
        for i in range(nc, len(table)):
            b = table[i]
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if node_of[b] is None:
                    pool.release(b)
                else:  # cached by another sequence while this one held it uncommitted
                    tree.unreferenced(b)
        if nc:
            tree.release_chain(seq.node)

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs to run before the next forward; each block appears
        in one role only, and none of them is handed out again before this call."""
        return self.pool.take_copy_ops()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block. Refused (returns False, nothing changes) while any block
        is held by a sequence."""
        referenced = self.pool.num_blocks - self.pool.num_free - self.tree.num_evictable - len(self.pool.parked)
        if referenced:
            return False
        self.tree.reset([ns.root for ns in self._namespaces.values()])
        return True

    # ---- queries ----------------------------------------------------------------------------

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_computed_tokens(self, seq_id) -> int:
        return self._seq(seq_id).num_computed

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id).tokens)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        return self.tree.num_evictable

    @property
    def num_available_blocks(self) -> int:
        """Blocks a reservation can take: free, then evictable (minus pending copy sources,
        which are parked rather than freed when evicted)."""
        n = self.pool.num_free + self.tree.num_evictable
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

    def _namespace(self, salt, adapter_id, *, create: bool) -> Namespace | None:
        key = (normalize_salt(salt), adapter_bytes(adapter_id))
        ns = self._namespaces.get(key)
        if ns is None and create:
            ns = Namespace(key[0], adapter_id, salt, extra_keys(salt=salt, adapter_id=adapter_id))
            ns.root = self.tree.new_root(ns)
            self._namespaces[key] = ns
        return ns

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

    def _unref(self, block: int) -> None:
        ref = self.pool.ref
        ref[block] -= 1
        if ref[block] == 0:
            if self.tree.node_of[block] is None:
                self.pool.release(block)
            else:
                self.tree.unreferenced(block)
