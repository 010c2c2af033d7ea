"""Batched sampling over the logits rows of the sequences that produce a token this step.

Order (vLLM's): min_tokens masking, penalties, the grammar mask of structured outputs (its
rows only; engine/structured.py), then greedy argmax or temperature, min-p,
top-k / top-p and a draw. The draw is an exponential race (argmax of p / E with E ~ Exp(1)),
which samples from p; each seeded sequence fills its own E from its own generator, so its
tokens do not depend on what else is in the batch. Logprobs are of the raw model
distribution (before penalties and temperature).

Every field value that passes SamplingParams.validate is safe here: top_k and logprobs are
clamped to the vocabulary in Python before any tensor is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixkv.engine.sequence import Sequence
from radixkv.engine.structured import apply_bitmask, fill_bitmask


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token (for cumulative_logprob and best_of)
    top_logprobs: list[dict[int, float] | None]  # rows that asked: sampled token + its top k


@dataclass
class DrawnTokens:
    """What the sampler drew, still on the device; `tokens` can feed the next step's inputs
    there. start_copy() queues the copy to the host behind the draw; output() waits for that
    copy only (not for work queued after it) and builds the SamplerOutput, whose fields are
    also readable here (token_ids, logprobs, top_logprobs)."""

    tokens: torch.Tensor  # [rows] int64
    chosen: torch.Tensor  # [rows] float32: raw logprob of each drawn token
    top_vals: torch.Tensor | None  # [rows, k_max] for the rows that asked for logprobs
    top_ids: torch.Tensor | None
    want_lp: list[int | None]
    _host: tuple | None = None
    _copied: object = None  # a CUDA event after the copy, None on the CPU
    _out: SamplerOutput | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.output().token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.output().logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float] | None]:
        return self.output().top_logprobs

    def start_copy(self) -> None:
        if self.tokens.device.type != "cuda":
            self._host = (self.tokens, self.chosen, self.top_vals, self.top_ids)
            return
        host = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        self._host = (host(self.tokens), host(self.chosen), host(self.top_vals), host(self.top_ids))
        self._copied = torch.cuda.Event()
        self._copied.record()

    def output(self) -> SamplerOutput:
        if self._out is None:
            self._out = self._to_host()
        return self._out

    def _to_host(self) -> SamplerOutput:
        if self._host is None:
            self.start_copy()
        if self._copied is not None:
            self._copied.synchronize()
        tokens, chosen, top_vals, top_ids = self._host
        token_list, chosen_list = tokens.tolist(), chosen.tolist()
        if all(k is None for k in self.want_lp):
            return SamplerOutput(token_list, chosen_list, [None] * len(token_list))
        vals, ids = (None, None) if top_vals is None else (top_vals.tolist(), top_ids.tolist())
        tops: list[dict[int, float] | None] = []
        for i, k in enumerate(self.want_lp):
            if k is None:
                tops.append(None)
                continue
            d = {token_list[i]: chosen_list[i]}
            if k:
                for tid, val in zip(ids[i][:k], vals[i][:k]):
                    d.setdefault(tid, val)
            tops.append(d)
        return SamplerOutput(token_list, chosen_list, tops)


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    arr = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return torch.from_numpy(arr).to(device)


def apply_penalties(logits, prompts, outputs, rep, freq, pres):
    """In place. rep: multiplicative on tokens seen anywhere; freq/pres: additive on the output."""
    rows, vocab = logits.shape
    out_ids = _padded(outputs, vocab, logits.device)
    counts = torch.zeros(rows, vocab + 1, device=logits.device, dtype=logits.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    if bool((rep != 1.0).any()):
        seen = torch.zeros(rows, vocab + 1, device=logits.device, dtype=torch.bool)
        seen.scatter_(1, _padded(prompts, vocab, logits.device), True)
        seen = seen[:, :vocab] | (counts > 0)
        r = rep.unsqueeze(1)
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    logits -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) all but the k best tokens and the smallest set with probability >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = rank >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # keep a token if the mass strictly before it is below p (the best token always stays)
    drop |= (probs.cumsum(-1) - probs) >= p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class DrawLog:
    """States of the seeded generators before their draws since the last checkpoint().

    NOTE: a step whose compute fails is computed again without the request at fault
    (engine.py). A seeded sequence must then draw what it would have drawn, so each seeded
    generator's state is noted before its draw (a host copy, ~1 us, seeded rows only) and
    rewind() puts it back. Unseeded rows draw from the shared generator, whose stream depends
    on the batch anyway."""

    def __init__(self):
        self._states: list[tuple[torch.Generator, torch.Tensor]] = []

    def note(self, generator: torch.Generator) -> None:
        self._states.append((generator, generator.get_state()))

    def checkpoint(self) -> None:
        """A new attempt at a step begins: forget the states noted so far."""
        self._states.clear()

    def rewind(self) -> None:
        """Put the generators back as they were at the last checkpoint()."""
        for generator, state in reversed(self._states):
            generator.set_state(state)
        self._states.clear()


class Sampler:
    def __init__(self, device, eos_token_ids: tuple[int, ...], seed: int = 0):
        self.device = torch.device(device)
        self.eos = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # unseeded requests
        self.draws = DrawLog()

    def _seq_generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        return seq.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> DrawnTokens:
        return self.draw(logits, seqs)

    @staticmethod
    def needs_token_values(seq: Sequence) -> bool:
        """Whether drawing for `seq` reads the values of its output tokens (penalties do; a
        step of the overlapped loop knows the count of the last step's tokens, not their ids)."""
        p = seq.params
        return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)

    def draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> DrawnTokens:
        """The tokens of the rows of `logits`, drawn on the device (nothing copied to the host)."""
        assert logits.shape[0] == len(seqs)
        raw = logits.float()
        params = [s.params for s in seqs]
        want_lp = [p.logprobs for p in params]
        # NOTE: logprobs are of the raw distribution, raw - logsumexp(raw): only the drawn token's
        # and the asked top k are ever read, so the [rows, vocab] log_softmax is not materialised,
        # and the logits are copied only for the rows' masks and penalties (most steps have none).
        lse = torch.logsumexp(raw, -1)
        scores = raw
        rows, cols = self._min_tokens_mask(seqs)
        penalised = any(map(self.needs_token_values, seqs))
        grammar = fill_bitmask(seqs, raw.shape[1])  # None when no row is constrained
        if rows or penalised or grammar:
            scores = raw.clone()
        if rows:
            scores[torch.tensor(rows, device=raw.device), torch.tensor(cols, device=raw.device)] = float("-inf")
        if penalised:
            t = lambda xs: torch.tensor(xs, dtype=torch.float32, device=raw.device)  # noqa: E731
            apply_penalties(scores, [s.token_ids[: s.num_prompt_tokens] for s in seqs],
                            [s.output_token_ids for s in seqs], t([p.repetition_penalty for p in params]),
                            t([p.frequency_penalty for p in params]), t([p.presence_penalty for p in params]))
        if grammar:
            apply_bitmask(scores, *grammar)
        tokens = scores.argmax(-1)
        if not all(p.greedy for p in params):
            tokens = torch.where(self._greedy_mask(params), tokens, self._draw(scores, seqs, params))
        return self._drawn(tokens, raw, lse, want_lp)

    def _greedy_mask(self, params) -> torch.Tensor:
        return torch.tensor([p.greedy for p in params], device=self.device)

    def _min_tokens_mask(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(rows, token ids) to mask: the stop tokens of rows short of their min_tokens."""
        rows, cols = [], []
        for i, s in enumerate(seqs):
            if s.params.min_tokens and s.num_output_tokens < s.params.min_tokens:
                stops = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else self.eos)
                rows += [i] * len(stops)
                cols += stops
        return rows, cols

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], params) -> torch.Tensor:
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=logits.device)  # noqa: E731
        temp = f32([p.temperature if p.temperature > 0 else 1.0 for p in params])
        logits = logits / temp.unsqueeze(1)
        vocab = logits.shape[1]
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]  # any int: clamp first
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, torch.tensor(top_k, device=logits.device), f32(top_p))
        probs = logits.softmax(-1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            floor = f32(min_p).unsqueeze(1) * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.params.seed is not None and not s.params.greedy:
                generator = self._seq_generator(s)
                self.draws.note(generator)
                noise[i].exponential_(generator=generator)
        # a zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick
        return (probs / noise.clamp_min_(1e-30)).argmax(-1)

    def _drawn(self, tokens: torch.Tensor, raw: torch.Tensor, lse: torch.Tensor, want_lp) -> DrawnTokens:
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        asked = [k for k in want_lp if k]
        top_vals = top_ids = None
        if asked:
            top_vals, top_ids = raw.topk(min(max(asked), raw.shape[1]), dim=-1)
            top_vals = top_vals - lse.unsqueeze(1)
        return DrawnTokens(tokens, chosen, top_vals, top_ids, want_lp)
