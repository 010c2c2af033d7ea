"""What the engine reports per step: incremental outputs of requests that had news."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int  # sample number
    new_token_ids: list[int]  # since the last output of this request
    token_ids: list[int]  # all generated so far
    logprobs: list[dict[int, float]] | None  # per new token: {sampled id: lp, top-k ids: lp}; None if not asked
    finish_reason: str | None  # None while running, else "stop" | "length" | "abort"
    cumulative_logprob: float
    text: str | None = None  # filled by the offline LLM API (the engine works on token ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool
    prompt: str | None = None  # filled by the offline LLM API
