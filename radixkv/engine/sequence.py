"""Requests and their sequences.

A Request owns one Sequence per sample. With n > 1 only the first sequence exists until its
prompt is computed; then the others are forked from it (sharing every block) and sample
their first token from the same logits. With beam search, `seqs` holds the live beams, best
first; each step replaces them (forks of the chosen parents, see beam_search.py).

A request's sequences form a group with two scheduling properties, whatever made them: `gang`
(all live sequences run in the same step or none does) and `pinned_blocks` (> 0: never
preempted; that many blocks, the group's worst case, are reserved when it is admitted).
Beam search sets both, since the next beams are chosen from all beams' logits at once.

NOTE: how many tokens of a sequence are computed is the cache manager's fact (its record of
the sequence); `Sequence.num_computed_tokens` reads it there, so no second count is kept in
step with it. A sequence not running holds no cache record and has none computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixkv.cache import KVCacheManager
    from radixkv.engine.beam_search import BeamSearch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int  # the cache manager's key; kept across preemption
    request: "Request"
    index: int  # sample number within the request
    token_ids: list[int]  # prompt + output so far
    cache: "KVCacheManager"  # holds the sequence's record (blocks, computed tokens) while it runs
    status: Status = Status.WAITING
    pending_forks: int = 0  # samples to fork from this sequence when its prompt is computed
    preempted: bool = False  # waiting again after a preemption: admitted before new sequences
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_emitted: int = 0  # output tokens already reported
    generator: object | None = None  # torch.Generator for seeded sampling, made on first use
    matcher: object | None = None  # xgrammar GrammarMatcher of a constrained request (engine/structured.py)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache."""
        if self.status is not Status.RUNNING:
            return 0
        return self.cache.num_computed_tokens(self.seq_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def seed(self) -> int | None:
        s = self.request.params.seed
        return None if s is None else s + self.index


@dataclass
class BlockSharing:
    """KV blocks a request's sequences hold with block sharing vs with private copies (each
    sample or beam its own prompt and history), sampled after the forward of every step the
    request runs in (before that step's forks, frees and finishes)."""

    peak_held: int = 0
    peak_without_sharing: int = 0
    block_steps_held: int = 0  # summed over steps: 1 - held / without is the time-averaged saving
    block_steps_without_sharing: int = 0

    def add(self, held: int, without: int) -> None:
        self.peak_held = max(self.peak_held, held)
        self.peak_without_sharing = max(self.peak_without_sharing, without)
        self.block_steps_held += held
        self.block_steps_without_sharing += without

    def add_alone(self, blocks: int) -> None:
        """One sequence: nothing to share within the request."""
        if blocks > self.peak_held:
            self.peak_held = self.peak_without_sharing = blocks
        self.block_steps_held += blocks
        self.block_steps_without_sharing += blocks


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order, for FCFS
    cache_salt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
    aborted: bool = False
    beam: "BeamSearch | None" = None  # beam search state (use_beam_search)
    gang: bool = False  # its live sequences are scheduled together (see the module docstring)
    pinned_blocks: int = 0  # > 0: never preempted, this worst case reserved at admission
    grammar: object | None = None  # the compiled grammar of params.structured_outputs
    num_computed_prompt_tokens: int = 0  # prompt positions computed, over all sequences and recomputes
    sharing: BlockSharing = field(default_factory=BlockSharing)

    def record_blocks(self, cache, block_size: int) -> None:
        """Sample what the live sequences hold now: distinct blocks, and what private copies would take."""
        live = [s for s in self.seqs if s.status is Status.RUNNING]
        if not live:
            return
        without = sum(-(-s.num_computed_tokens // block_size) for s in live)
        held = without if len(live) == 1 else len(set().union(*(cache.block_table(s.seq_id) for s in live)))
        self.sharing.add(held, without)

    @property
    def finished(self) -> bool:
        return all(s.is_finished and s.pending_forks == 0 for s in self.seqs)
