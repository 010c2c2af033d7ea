"""Checks of a new request against the engine's limits; ParamError (a ValueError) naming the field.

The sampling fields' own rules live with SamplingParams (radixkv/sampling_params.py); what is
checked here needs the model and the pool, given as a RequestLimits.

NOTE: validate_request takes a RequestLimits, not the engine: the checks read five numbers
and the EOS ids, so they can be run (and tested) without a model, and what a request is judged
against is visible in one place. The engine builds one per request (Engine.limits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from radixkv.engine.beam_search import worst_case_blocks
from radixkv.engine.errors import ParamError
from radixkv.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # the context limit: min(model positions, KV pool tokens, configured)
    max_positions: int  # the model's own
    num_blocks: int  # KV pool
    block_size: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...] = ()

    def max_new_tokens(self, prompt_len: int, p: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        return room if p.max_tokens is None else min(p.max_tokens, room)

    def finish_token_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def _context(self) -> str:
        return (f"{self.max_model_len} tokens (model {self.max_positions}, "
                f"KV pool {self.num_blocks * self.block_size})")


def validate_request(limits: RequestLimits, request_id, prompt_token_ids, params, cache_salt,
                     in_use: Collection[str] = ()) -> None:
    """in_use: the ids of the requests the engine holds."""
    if not isinstance(request_id, str) or not request_id:
        raise ParamError("request_id", f"request_id must be a non-empty str, got {request_id!r}")
    if request_id in in_use:
        raise ParamError("request_id", f"request_id {request_id!r} is already in use")
    if not isinstance(params, SamplingParams):
        raise ParamError("params", f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ParamError("cache_salt", f"cache_salt must be None or a str, got {type(cache_salt).__name__}")
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise ParamError("prompt_token_ids", "prompt_token_ids must be a non-empty list of token ids")
    vocab = limits.vocab_size
    bad = next((t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab),
               None)
    if bad is not None:
        raise ParamError("prompt_token_ids", f"prompt_token_ids: {bad!r} is not a token id in [0, {vocab})")
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise ParamError("stop_token_ids", f"stop_token_ids: {bad} is not a token id in [0, {vocab})")
    n_prompt, limit = len(prompt_token_ids), limits.max_model_len
    if n_prompt >= limit:
        raise ParamError(
            "prompt_token_ids",
            f"prompt_token_ids: prompt of {n_prompt} tokens leaves no room to generate: the context limit is "
            f"{limits._context()}",
        )
    if params.max_tokens is not None and n_prompt + params.max_tokens > limit:
        raise ParamError(
            "max_tokens",
            f"max_tokens: prompt ({n_prompt}) + max_tokens ({params.max_tokens}) exceeds the context limit of "
            f"{limits._context()}",
        )
    if params.num_samples > limits.max_num_seqs:
        name = _width_field(params)
        raise ParamError(name, f"{name}: {params.num_samples} sequences exceed max_num_seqs ({limits.max_num_seqs})")
    if params.use_beam_search:
        _validate_beam_search(limits, n_prompt, params)


def _width_field(params: SamplingParams) -> str:
    """The field that set how many sequences the request runs."""
    if params.use_beam_search and params.beam_width is not None:
        return "beam_width"
    return "best_of" if params.best_of is not None else "n"


def _validate_beam_search(limits: RequestLimits, n_prompt: int, params: SamplingParams) -> None:
    W, vocab = params.num_beams, limits.vocab_size
    candidates = W * max(2, 1 + len(limits.finish_token_ids(params)))
    if candidates > vocab:
        name = _width_field(params)
        raise ParamError(name, f"{name}: {W} beams rank {candidates} candidates per step, more than the "
                               f"vocabulary ({vocab})")
    max_new = limits.max_new_tokens(n_prompt, params)
    need = worst_case_blocks(n_prompt, max_new, W, limits.block_size)
    if need > limits.num_blocks:
        raise ParamError("max_tokens", f"max_tokens: {W} beams over a prompt of {n_prompt} tokens may hold {need} KV "
                                       f"blocks ({max_new} new tokens each), more than the pool's {limits.num_blocks}; "
                                       "lower max_tokens or beam_width")
