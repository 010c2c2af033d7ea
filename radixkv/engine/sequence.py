"""Requests and their sequences.

A Request owns one Sequence per sample. With n > 1 only the first sequence exists until its
prompt is computed; then the others are forked from it (sharing every block) and sample
their first token from the same logits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixkv.engine.sampling_params import SamplingParams


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
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (mirrors the cache manager)
    pending_forks: int = 0  # samples to fork from this sequence when its prompt is computed
    preempted: bool = False  # waiting again after a preemption: admitted before new sequences
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    num_emitted: int = 0  # output tokens already reported
    generator: object | None = None  # torch.Generator for seeded sampling, made on first use

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

    @property
    def finished(self) -> bool:
        return all(s.is_finished and s.pending_forks == 0 for s in self.seqs)
