"""Radix tree over full KV blocks: match, lock, commit (with dedup), split, LRU eviction.

A node holds a run of consecutive full blocks: their ids, their keys and their tokens as
one canonical byte string (uint32 little-endian). Within a node's children a child is
keyed by the bytes of its first block, so a lookup compares tokens (dict lookup, then one
memcmp per node) and computes no hash; a match is exact by construction. Each namespace
(salt, adapter) has its own root, so different salts never share a node; the tree keeps
the namespaces it holds in `namespaces` and drops one as soon as it has neither a cached
block nor a live sequence (its last block evicted, its last sequence freed, or a reset), so
the state kept per tenant is bounded by what that tenant has cached or running.

Who owns what: the tree owns what is cached (`node_of`, the nodes), the evictable leaves
(`lru`) and the LRU clock (`tick`, advanced by advance_clock() only). Ref counts and the
evictable count belong to the BlockPool, which alone writes them: the tree pins a hit with
pool.incref_many(), swaps in a twin with pool.incref() / pool.decref(), hands evicted
blocks back with pool.evicted(), and hears from the pool when a cached block falls to 0
(unreferenced(), release_chain()).

Every live sequence's committed blocks are a chain of whole nodes from its root (nodes
split where a chain ends inside one), so a node's blocks are used together and one
`last_use` per node orders them. An evictable leaf is a childless node whose last block is
unreferenced; eviction takes blocks from the tail of the least recently used one, so a
chain never loses its middle.
"""

from itertools import count

from sortedcontainers import SortedList

from .block_pool import BlockPool
from .hashing import TOKEN_BYTES, BlockHasher
from .stats import BlockRemoved, stored_event


class Node:
    __slots__ = ("parent", "children", "blocks", "keys", "tokens", "ns", "last_use", "lru_key", "uid")

    def __init__(self, parent, ns, uid: int, last_use: int):
        self.parent: Node | None = parent
        self.children: dict[bytes, Node] = {}
        self.blocks: list[int] = []
        self.keys: list[bytes] = []
        self.tokens = b""
        self.ns = ns
        self.last_use = last_use
        self.lru_key = None  # set while the node is an evictable leaf
        self.uid = uid


class LRUPolicy:
    """Evictable leaves, least recently used first (ties: older node first)."""

    __slots__ = ("_order",)

    def __init__(self):
        self._order = SortedList()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, node: Node) -> None:
        node.lru_key = (node.last_use, node.uid, node)
        self._order.add(node.lru_key)

    def remove(self, node: Node) -> None:
        self._order.remove(node.lru_key)
        node.lru_key = None

    def pop(self) -> Node:
        node = self._order.pop(0)[2]
        node.lru_key = None
        return node

    def clear(self) -> None:
        for _, _, node in self._order:
            node.lru_key = None
        self._order.clear()


class RadixTree:
    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher, events: list | None):
        self.pool, self.hasher, self.events = pool, hasher, events
        self.block_size = block_size
        self.block_bytes = block_size * TOKEN_BYTES
        self.node_of: list[Node | None] = [None] * pool.num_blocks  # cached block -> its node
        self.num_cached = 0
        self.num_evicted = 0
        self.num_dedup = 0
        self.lru = LRUPolicy()
        self.tick = 0  # the LRU clock: written by advance_clock() only
        self._uids = count()
        self.namespaces: dict = {}  # Namespace.key -> Namespace, held ones only
        pool.attach(self)

    def advance_clock(self) -> None:
        """Start a new time for last_use: called once per manager operation that may use
        blocks (admission, reservation, commit, free).

        NOTE: one tick per operation, not per touch: the nodes one operation uses (a
        chain released at free, the blocks of one commit) are equally recent, and their
        ties go by node age (uid). A clock moved per touch would order them by the order
        the operation happened to visit them in instead. Only the manager knows where an
        operation starts, so it calls this; nothing else moves the clock.
        """
        self.tick += 1

    # ---- namespaces -------------------------------------------------------------------------

    def add_namespace(self, ns) -> None:
        ns.root = Node(None, ns, next(self._uids), 0)
        self.namespaces[ns.key] = ns

    def drop_if_unused(self, ns) -> None:
        """Forget a namespace that has no cached block and no live sequence; its root has no
        children then, so nothing else refers to it."""
        if not ns.cached_blocks and not ns.num_seqs and self.namespaces.get(ns.key) is ns:
            del self.namespaces[ns.key]
            ns.root = None  # root <-> namespace is a cycle: break it so both go at once, not at a GC pass

    # ---- public API -----------------------------------------------------------------------

    def match(self, root: Node, data: bytes, max_blocks: int) -> tuple[list, int]:
        """Longest cached prefix of `data` (canonical token bytes) under `root`.

        How: a node's children are keyed by the bytes of their first block, so the walk is
        one dict lookup per node (bytes hash and compare in C; no block key is hashed) and
        then one `startswith` (a memcmp) over the rest of the child's run. Only when that
        memcmp fails, i.e. the prompt leaves the tree inside a node, does a bisection over
        slices find the first differing block. The Python work is per node, not per block:
        a 2,400-token system prompt cached as one node costs one lookup and one memcmp.

        Exact: a hit is decided by comparing token bytes, never keys, so no hash collision
        can produce a wrong hit.

        Stops at the first block that differs, at the end of the tree, or after
        `max_blocks` blocks (the caller's cap, which keeps at least one prompt token to
        compute). Returns ([(node, k)], blocks): the path, where k is how many leading
        blocks of that node matched (k < len only for the last entry), and the total.
        Changes nothing: no pin, no LRU touch, no counter.
        """
        bb = self.block_bytes
        path, pos, node = [], 0, root
        while pos < max_blocks:
            off = pos * bb
            child = node.children.get(data[off : off + bb])
            if child is None:
                break
            n = len(child.blocks)
            k = min(n, max_blocks - pos)
            if k > 1:
                run = child.tokens if k == n else memoryview(child.tokens)[: k * bb]
                if not data.startswith(run, off):
                    k = self._common_blocks(child.tokens, data, off, k)
            path.append((child, k))
            pos += k
            if k < n:
                break
            node = child
        return path, pos

    def lock(self, path: list) -> tuple[Node, list[int]]:
        """Pin a matched path for a new sequence: split the last node where the hit ends,
        take a reference on every block, mark the nodes used. Returns (chain end, blocks)."""
        last, k = path[-1]
        if k < len(last.blocks):
            path = path[:-1] + [(self._split(last, k), k)]
        blocks, tick, lru = [], self.tick, self.lru
        for node, _ in path:
            if node.lru_key is not None:
                lru.remove(node)
            node.last_use = tick
            blocks += node.blocks
        self.pool.incref_many(blocks)  # the path is a chain: the pool's tight loop applies
        return path[-1][0], blocks

    def unheld_blocks(self, path: list) -> int:
        """How many blocks of a matched path are evictable now (what lock() would take out
        of the evictable count); changes nothing."""
        ref, n = self.pool.ref, 0
        for node, k in path:
            nb = node.blocks
            if ref[nb[0]] == 0:
                n += k
            elif ref[nb[k - 1]] == 0:
                n += sum(1 for b in nb[:k] if ref[b] == 0)
        return n

    def commit(self, node: Node, table: list[int], first: int, data: bytes) -> Node:
        """Enter table[first:first + len(data) // block_bytes] (full, computed, held by the
        calling sequence whose chain ends at `node`) into the tree; return the new chain end.

        A block identical to a cached child is deduplicated: the table switches to the cached
        twin and the sequence's own copy is released at once. From the first block with no
        twin on, the rest of the call lands in one leaf (the sequence's own leaf, extended in
        place, or a new child), since a node just grown by this call has no other children.
        """
        bb = self.block_bytes
        end = first + len(data) // bb
        j = first
        while j < end:
            off = (j - first) * bb
            twin = node.children.get(data[off : off + bb]) if node.children else None
            if twin is None:
                break
            node = self._take_twin(twin, table, j)
            j += 1
        if j == end:
            return node
        ns, blocks, rest = node.ns, table[j:end], data[(j - first) * bb :]
        parent_key = node.keys[-1] if node.blocks else self.hasher.root_key
        keys = self.hasher.chain(parent_key, rest, bb, ns.extra if j == 0 else b"")
        if node.parent is None or node.children or self.pool.ref[node.blocks[-1]] != 1:
            child = Node(node, ns, next(self._uids), self.tick)
            node.children[rest[:bb]] = child
            node = child
        node.blocks += blocks
        node.keys += keys
        node.tokens += rest
        node.last_use = self.tick
        node_of = self.node_of
        for b in blocks:
            node_of[b] = node
        self.num_cached += len(blocks)
        ns.cached_blocks += len(blocks)
        if self.events is not None:
            self.events.append(stored_event(ns, keys, None if j == 0 else parent_key, rest, self.block_size, blocks))
        return node

    def release_chain(self, node: Node) -> None:
        """A sequence whose chain ends at `node` dropped its references: mark the chain
        used now, and queue the end as an evictable leaf if that is what it became."""
        tick, end = self.tick, node
        while node.parent is not None:
            node.last_use = tick
            node = node.parent
        self.leaf_check(end)

    def unreferenced(self, block: int) -> None:
        """The pool says: a cached block's ref count just fell to 0 outside a chain release
        (it has counted the block evictable); queue its node if it became an evictable leaf."""
        node = self.node_of[block]
        if node.blocks[-1] == block:
            node.last_use = self.tick
            self.leaf_check(node)

    def leaf_check(self, node: Node) -> None:
        if (node.parent is not None and node.lru_key is None and not node.children
                and node.blocks and self.pool.ref[node.blocks[-1]] == 0):
            self.lru.add(node)

    def evict(self, n: int) -> None:
        """Remove n unreferenced blocks from the tree, LRU leaves first; release them. A
        namespace left with no cached block and no live sequence is dropped."""
        ref, bb, pool, node_of, events = self.pool.ref, self.block_bytes, self.pool, self.node_of, self.events
        while n > 0:
            node = self.lru.pop()
            blocks = node.blocks
            cut = len(blocks)
            while cut and n and ref[blocks[cut - 1]] == 0:
                cut -= 1
                n -= 1
            gone = blocks[cut:]
            ns = node.ns
            if events is not None:  # tail first: the order they were removed in
                events.append(BlockRemoved(tuple(reversed(node.keys[cut:])), tuple(reversed(gone)),
                                           ns.salt, ns.adapter_id))
            first_bytes = node.tokens[:bb]
            del blocks[cut:], node.keys[cut:]
            node.tokens = node.tokens[: cut * bb]
            self.num_cached -= len(gone)
            self.num_evicted += len(gone)
            ns.cached_blocks -= len(gone)
            for b in gone:
                node_of[b] = None
            pool.evicted(gone[::-1])  # tail first, as removed
            if cut == 0:  # the node is gone; its parent may have become a leaf
                parent = node.parent
                del parent.children[first_bytes]
                node.parent = None
                self.leaf_check(parent)
                if not ns.cached_blocks:
                    self.drop_if_unused(ns)
            else:
                self.leaf_check(node)

    def reset(self) -> None:
        """Drop every cached block (the caller checked that none is referenced), and every
        namespace without a live sequence."""
        events = self.events
        for ns in list(self.namespaces.values()):
            root, keys, ids = ns.root, [], []
            stack = list(root.children.values())
            root.children.clear()
            while stack:
                node = stack.pop()
                stack += node.children.values()
                keys += node.keys
                ids += node.blocks
                for b in node.blocks:
                    self.node_of[b] = None
                self.pool.evicted(node.blocks)
            ns.cached_blocks = 0
            if events is not None and keys:
                events.append(BlockRemoved(tuple(keys), tuple(ids), ns.salt, ns.adapter_id))
            self.drop_if_unused(ns)
        self.lru.clear()
        self.num_cached = 0
        assert self.pool.num_evictable == 0, self.pool.num_evictable

    # ---- helpers --------------------------------------------------------------------------

    def _common_blocks(self, tokens: bytes, data: bytes, off: int, k: int) -> int:
        """Number of leading blocks (>= 1, < k) of `tokens` equal to data[off:]; the first
        block is known equal and the first k are known not all equal."""
        bb = self.block_bytes
        lo, hi = 1, k - 1  # answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data[off : off + mid * bb] == tokens[: mid * bb]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k blocks; the new upper node takes its place."""
        bb = self.block_bytes
        top = Node(node.parent, node.ns, next(self._uids), node.last_use)
        top.blocks, node.blocks = node.blocks[:k], node.blocks[k:]
        top.keys, node.keys = node.keys[:k], node.keys[k:]
        top.tokens, node.tokens = node.tokens[: k * bb], node.tokens[k * bb :]
        node.parent.children[top.tokens[:bb]] = top
        top.children[node.tokens[:bb]] = node
        node.parent = top
        for b in top.blocks:
            self.node_of[b] = top
        return top

    def _take_twin(self, twin: Node, table: list[int], j: int) -> Node:
        own, t = table[j], twin.blocks[0]
        if len(twin.blocks) > 1:
            twin = self._split(twin, 1)
        elif twin.lru_key is not None:
            self.lru.remove(twin)
        pool = self.pool
        pool.incref(t)  # evictable until now, perhaps
        twin.last_use = self.tick
        table[j] = t
        pool.decref(own)  # the sequence's own copy, uncached: released at once
        self.num_dedup += 1
        return twin
