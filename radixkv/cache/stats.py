"""Accounting snapshot and block events of the cache manager."""

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SaltUsage:
    """Per-tenant figures; counters are totals since the manager was built."""

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
    per_salt: dict = field(default_factory=dict)  # salt (as first given) -> SaltUsage

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one chain entered the tree. parent_key is None for a chain
    that starts at its namespace root (the first block of a prompt)."""

    block_keys: tuple
    parent_key: bytes | None
    token_ids: tuple  # block_size * len(block_keys) ids
    block_size: int
    salt: bytes | None
    adapter_id: int | str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the tree (evicted, or the prefix cache was reset)."""

    block_keys: tuple
