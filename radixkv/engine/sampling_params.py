"""SamplingParams: how one request samples and when it stops (vLLM's vocabulary).

Seeds: with `seed=s`, sample i of the request draws from its own generator seeded `s + i`,
so n samples with seed s equal n single-sample requests with seeds s, s+1, ... . Without a
seed, samples draw from the engine's generator.

Beam search (`use_beam_search=True`) keeps `beam_width` beams (default: best_of, else n) and
returns the n best finished hypotheses, ranked as HF transformers' generate(num_beams=W,
do_sample=False) ranks them: cumulative logprob / generated_len ** length_penalty, with its
`early_stopping` rules (True, False or "never"). It is deterministic: it ranks the model's raw
log-probabilities, so temperature and seed do not apply, and the fields that would reshape the
distribution (top_p, top_k, min_p, penalties) must stay at their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixkv.engine.errors import ParamError

MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    """A real number that converts to a float (an int past float's range does not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


@dataclass
class SamplingParams:
    n: int = 1  # samples returned
    best_of: int | None = None  # samples drawn (>= n); the n with the best cumulative logprob are returned
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1, 0 or >= the vocabulary = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if present in the output
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob plus the top k
    use_beam_search: bool = False
    beam_width: int | None = None  # beams kept per step (beam search only); None: best_of, else n
    length_penalty: float = 1.0  # finished beams rank by cumulative_logprob / generated_len ** this
    early_stopping: bool | str = False  # True: stop at beam_width finished beams; False: HF heuristic; "never"

    @property
    def num_samples(self) -> int:
        """Sequences the request runs at once: samples drawn, or beams kept."""
        if self.use_beam_search:
            return self.num_beams
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_beams(self) -> int:
        """Beam width (beam search only)."""
        if self.beam_width is not None:
            return self.beam_width
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise ParamError (a ValueError) naming the first bad field; returns self."""
        if not _is_int(self.n) or self.n < 1:
            raise ParamError("n", f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ParamError("best_of", f"best_of must be None or an int >= n ({self.n}), got {self.best_of!r}")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1, 0 (off) or a positive int, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63 - 2**20):
            raise ParamError("seed", f"seed must be None or a non-negative int below 2**63 - 2**20, got {self.seed!r}")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            raise ParamError("repetition_penalty",
                             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise ParamError(name, f"{name} must be in [-2, 2], got {v!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ParamError("max_tokens", f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens",
                             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ParamError("stop_token_ids",
                             f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ParamError("logprobs",
                             f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.use_beam_search, bool):
            raise ParamError("use_beam_search", f"use_beam_search must be a bool, got {self.use_beam_search!r}")
        if self.use_beam_search:
            self._validate_beam_search()
        else:
            for name, default in (("beam_width", None), ("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != default:
                    raise ParamError(name, f"{name} applies to beam search only (set use_beam_search=True), "
                                     f"got {getattr(self, name)!r}")
        return self

    def _validate_beam_search(self) -> None:
        if self.beam_width is not None and (not _is_int(self.beam_width) or self.beam_width < 2):
            raise ParamError("beam_width", f"beam_width must be None or an int >= 2, got {self.beam_width!r}")
        if self.beam_width is not None and self.best_of is not None and self.best_of != self.beam_width:
            raise ParamError("best_of",
                             f"best_of ({self.best_of}) must equal beam_width ({self.beam_width}) with beam search")
        if self.num_beams < 2:  # as in HF, one beam is greedy search
            raise ParamError("use_beam_search", "use_beam_search needs at least 2 beams (beam_width, or best_of / n); "
                             "for one, use greedy sampling (temperature=0)")
        if self.n > self.num_beams:
            raise ParamError("n", f"n ({self.n}) must not exceed the beam width ({self.num_beams})")
        if not _is_num(self.length_penalty) or not abs(self.length_penalty) < float("inf"):
            raise ParamError("length_penalty", f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ParamError("early_stopping",
                             f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        # beam search ranks raw log-probabilities: what would reshape them is not applied, so refuse it
        for name, default in (("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                              ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
            if getattr(self, name) != default:
                raise ParamError(name, f"{name} must be {default} with use_beam_search, got {getattr(self, name)!r}")
        if self.top_k not in (-1, 0):
            raise ParamError("top_k", f"top_k must be -1 (off) with use_beam_search, got {self.top_k!r}")
