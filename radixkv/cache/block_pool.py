"""The physical blocks and their lifecycle: ref counts, the free stack, the evictable
count, and pending copy-on-write ops.

BlockPool is the one owner of a block's state. It alone writes ref counts; every other
class reads `ref` and asks the pool to move a block: allocate() (free -> held), incref() /
incref_many() (held +1, or evictable -> held), decref() / decref_many() / decref_chain()
(held -1; at 0 an uncached block is released, a cached one becomes evictable and the radix
tree is told), evicted() (evictable -> free, once the tree has dropped the blocks).
"""


class BlockPool:
    """N block ids. `ref[b]` is the number of live block tables holding b.

    A block is in exactly one state: free (on the stack), referenced (ref > 0), cached and
    unreferenced (evictable; the radix tree knows it), or parked. Parked blocks are sources
    of pending copy ops that lost their last holder before the ops were taken: handing them
    out again could make one block both the source and the destination of copies that run
    in one launch, so they wait in `parked` until take_copy_ops().

    NOTE: the lifecycle lives here, not in the manager or the tree, so that the rule "ref
    falls to 0 -> release, or (cached) evictable; ref rises from 0 -> no longer evictable"
    is written once, and a tier under the cache (host offload) has one seam to hook: what
    the pool tells the tree. The tree owns what is cached (`node_of`), the LRU leaves and
    the clock; the pool reads `node_of` to tell a cached block from an uncached one.
    `ref` stays a plain list that anyone may read (the tree's walks and the manager's
    plans index it in their loops) but only this class writes; the batch methods keep
    their loops inside, so pinning a 150-block hit is one tight loop, as before.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks  # read by anyone, written here only
        self.num_evictable = 0  # cached blocks with ref 0
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._copy_src: dict[int, int] = {}  # pending copy ops, dst -> src, in order
        self._src_uses: dict[int, int] = {}  # src -> pending ops reading it
        self.parked: set[int] = set()
        self.tree = None  # the radix tree (attach()): knows cached blocks, hears of new evictable ones

    def attach(self, tree) -> None:
        """The radix tree that caches this pool's blocks: `tree.node_of[b]` says whether b is
        cached; tree.unreferenced(b) and tree.release_chain(node) hear of evictable blocks."""
        assert self.tree is None, "a pool serves one tree"
        self.tree = tree

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:  # O(N): for checks only
        return block in self._free

    # ---- lifecycle ----------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n free blocks, each with ref count 1. The caller made sure n are free."""
        assert 0 <= n <= len(self._free), (n, len(self._free))
        if n == 0:
            return []
        blocks = self._free[-n:]
        del self._free[-n:]
        ref = self.ref
        for b in blocks:
            ref[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        """One more table holds `block`: a held one, or a cached one (evictable until now)."""
        ref = self.ref
        if ref[block] == 0:
            assert self.tree.node_of[block] is not None, f"block {block} is free, not cached"
            self.num_evictable -= 1
        ref[block] += 1

    def incref_many(self, blocks: list[int]) -> None:
        """incref() of each block, given in chain order (a block after its parent), as lock's
        matched path and fork's table prefix are.

        No orphans (a held block's parent is held), so the unreferenced blocks of a chain
        are a tail of it: the first and last block say whether it is all, none or some,
        and only then a bisection finds where the tail starts; the increment loop has no
        test in it.
        """
        if not blocks:
            return
        ref = self.ref
        if ref[blocks[-1]] == 0:
            woke = self._zero_tail(blocks)
            assert woke <= self.num_evictable, (woke, self.num_evictable)
            self.num_evictable -= woke
        for b in blocks:
            ref[b] += 1

    def decref(self, block: int) -> None:
        """One table less holds `block`; at 0 it is released (uncached) or evictable (cached)."""
        ref = self.ref
        r = ref[block] - 1
        assert r >= 0, block
        ref[block] = r
        if r == 0:
            tree = self.tree
            if tree.node_of[block] is None:
                self._release(block)
            else:
                self.num_evictable += 1
                tree.unreferenced(block)

    def decref_many(self, blocks) -> None:
        """decref() of each block, in order; the loop inside."""
        ref, tree = self.ref, self.tree
        node_of = tree.node_of
        for b in blocks:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if node_of[b] is None:
                    self._release(b)
                else:  # cached by another sequence while this one held it uncommitted
                    self.num_evictable += 1
                    tree.unreferenced(b)

    def decref_chain(self, blocks: list[int], end) -> None:
        """A sequence dropped its committed chain: `blocks` (all cached, in chain order) ending
        at tree node `end`. Those that fall to 0 become evictable, and the tree is told once
        for the chain (release_chain marks every node of it used), not once per block.

        The decrement loop has no test in it: the chain's other holders hold root prefixes
        of it (no orphans), so the blocks at 0 after it are a tail, counted as in
        incref_many().
        """
        ref = self.ref
        for b in blocks:
            ref[b] -= 1
        if ref[blocks[-1]] == 0:
            self.num_evictable += self._zero_tail(blocks)
        self.tree.release_chain(end)

    def evicted(self, blocks) -> None:
        """Cached, unreferenced blocks the tree has just dropped (evicted, or the cache was
        reset): no longer evictable; free again (or parked), in the order given."""
        self.num_evictable -= len(blocks)
        assert self.num_evictable >= 0, self.num_evictable
        for b in blocks:
            self._release(b)

    def _zero_tail(self, blocks: list[int]) -> int:
        """How many blocks at the end of `blocks` have ref 0, given that those are a tail and
        the last one has ref 0."""
        ref = self.ref
        if ref[blocks[0]] == 0:
            return len(blocks)
        lo, hi = 1, len(blocks) - 1  # index of the first zero is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if ref[blocks[mid]]:
                lo = mid + 1
            else:
                hi = mid
        return len(blocks) - lo

    def _release(self, block: int) -> None:
        """An unreferenced, uncached block goes back to the free stack (or is parked)."""
        assert self.ref[block] == 0, block
        if self._copy_src:
            src = self._copy_src.pop(block, None)
            if src is not None:  # its copy has no reader any more: drop the op
                self._drop_use(src)
            if block in self._src_uses:
                self.parked.add(block)
                return
        self._free.append(block)

    # ---- copy-on-write ops --------------------------------------------------------------

    def add_copy(self, src: int, dst: int) -> None:
        # A source that is itself a pending destination will only hold its own source's
        # bytes once the ops run: read from that source directly, so ops never chain.
        src = self._copy_src.get(src, src)
        self._copy_src[dst] = src
        self._src_uses[src] = self._src_uses.get(src, 0) + 1

    @property
    def pending_sources(self):
        return self._src_uses.keys()

    def take_copy_ops(self) -> list[tuple[int, int]]:
        ops = [(src, dst) for dst, src in self._copy_src.items()]
        self._copy_src.clear()
        self._src_uses.clear()
        self._free.extend(self.parked)
        self.parked.clear()
        return ops

    def _drop_use(self, src: int) -> None:
        left = self._src_uses[src] - 1
        if left:
            self._src_uses[src] = left
            return
        del self._src_uses[src]
        if src in self.parked:
            self.parked.remove(src)
            self._free.append(src)

    # ---- checks ---------------------------------------------------------------------------

    def check(self, fail) -> None:
        free = self._free
        if len(set(free)) != len(free):
            fail("a block is on the free list twice")
        for b in free:
            if self.ref[b]:
                fail(f"block {b} is free and referenced (ref {self.ref[b]})")
        if self.parked & set(free):
            fail("a parked block is also free")
        for b in self.parked:
            if self.ref[b] or b not in self._src_uses:
                fail(f"parked block {b} is referenced or no longer a copy source")
        for dst, src in self._copy_src.items():
            if self.ref[dst] == 0:
                fail(f"pending copy {src}->{dst} writes a block nobody holds")
            if dst in self._src_uses:
                fail(f"block {dst} is both source and destination of pending copies")
