"""What the engine reports per step: incremental outputs of requests that had news.

A beam search request reports once, when it finishes: its n best hypotheses, best first.
A request the engine failed reports once more, finished: finish_reason "error" on every
choice it had not finished (failed_output). A finished output carries the request's block
sharing accounting (SharingStats); to_delta is the one conversion of an output to the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixkv import protocol as P

if TYPE_CHECKING:
    from radixkv.engine.sequence import Request


@dataclass
class CompletionOutput:
    index: int  # sample number (beam search: rank, 0 = best)
    new_token_ids: list[int]  # since the last output of this request
    token_ids: list[int]  # all generated so far
    logprobs: list[dict[int, float]] | None  # per new token: {sampled id: lp, top-k ids: lp}; None if not asked
    finish_reason: str | None  # None while running, else "stop" | "length" | "abort" | "error"
    cumulative_logprob: float
    text: str | None = None  # filled by the offline LLM API (the engine works on token ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SharingStats:
    """A request's accounting, on its finished output. Block sharing within the request (peaks
    over its steps, in KV blocks): distinct blocks its
    sequences held, and what they would hold with private copies (each sample or beam its own
    prompt and history). The block-step sums give the time-averaged saving,
    1 - block_steps_held / block_steps_without_sharing."""

    blocks_held: int = 0
    blocks_without_sharing: int = 0
    block_steps_held: int = 0
    block_steps_without_sharing: int = 0
    num_computed_prompt_tokens: int = 0  # prompt positions computed for it (once with n > 1; cache hits excluded)


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finished: bool
    prompt: str | None = None  # filled by the offline LLM API
    sharing: SharingStats | None = None  # on the finished output only


def request_output(req: "Request", finished: bool) -> RequestOutput | None:
    """What `req` reports now: new tokens of each sample; with best_of or beam search, only the n
    best and only at the end (None before)."""
    p = req.params
    if req.beam is not None:
        if not finished:
            return None
        live = req.seqs if req.aborted else None  # an aborted search also ranks its running beams
        want_lp = p.logprobs is not None
        completions = [CompletionOutput(rank, list(h.token_ids), list(h.token_ids), h.logprobs if want_lp else None,
                                        h.finish_reason, h.cumulative_logprob)
                       for rank, h in enumerate(req.beam.results(p.n, live))]
        return _make_output(req, completions, finished)
    seqs = req.seqs if len(req.seqs) == 1 else sorted(req.seqs, key=lambda s: s.index)
    best_of = p.num_samples > p.n
    if best_of:
        if not finished:
            return None
        if not req.aborted:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)
        seqs = seqs[: p.n]
        for s in seqs:
            s.num_emitted = 0
    completions = []
    for rank, s in enumerate(seqs):
        out_ids = s.token_ids[s.num_prompt_tokens :]
        new = out_ids[s.num_emitted :]
        lps = s.logprobs[s.num_emitted :] if p.logprobs is not None else None
        s.num_emitted = len(out_ids)
        completions.append(CompletionOutput(rank if best_of else s.index, new, out_ids, lps, s.finish_reason,
                                            s.cumulative_logprob))
    return _make_output(req, completions, finished)


def failed_output(req: "Request") -> RequestOutput:
    """The last output of a request the engine failed: all n choices, finished. A sample that
    finished and reported all its tokens before keeps its finish reason; every other choice
    ends with "error", a streamed sample with the tokens it had not reported yet (best_of and
    beam search report no tokens: they report only at the end). Plain fields only, no
    logprobs: this is also what a request reports when building its normal output raised."""
    p = req.params
    streams = req.beam is None and p.num_samples == p.n
    by_index = {s.index: s for s in req.seqs} if streams else {}
    completions = []
    for i in range(p.n):
        s = by_index.get(i)
        if s is None:  # not forked yet, or its tokens are never streamed
            completions.append(CompletionOutput(i, [], [], None, "error", 0.0))
            continue
        out_ids = s.token_ids[s.num_prompt_tokens :]
        new = out_ids[s.num_emitted :]
        s.num_emitted = len(out_ids)
        # a finish is reported with the sample's last token: nothing new, and it was reported
        reason = s.finish_reason if s.finish_reason is not None and not new else "error"
        completions.append(CompletionOutput(i, new, out_ids, None, reason, s.cumulative_logprob))
    return _make_output(req, completions, True)


def _make_output(req: "Request", completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    sharing = None
    if finished:
        sh = req.sharing
        sharing = SharingStats(sh.peak_held, sh.peak_without_sharing, sh.block_steps_held,
                               sh.block_steps_without_sharing, req.num_computed_prompt_tokens)
    return RequestOutput(req.request_id, completions, req.prompt_token_ids, req.num_cached_tokens or 0, finished,
                         sharing=sharing)


def to_delta(out: RequestOutput) -> P.RequestDelta:
    """RequestOutput -> RequestDelta (logprobs split into sampled / top-k)."""
    choices = []
    for c in out.outputs:
        lps = tops = None
        if c.logprobs is not None:
            lps = [d[t] for t, d in zip(c.new_token_ids, c.logprobs)]
            tops = [dict(d) for d in c.logprobs]
        choices.append(P.ChoiceDelta(c.index, list(c.new_token_ids), lps, tops, c.finish_reason))
    return P.RequestDelta(out.request_id, choices, len(out.prompt_token_ids), out.num_cached_tokens, out.finished)
