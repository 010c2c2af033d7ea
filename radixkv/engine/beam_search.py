"""Beam search on shared blocks: the selection rule, the driver that carries it out on a
request's sequence group, and the finished hypotheses.

The engine runs every live beam as an ordinary decode row of the continuous batch (the group
is gang scheduled and pinned: sequence.py); once all beams of a request have their logits,
`BeamSearch.advance` picks the continuations (`step`) and applies them through the group's
operations, with ref counts only: a beam continued once keeps its sequence, each further
continuation forks it (all blocks shared, the partial last one copied on write when written),
and a beam with no continuation is dropped. No history is ever copied.

The ranking is HF transformers' (generate(num_beams=W, do_sample=False)), step for step:
- Candidates: the K best (beam, token) pairs over all live beams by running score + the token's
  log-prob (fp32, as HF), K = W * max(2, 1 + number of finish tokens). A beam has at most one
  candidate per finish token, so at least W candidates go on.
- Each of the first W candidates that ends in a finish token, or reaches the length limit, is
  offered as a finished hypothesis scored cumulative_logprob / generated_len ** length_penalty
  (the length counts the generated tokens, the finish token included); the W best are kept.
- The first W candidates that do not finish are the next beams, best first.
- The search stops at the length limit; with early_stopping=True once W hypotheses are kept;
  otherwise once W are kept and the best running beam, scored at the current length (at the
  length limit with early_stopping="never" and length_penalty > 0), cannot beat the worst kept.

Every score divides by length_power(), HF's generated_len ** length_penalty, saturated for
extreme penalties so that any finite one neither overflows nor divides by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# NOTE: HF computes len ** length_penalty as a Python float, which overflows (OverflowError)
# for a large penalty and reaches 0.0 (a division by zero) for a very negative one. Past
# |length_penalty * ln(len)| = 40 the power is held at e**+-40: scores c / len ** lp of fp32
# cumulative logprobs c then stay finite and non-zero (for 1e-20 < |c| < 1e21), and among the
# lengths past that point hypotheses rank by c. A penalty under 40 / ln(len) (10 at 54 tokens,
# 2 up to 4.8e8) is computed exactly as HF does.
MAX_LOG_LENGTH_POWER = 40.0


def length_power(length: int, length_penalty: float) -> float:
    """The divisor of a hypothesis' score: length ** length_penalty, saturated (see the NOTE)."""
    if length > 1 and abs(length_penalty) * math.log(length) > MAX_LOG_LENGTH_POWER:
        return math.exp(math.copysign(MAX_LOG_LENGTH_POWER, length_penalty))
    return length**length_penalty


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the finish token included
    cumulative_logprob: float
    score: float  # cumulative_logprob / length_power(len(token_ids), length_penalty)
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None = None


@dataclass
class BeamStep:
    keep: list[tuple[int, int, dict | None]]  # next beams, best first: (parent beam, token, logprobs entry)
    done: bool  # the search is over; `keep` is empty


class GroupOps(Protocol):
    """What a driver may do to a request's sequence group (the engine implements it)."""

    def fork(self, parent, index: int):
        """A new running member sharing every block and the history of `parent`."""

    def drop(self, seq) -> None:
        """A member with no continuation: its blocks go back, the group goes on."""

    def finish(self, seq, reason: str) -> None:
        """A member is done; the request reports when all are."""


def worst_case_blocks(prompt_len: int, max_new_tokens: int, num_beams: int, block_size: int) -> int:
    """Most blocks a beam request holds at once: the prompt's full blocks (shared by every beam),
    each beam's own blocks up to the longest output, and one per beam for a pending copy."""
    shared = prompt_len // block_size
    own = -(-(prompt_len + max_new_tokens) // block_size) - shared
    return shared + num_beams * (own + 1)


class BeamSearch:
    """State of one request's search. Beams are the request's live sequences, best first."""

    def __init__(self, *, num_beams: int, length_penalty: float, early_stopping: bool | str, max_new_tokens: int,
                 finish_token_ids, min_tokens: int = 0, logprobs: int | None = None):
        assert num_beams >= 1 and max_new_tokens >= 1
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.finish = frozenset(finish_token_ids)
        self.num_candidates = num_beams * max(2, 1 + len(self.finish))
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.scores = torch.zeros(1)  # running cumulative logprob of each live beam, fp32 like HF's
        self.num_generated = 0
        self.finished: list[Hypothesis] = []  # best first, at most num_beams

    def step(self, logprobs: torch.Tensor, parents: list) -> BeamStep:
        """logprobs: [live beams, vocab] raw log-softmax, rows in beam order; parents: the live
        beams (with .output_token_ids and .logprobs). Returns the continuations."""
        W, vocab = self.num_beams, logprobs.shape[1]
        assert logprobs.shape[0] == len(parents) == self.scores.shape[0]
        if self.scores.device != logprobs.device:
            self.scores = self.scores.to(logprobs.device)
        ranked = logprobs
        if self.num_generated < self.min_tokens and self.finish:
            ranked = logprobs.clone()
            ranked[:, sorted(self.finish)] = float("-inf")
        acc = (ranked + self.scores.unsqueeze(1)).reshape(-1)
        top_vals, top_idx = torch.topk(acc, min(self.num_candidates, acc.numel()))
        gen = self.num_generated + 1
        at_limit = gen >= self.max_new_tokens
        tops = self._top_logprobs(logprobs)
        normalised = None
        keep, keep_pos = [], []
        for j, flat in enumerate(top_idx.tolist()):
            beam, token = divmod(flat, vocab)
            if at_limit or token in self.finish:
                if j < W:  # only the first W may finish, as in HF
                    if normalised is None:  # the same fp32 ops as HF, for the same roundings
                        normalised = (top_vals / length_power(gen, self.length_penalty)).tolist()
                    self._offer(parents[beam], token, float(top_vals[j]), normalised[j],
                                "stop" if token in self.finish else "length", self._entry(logprobs, tops, beam, token))
            elif len(keep) < W:
                keep.append((beam, token, self._entry(logprobs, tops, beam, token)))
                keep_pos.append(j)
        self.num_generated = gen
        if at_limit or not keep:
            return BeamStep([], True)
        self.scores = top_vals[keep_pos]
        return BeamStep(keep, self._done())

    def advance(self, req, logprobs: torch.Tensor, ops: GroupOps) -> bool:
        """One step of the search on `req`'s live beams (req.seqs, best first), whose
        log-probs are the rows of `logprobs`: the chosen continuations are forked, the
        others dropped, and req.seqs becomes the next beams, each with its token appended.
        True when the search is over (every beam finished "stop")."""
        beams = req.seqs
        step = self.step(logprobs, beams)
        if step.done:
            for s in beams:
                ops.finish(s, "stop")
            return True
        # forks first (children share the parent's blocks), then the beams not continued go
        continued, children = set(), []
        for parent_idx, token, entry in step.keep:
            parent = beams[parent_idx]
            if parent_idx in continued:
                child = ops.fork(parent, len(children))
            else:
                continued.add(parent_idx)
                child = parent
            children.append((child, token, entry))
        for i, s in enumerate(beams):
            if i not in continued:
                ops.drop(s)
        req.seqs = [c for c, _, _ in children]
        for rank, ((child, token, entry), score) in enumerate(zip(children, self.scores.tolist())):
            child.index = rank
            child.token_ids.append(token)
            child.cumulative_logprob = score
            if entry is not None:
                child.logprobs.append(entry)
        return False

    def _done(self) -> bool:
        if len(self.finished) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens  # a positive penalty favours the longest beams
        else:
            best_len = self.num_generated
        best_possible = float((self.scores[:1] / length_power(best_len, self.length_penalty))[0])
        return not best_possible > self.finished[-1].score

    def _offer(self, parent, token: int, cumulative: float, score: float, reason: str, entry) -> None:
        if len(self.finished) == self.num_beams and not score > self.finished[-1].score:
            return
        lps = None if entry is None else parent.logprobs + [entry]
        hyp = Hypothesis(parent.output_token_ids + [token], cumulative, score, reason, lps)
        at = next((i for i, h in enumerate(self.finished) if score > h.score), len(self.finished))
        self.finished.insert(at, hyp)
        del self.finished[self.num_beams :]

    def _top_logprobs(self, logprobs: torch.Tensor):
        if not self.logprobs:
            return None
        vals, ids = logprobs.topk(self.logprobs, dim=-1)
        return vals.tolist(), ids.tolist()

    def _entry(self, logprobs: torch.Tensor, tops, beam: int, token: int) -> dict[int, float] | None:
        """The chosen token's raw logprob plus the top k of its beam's row (like the sampler's)."""
        if self.logprobs is None:
            return None
        entry = {token: float(logprobs[beam, token])}
        if tops is not None:
            for tid, val in zip(tops[1][beam], tops[0][beam]):
                entry.setdefault(tid, val)
        return entry

    def results(self, n: int, live: list | None = None) -> list[Hypothesis]:
        """The n best hypotheses; with `live` (an aborted search), running beams compete too."""
        hyps = list(self.finished)
        if live:
            lp = self.length_penalty
            for seq, cum in zip(live, self.scores.tolist()):
                out = seq.output_token_ids
                hyps.append(Hypothesis(list(out), cum, cum / length_power(max(1, len(out)), lp), "abort",
                                       list(seq.logprobs) if self.logprobs is not None else None))
            for h in hyps:
                h.finish_reason = "abort"
            hyps.sort(key=lambda h: -h.score)
        return hyps[:n]
