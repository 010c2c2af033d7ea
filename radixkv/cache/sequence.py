"""Per-namespace and per-sequence state of the cache manager (plain records)."""

from array import array
from dataclasses import dataclass

from .radix_tree import Node


@dataclass(slots=True, eq=False)
class Namespace:
    """One (salt, adapter) pair: its own root, so different tenants never share a node.

    Held only while it has a cached block or a live sequence (the radix tree drops it when
    the last of both goes), so one-shot salts leave nothing behind.
    """

    key: tuple  # (normalized salt, adapter bytes): the radix tree's index of namespaces
    salt: bytes | None
    adapter_id: int | str | None
    label: object  # the salt as first given, for per-salt stats
    extra: bytes  # extra keys of the first block
    root: Node = None
    cached_blocks: int = 0
    num_seqs: int = 0  # live sequences
    query_tokens: int = 0
    hit_tokens: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    tokens: array  # every known token id: prompt, then appended ones
    table: list[int]  # logical block -> physical block
    ns: Namespace
    node: Node  # end of the chain of committed blocks (the namespace root if none)
    num_computed: int
    num_committed: int  # table[:num_committed] are in the tree, in chain order
    num_reserved: int  # slots [0, num_reserved) may be written (a reservation granted them)


def count_arg(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value
