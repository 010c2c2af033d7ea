"""What the engine reports per step: incremental outputs of requests that had news.

Per step, a streamed choice costs what it emits, not what it generated: new_token_ids is a
slice of its new tokens only, and token_ids (all generated so far) is a list once the choice
is finished (its finish_reason set) and, before, an OutputTokens: a read-only window onto the
sequence's own token list (length, indexing, slicing, iteration, == with a list), made in
constant time. Streaming readers use new_token_ids; the offline LLM reads token_ids on
finished outputs.

A beam search request reports once, when it finishes: its n best hypotheses, best first.
A request the engine failed reports once more, finished: finish_reason "error" on every
choice it had not finished (failed_output). A finished output carries the request's block
sharing accounting (SharingStats); to_delta is the one conversion of an output to the wire.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixkv import protocol as P

if TYPE_CHECKING:
    from radixkv.engine.sequence import Request


class OutputTokens(SequenceABC):
    """Tokens [start, stop) of a list that only grows past `stop` (a sequence's token_ids: what
    later steps append, a pending token included, lies at `stop` or after), read in place:
    O(1) to make. Slices are lists; == compares with any sequence of ints."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int):
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._tokens[self._start : self._stop][i]
        n = self._stop - self._start
        if not -n <= i < n:
            raise IndexError("output token index out of range")
        return self._tokens[self._start + (i if i >= 0 else n + i)]

    def __iter__(self):
        return iter(self._tokens[self._start : self._stop])

    def tolist(self) -> list[int]:
        return self._tokens[self._start : self._stop]

    def __eq__(self, other) -> bool:
        if isinstance(other, OutputTokens):
            other = other.tolist()
        elif not isinstance(other, (list, tuple)):
            return NotImplemented
        return self.tolist() == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __reduce__(self):
        return list, (self.tolist(),)


@dataclass(slots=True)
class CompletionOutput:
    index: int  # sample number (beam search: rank, 0 = best)
    new_token_ids: list[int]  # since the last output of this request
    token_ids: list[int] | OutputTokens  # all generated so far: a list once finished, a read-only window before
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


@dataclass(slots=True)
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
    want_lp, start = p.logprobs is not None, len(req.prompt_token_ids)
    completions = [_choice(s, rank if best_of else s.index, start, want_lp) for rank, s in enumerate(seqs)]
    return _make_output(req, completions, finished)


def _choice(s, index: int, start: int, want_lp: bool) -> CompletionOutput:
    """A sample's output since its last report: the new tokens only, so the per-step cost does
    not grow with the output; all of them as a window until it finishes."""
    toks, emitted, reason = s.token_ids, s.num_emitted, s.finish_reason
    s.num_emitted = len(toks) - start
    return CompletionOutput(index, toks[start + emitted :],
                            OutputTokens(toks, start, len(toks)) if reason is None else toks[start:],
                            s.logprobs[emitted:] if want_lp else None, reason, s.cumulative_logprob)


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
