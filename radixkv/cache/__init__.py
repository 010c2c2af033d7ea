"""radixkv.cache: the embeddable prefix-cache manager (pure Python, no torch).

    from radixkv.cache import KVCacheManager
    m = KVCacheManager(num_blocks=1024, block_size=16)
    if m.try_admit("req-1", prompt_ids):                # hit pinned, the rest reserved; False: nothing changed
        cached = m.num_computed_tokens("req-1")          # tokens served from the cache
        ...run the model on m.block_table("req-1")...
        m.mark_tokens_computed("req-1", prompt_ids[cached:])  # full blocks enter the radix tree
        m.free("req-1")

Rules and an end-to-end example: docs/embedding.md.
"""

from .hashing import HASH_ALGOS, BlockHasher, extra_keys, prompt_block_keys
from .manager import KVCacheManager
from .stats import BlockRemoved, BlockStored, CacheStats, SaltUsage

__all__ = [
    "HASH_ALGOS",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "KVCacheManager",
    "SaltUsage",
    "extra_keys",
    "prompt_block_keys",
]
