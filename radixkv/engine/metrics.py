"""Engine metrics: the counters the engine keeps, the snapshot Engine.metrics() returns, and
the one conversion of that snapshot to the wire (protocol.EngineStats), used by the worker.

EngineCounters are totals since start, incremented in place by the engine. EngineMetrics is
a snapshot: those counters, the scheduler's figures and the cache manager's CacheStats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixkv import protocol as P

if TYPE_CHECKING:
    from radixkv.cache import CacheStats


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # prompt tokens of the requests added
    cached_prompt_tokens: int = 0  # of finished requests, served from the prefix cache
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens in the forwards
    computed_prompt_tokens: int = 0  # prompt positions computed (a prompt shared by n samples counts once)
    steps: int = 0
    requests_finished: int = 0
    requests_failed: int = 0  # requests the engine failed ("error"), among requests_finished
    # finished requests' block accounting (their RequestOutput.sharing), summed
    block_steps_held: int = 0
    block_steps_without_sharing: int = 0


@dataclass(kw_only=True)
class EngineMetrics(EngineCounters):
    running: int
    waiting: int
    preemptions: int
    beam_reserved_blocks: int  # blocks reserved for running beam searches' worst case
    num_blocks: int
    block_size: int
    max_model_len: int
    cache: CacheStats


def to_engine_stats(m: EngineMetrics, invariant_checks: int = 0) -> P.EngineStats:
    """The wire snapshot; `invariant_checks` is counted by the worker, which runs the checks."""
    c = m.cache
    return P.EngineStats(
        num_blocks=c.num_blocks, block_size=c.block_size, free_blocks=c.free_blocks,
        evictable_blocks=c.evictable_blocks, in_use_blocks=c.in_use_blocks, running=m.running, waiting=m.waiting,
        preemptions=m.preemptions, prompt_tokens=m.prompt_tokens, generation_tokens=m.generation_tokens,
        prefix_query_tokens=c.prefix_query_tokens, prefix_hit_tokens=c.prefix_hit_tokens,
        invariant_checks=invariant_checks, requests_failed=m.requests_failed,
    )
