"""What the engine reports per step: incremental outputs of requests that had news.

A beam search request reports once, when it finishes: its n best hypotheses, best first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int  # sample number (beam search: rank, 0 = best)
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
    # Block sharing within the request (peaks over its steps, in KV blocks): distinct blocks its
    # sequences held, and what they would hold with private copies (each sample or beam its own
    # prompt and history). The block-step sums give the time-averaged saving,
    # 1 - block_steps_held / block_steps_without_sharing.
    blocks_held: int = 0
    blocks_without_sharing: int = 0
    block_steps_held: int = 0
    block_steps_without_sharing: int = 0
    num_computed_prompt_tokens: int = 0  # prompt positions computed for it (once with n > 1; cache hits excluded)
