"""The physical block ids: a free stack, ref counts, and pending copy-on-write ops."""


class BlockPool:
    """N block ids. `ref[b]` is the number of live block tables holding b.

    A block is in exactly one state: free (on the stack), referenced (ref > 0), cached and
    unreferenced (evictable; the radix tree knows it), or parked. Parked blocks are sources
    of pending copy ops that lost their last holder before the ops were taken: handing them
    out again could make one block both the source and the destination of copies that run
    in one launch, so they wait in `parked` until take_copy_ops().
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._copy_src: dict[int, int] = {}  # pending copy ops, dst -> src, in order
        self._src_uses: dict[int, int] = {}  # src -> pending ops reading it
        self.parked: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:  # O(N): for checks only
        return block in self._free

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

    def release(self, block: int) -> None:
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
