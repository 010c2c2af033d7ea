"""Drive radixkv's cache manager from a toy engine, end to end, without torch.

The "model" here writes, for each token, a stand-in for its KV: a value that depends on
the whole prefix up to that token (as real KV does). The engine keeps a flat slot array
(num_blocks * block_size), turns block tables into slot mappings, runs the copy ops the
manager emits, and checks that every token it reads back is right, so a wrong prefix
hit, a missed copy-on-write or a recycled block would show up as an error.

    python examples/embed_cache.py
"""

import random
from collections import deque

from radixkv.cache import BlockRemoved, BlockStored, KVCacheManager

BLOCK = 16


def kv_of(prefix: tuple) -> int:
    """What a forward pass would write for the last token of `prefix` (a stand-in)."""
    return hash(prefix)


class ToyEngine:
    def __init__(self, num_blocks: int):
        self.cache = KVCacheManager(num_blocks, BLOCK, enable_events=True)
        self.slots = [None] * (num_blocks * BLOCK)  # the "KV cache" tensor
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.rng = random.Random(0)

    # -- admission ---------------------------------------------------------------------------
    def admit(self, rid: str, prompt: list[int], salt=None) -> bool:
        """Admit if the uncached part of the prompt fits; returns False to retry later."""
        if not self.cache.try_admit(rid, prompt, salt=salt):  # pins the hit, reserves the rest
            return False  # refused: nothing changed (no counter, no LRU position)
        hit = self.cache.num_computed_tokens(rid)
        self.tokens[rid], self.outputs[rid] = list(prompt), []
        print(f"  {rid:>8}: {len(prompt)} prompt tokens, {hit} from the cache")
        self.forward(rid, prompt[hit:])
        return True

    # -- one forward over `new`, the tokens right after the computed ones -----------------------
    def forward(self, rid: str, new: list[int]) -> None:
        for src, dst in self.cache.take_copy_ops():  # copy-on-write, before any write
            self.slots[dst * BLOCK : (dst + 1) * BLOCK] = self.slots[src * BLOCK : (src + 1) * BLOCK]
        table, done, toks = self.cache.block_table(rid), self.cache.num_computed_tokens(rid), self.tokens[rid]
        for i in range(done):  # attention reads the cached prefix: check it is ours
            assert self.slots[table[i // BLOCK] * BLOCK + i % BLOCK] == kv_of(tuple(toks[: i + 1])), (rid, i)
        for i in range(done, done + len(new)):  # slot mapping: block_table[i // B] * B + i % B
            self.slots[table[i // BLOCK] * BLOCK + i % BLOCK] = kv_of(tuple(toks[: i + 1]))
        self.cache.mark_tokens_computed(rid, new)  # checked against the prompt; full blocks enter the tree

    # -- decoding ----------------------------------------------------------------------------
    def decode_step(self, rid: str) -> bool:
        """Sample one token and run it; False when the pool is out of blocks."""
        if not self.cache.try_reserve(rid, 1):  # blocks_short(rid, 1) would say how many are missing
            return False
        tok = self.rng.randrange(1000)
        self.tokens[rid].append(tok)
        self.outputs[rid].append(tok)
        self.forward(rid, [tok])  # the manager learns the token as it is marked computed
        return True

    def fork(self, parent: str, child: str) -> None:
        """Parallel sampling: the child shares every block, the partial last one too."""
        self.cache.fork(parent, child)
        self.tokens[child], self.outputs[child] = list(self.tokens[parent]), list(self.outputs[parent])

    def finish(self, rid: str) -> None:
        self.cache.free(rid)  # cached blocks stay, evictable
        del self.tokens[rid], self.outputs[rid]


def main() -> None:
    rng = random.Random(1)
    system = [rng.randrange(1000) for _ in range(300)]  # a shared system prompt, ~19 blocks
    engine = ToyEngine(num_blocks=40)  # small, so that old blocks get evicted
    print("requests sharing a system prompt (the second and later ones hit it):")
    queue = deque((f"req{i}", system + [rng.randrange(1000) for _ in range(40)]) for i in range(10))
    queue.append(("tenant-b", system + [1, 2, 3]))  # another salt: no hit across tenants
    while queue:
        rid, prompt = queue.popleft()
        salt = "b" if rid == "tenant-b" else None
        assert engine.admit(rid, prompt, salt=salt)
        for _ in range(20):
            assert engine.decode_step(rid)
        if rid == "req0":  # n = 3 parallel samples from req0's state
            engine.fork("req0", "req0.1")
            engine.fork("req0", "req0.2")
            for _ in range(20):
                for r in ("req0", "req0.1", "req0.2"):
                    assert engine.decode_step(r)
            engine.finish("req0.1")
            engine.finish("req0.2")
        engine.finish(rid)
        engine.cache.check_invariants()
    st = engine.cache.stats()
    print(f"hit rate {st.hit_rate:.1%}, {st.copy_on_write_blocks} copy-on-write blocks, "
          f"{st.evicted_blocks} evicted, {st.cached_blocks} cached, {st.free_blocks} free")
    events = engine.cache.take_events()
    stored = sum(len(e.block_ids) for e in events if isinstance(e, BlockStored))
    removed = sum(len(e.block_ids) for e in events if isinstance(e, BlockRemoved))
    print(f"events for a router or an offload tier (keys and block ids): {stored} blocks stored, {removed} removed")
    assert stored - removed == st.cached_blocks
    assert st.hit_rate > 0.5 and st.copy_on_write_blocks >= 2 and st.evicted_blocks > 0


if __name__ == "__main__":
    main()
