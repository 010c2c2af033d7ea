"""Accounting snapshot and block events of the cache manager."""

import sys
from array import array
from dataclasses import dataclass, field

from .hashing import TOKEN_TYPECODE


@dataclass(frozen=True, slots=True)
class SaltUsage:
    """Per-tenant figures of a namespace the manager holds now. Its counters are totals since
    the namespace was created: a namespace is dropped once it has neither a cached block nor
    a live sequence, so a tenant that comes back starts from zero (the manager-wide counters
    of CacheStats keep counting)."""

    cached_blocks: int  # blocks of this salt in the radix tree (held or evictable)
    num_sequences: int  # live sequences with this salt
    prefix_query_tokens: int
    prefix_hit_tokens: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot. Gauges are counted in blocks; the prefix counters are token totals.

    free + evictable + in_use == num_blocks always. in_use_blocks counts blocks held by a
    live sequence, plus (rarely) blocks kept back until pending copy ops have been taken.
    """

    num_blocks: int
    block_size: int
    free_blocks: int
    evictable_blocks: int  # cached, held by no sequence
    in_use_blocks: int
    cached_blocks: int  # in the radix tree, held or not
    num_sequences: int
    slot_utilization: float  # tokens held / slots held, over live sequences (1.0 when none)
    last_block_slack: int  # slots held but holding no token, summed over live sequences
    prefix_query_tokens: int  # prompt tokens looked up by add_sequence (forks not counted)
    prefix_hit_tokens: int  # of those, served from the cache (the capped hit)
    evicted_blocks: int
    deduplicated_blocks: int  # computed blocks dropped at commit for an identical cached twin
    copy_on_write_blocks: int
    per_salt: dict = field(default_factory=dict)  # salt (as first given) -> SaltUsage, held namespaces
    num_namespaces: int = 0  # (salt, adapter) namespaces held now

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one chain entered the tree. parent_key is None for a chain
    that starts at its namespace root (the first block of a prompt). block_ids[i] is the
    physical block holding block_keys[i], so an offload tier can copy it out."""

    block_keys: tuple
    parent_key: bytes | None
    token_ids: tuple  # block_size * len(block_keys) ids
    block_size: int
    salt: bytes | None  # the namespace: salt as UTF-8 bytes (None: no tenant) ...
    adapter_id: int | str | None  # ... and adapter
    block_ids: tuple = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks of one namespace left the tree (evicted, or the prefix cache was reset);
    block_ids[i] held block_keys[i] and is free again."""

    block_keys: tuple
    block_ids: tuple = ()
    salt: bytes | None = None
    adapter_id: int | str | None = None


def build_stats(m) -> CacheStats:
    """Snapshot of a KVCacheManager; O(live sequences + held namespaces)."""
    B, pool, tree = m.block_size, m.pool, m.tree
    tokens = slots = 0
    for seq in m._seqs.values():
        held = len(seq.table) * B
        slots += held
        tokens += min(len(seq.tokens), held)
    per_salt: dict = {}
    for ns in tree.namespaces.values():  # one salt may have several adapters: add them up
        u = per_salt.get(ns.label)
        if u is None:
            per_salt[ns.label] = SaltUsage(ns.cached_blocks, ns.num_seqs, ns.query_tokens, ns.hit_tokens)
        else:
            per_salt[ns.label] = SaltUsage(u.cached_blocks + ns.cached_blocks, u.num_sequences + ns.num_seqs,
                                           u.prefix_query_tokens + ns.query_tokens,
                                           u.prefix_hit_tokens + ns.hit_tokens)
    return CacheStats(
        num_blocks=pool.num_blocks, block_size=B, free_blocks=pool.num_free, evictable_blocks=pool.num_evictable,
        in_use_blocks=pool.num_blocks - pool.num_free - pool.num_evictable, cached_blocks=tree.num_cached,
        num_sequences=len(m._seqs), slot_utilization=tokens / slots if slots else 1.0, last_block_slack=slots - tokens,
        prefix_query_tokens=m.prefix_query_tokens, prefix_hit_tokens=m.prefix_hit_tokens,
        evicted_blocks=tree.num_evicted, deduplicated_blocks=tree.num_dedup,
        copy_on_write_blocks=m.copy_on_write_blocks, per_salt=per_salt, num_namespaces=len(tree.namespaces))


def stored_event(ns, keys, parent_key, data: bytes, block_size: int, block_ids) -> BlockStored:
    toks = array(TOKEN_TYPECODE)
    toks.frombytes(data)
    if sys.byteorder == "big":
        toks.byteswap()
    return BlockStored(tuple(keys), parent_key, tuple(toks), block_size, ns.salt, ns.adapter_id, tuple(block_ids))
