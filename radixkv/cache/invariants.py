"""check_invariants(): every rule the cache manager relies on, checked from scratch.

Raises AssertionError (explicitly, so it works under python -O) naming what broke.
Cost O(blocks + table entries + cached tokens): for tests and idle-time checks.
"""


def _fail(msg: str) -> None:
    raise AssertionError(f"cache invariant broken: {msg}")


def check_manager(m) -> None:
    pool, tree, B = m.pool, m.tree, m.block_size
    N, ref, node_of = pool.num_blocks, pool.ref, tree.node_of
    pool.check(_fail)

    # Ref counts are exactly the table references.
    held = [0] * N
    for sid, seq in m._seqs.items():
        if len(set(seq.table)) != len(seq.table):
            _fail(f"sequence {sid!r} holds a block twice")
        for b in seq.table:
            held[b] += 1
    for b in range(N):
        if held[b] != ref[b]:
            _fail(f"block {b} has ref count {ref[b]} but {held[b]} tables hold it")

    # Every block is in exactly one state; the counters agree.
    free = set(pool._free)
    evictable = 0
    for b in range(N):
        states = (b in free) + (ref[b] > 0) + (node_of[b] is not None and ref[b] == 0) + (b in pool.parked)
        if states != 1:
            _fail(f"block {b} is in {states} states (free/referenced/evictable/parked)")
        if b in free and node_of[b] is not None:
            _fail(f"block {b} is free but still cached")
        evictable += node_of[b] is not None and ref[b] == 0
    if evictable != pool.num_evictable:
        _fail(f"{evictable} evictable blocks, counter says {pool.num_evictable}")
    in_use = sum(1 for b in range(N) if ref[b]) + len(pool.parked)
    if pool.num_free + pool.num_evictable + in_use != N:
        _fail(f"free {pool.num_free} + evictable {pool.num_evictable} + in use {in_use} != {N}")

    _check_tree(m)
    _check_namespaces(m)

    # Sequences: committed blocks are a chain of whole nodes from their namespace root.
    for sid, seq in m._seqs.items():
        if not seq.num_computed <= min(len(seq.tokens), seq.num_reserved):
            _fail(f"sequence {sid!r}: {seq.num_computed} computed > tokens or reserved slots")
        if seq.num_reserved > len(seq.table) * B:
            _fail(f"sequence {sid!r}: {seq.num_reserved} slots reserved but {len(seq.table)} blocks held")
        chain, node = [], seq.node
        while node.parent is not None:
            chain[:0] = node.blocks
            node = node.parent
        if node is not seq.ns.root:
            _fail(f"sequence {sid!r}: chain does not end at its namespace root")
        if chain != seq.table[: seq.num_committed]:
            _fail(f"sequence {sid!r}: committed blocks are not the tree chain ending at its node")
        want = seq.num_computed // B if m.enable_prefix_caching else 0
        if seq.num_committed != want:
            _fail(f"sequence {sid!r}: {seq.num_committed} committed blocks, expected {want}")


def _check_tree(m) -> None:
    pool, tree, hasher = m.pool, m.tree, m.hasher
    ref, node_of, bb = pool.ref, tree.node_of, tree.block_bytes
    cached = leaves = 0
    for ns in tree.namespaces.values():
        root = ns.root
        if root.blocks or root.parent is not None or root.ns is not ns:
            _fail("a namespace root holds blocks or has a parent")
        ns_blocks = 0
        stack = [(root, hasher.root_key)]
        while stack:
            parent, parent_key = stack.pop()
            for first, node in parent.children.items():
                if node.parent is not parent or node.ns is not ns:
                    _fail(f"node {node.uid} has a wrong parent or namespace")
                if not node.blocks or len(node.keys) != len(node.blocks) or len(node.tokens) != len(node.blocks) * bb:
                    _fail(f"node {node.uid} is empty or its blocks, keys and tokens disagree")
                if node.tokens[:bb] != first:
                    _fail(f"node {node.uid} is filed under another block's tokens")
                key, prev_ref = parent_key, ref[parent.blocks[-1]] if parent.blocks else 1
                for i, b in enumerate(node.blocks):
                    if node_of[b] is not node:
                        _fail(f"block {b} of node {node.uid} maps to another node")
                    tb = node.tokens[i * bb : (i + 1) * bb]
                    key = hasher.key(key, tb, ns.extra if parent is root and i == 0 else b"")
                    if key != node.keys[i]:
                        _fail(f"block {b}: stored key does not match its tokens and parent")
                    if ref[b] and not prev_ref:
                        _fail(f"block {b} is referenced but its parent block is evictable (orphan risk)")
                    prev_ref = ref[b]
                is_leaf = not node.children and ref[node.blocks[-1]] == 0
                if is_leaf != (node.lru_key is not None):
                    _fail(f"node {node.uid}: evictable leaf {is_leaf} but LRU entry {node.lru_key is not None}")
                if node.lru_key is not None and node.lru_key != (node.last_use, node.uid, node):
                    _fail(f"node {node.uid}: stale LRU entry")
                leaves += is_leaf
                ns_blocks += len(node.blocks)
                stack.append((node, node.keys[-1]))
        if ns_blocks != ns.cached_blocks:
            _fail(f"namespace {ns.label!r}: {ns_blocks} cached blocks, counter says {ns.cached_blocks}")
        cached += ns_blocks
    if cached != tree.num_cached or cached != sum(b is not None for b in node_of):
        _fail(f"{cached} blocks in the tree, counter says {tree.num_cached}")
    if leaves != len(tree.lru):
        _fail(f"{leaves} evictable leaves but {len(tree.lru)} LRU entries")


def _check_namespaces(m) -> None:
    """Held namespaces are exactly those with a cached block or a live sequence."""
    held = m.tree.namespaces
    live: dict = {}
    for sid, seq in m._seqs.items():
        if held.get(seq.ns.key) is not seq.ns:
            _fail(f"sequence {sid!r}: its namespace is not held")
        live[seq.ns.key] = live.get(seq.ns.key, 0) + 1
    for key, ns in held.items():
        if ns.key != key:
            _fail(f"namespace {ns.label!r} is filed under another key")
        if ns.num_seqs != live.get(key, 0):
            _fail(f"namespace {ns.label!r}: {live.get(key, 0)} live sequences, counter says {ns.num_seqs}")
        if not ns.num_seqs and not ns.cached_blocks:
            _fail(f"namespace {ns.label!r} is held with no cached block and no live sequence")
