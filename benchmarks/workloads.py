"""Seeded, reproducible shared-prompt workloads (token ids, no tokenizer needed).

Every generator takes a `seed` and returns a `Workload`: the same arguments give the
same requests on any machine (random.Random, no global state). Token ids are drawn
from [FIRST_ID, vocab) so that special ids (0-2 in the tiny models) never appear.

Length distributions (documented in the README, "Workloads"):
- shared_chats: one system prompt of `system_len` (2,400) tokens; each chat's question is
  uniform in [question_len/2, 3*question_len/2]; answers uniform in [0.8, 1.2] x
  `answer_len` (900, or 60 for the short-reply variant).
- generated_shared_prefix: `groups` x `per_group` prompts; each group has its own
  `system_len` (2,048) prefix, each prompt a fresh `question_len` (128) question; fixed
  `output_len` (256).
- parallel_sampling / beam_search: prompts and outputs drawn from a ShareGPT-like
  log-normal (prompt median ~160, output median ~330 tokens; clipped to [4, 1024]),
  or an Alpaca-like one (prompt median ~20, output median ~60) with `short=True`.
- multi_turn: `turns` turns per conversation; each prompt is the whole history
  (previous prompts and answers) plus a new user message of ~`message_len` tokens.
- unique: prompts with no shared prefix at all (control), same lengths as shared_chats.
"""

import math
import random
from dataclasses import dataclass, field

FIRST_ID = 3


@dataclass
class Request:
    prompt: list[int]
    output: list[int]  # the tokens this request will generate (fixed in advance: EOS ignored)
    n: int = 1  # parallel samples sharing the prompt
    beam_width: int = 0  # > 0: beam search with this many beams
    salt: str | None = None

    @property
    def max_tokens(self) -> int:
        return len(self.output)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    params: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) * max(r.n, r.beam_width, 1) for r in self.requests)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def _around(rng: random.Random, mean: int, spread: float) -> int:
    return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def shared_chats(num_chats=256, system_len=2400, question_len=200, answer_len=900, vocab=2048, seed=0,
                 name="shared_chats") -> Workload:
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab)
    reqs = [
        Request(system + _tokens(rng, _around(rng, question_len, 0.5), vocab),
                _tokens(rng, _around(rng, answer_len, 0.2), vocab))
        for _ in range(num_chats)
    ]
    return Workload(name, reqs, dict(num_chats=num_chats, system_len=system_len, question_len=question_len,
                                     answer_len=answer_len, seed=seed))


def generated_shared_prefix(groups=64, per_group=16, system_len=2048, question_len=128, output_len=256,
                            vocab=2048, seed=0) -> Workload:
    rng = random.Random(seed)
    reqs = []
    for _ in range(groups):
        system = _tokens(rng, system_len, vocab)
        reqs += [Request(system + _tokens(rng, question_len, vocab), _tokens(rng, output_len, vocab))
                 for _ in range(per_group)]
    return Workload("generated_shared_prefix", reqs, dict(groups=groups, per_group=per_group, system_len=system_len,
                                                          question_len=question_len, output_len=output_len, seed=seed))


def _sampled_lengths(rng, short: bool) -> tuple[int, int]:
    if short:  # Alpaca-like: short instructions, short answers
        return _lognormal(rng, 20, 0.6, 4, 256), _lognormal(rng, 60, 0.8, 4, 512)
    return _lognormal(rng, 160, 1.0, 4, 1024), _lognormal(rng, 330, 0.8, 4, 1024)  # ShareGPT-like


def _sampled_requests(num_requests, short, vocab, seed, **fields) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        p, o = _sampled_lengths(rng, short)
        reqs.append(Request(_tokens(rng, p, vocab), _tokens(rng, o, vocab), **fields))
    return reqs


def parallel_sampling(n=4, num_requests=128, short=False, vocab=2048, seed=0) -> Workload:
    return Workload(f"parallel_sampling_n{n}", _sampled_requests(num_requests, short, vocab, seed, n=n),
                    dict(n=n, num_requests=num_requests, short=short, seed=seed))


def beam_search(width=4, num_requests=128, short=False, vocab=2048, seed=0) -> Workload:
    return Workload(f"beam_search_w{width}", _sampled_requests(num_requests, short, vocab, seed, beam_width=width),
                    dict(width=width, num_requests=num_requests, short=short, seed=seed))


def multi_turn(num_conversations=32, turns=6, system_len=512, message_len=64, answer_len=200, vocab=2048,
               seed=0) -> Workload:
    """Requests in turn order: every conversation's turn t comes before any turn t+1."""
    rng = random.Random(seed)
    histories = [_tokens(rng, system_len, vocab) for _ in range(num_conversations)]
    reqs = []
    for _ in range(turns):
        for c in range(num_conversations):
            prompt = histories[c] + _tokens(rng, _around(rng, message_len, 0.5), vocab)
            answer = _tokens(rng, _around(rng, answer_len, 0.3), vocab)
            reqs.append(Request(prompt, answer))
            histories[c] = prompt + answer
    return Workload("multi_turn", reqs, dict(num_conversations=num_conversations, turns=turns, system_len=system_len,
                                             message_len=message_len, answer_len=answer_len, seed=seed))


def unique(num_requests=256, prompt_len=2600, answer_len=900, vocab=2048, seed=0) -> Workload:
    rng = random.Random(seed)
    reqs = [Request(_tokens(rng, _around(rng, prompt_len, 0.05), vocab), _tokens(rng, _around(rng, answer_len, 0.2), vocab))
            for _ in range(num_requests)]
    return Workload("unique", reqs, dict(num_requests=num_requests, prompt_len=prompt_len, answer_len=answer_len,
                                         seed=seed))


def all_workloads(scale: float = 1.0, vocab: int = 2048, seed: int = 0) -> list[Workload]:
    """Every workload of the memory report; `scale` < 1 shrinks counts and lengths for tests."""

    def s(x):
        return max(1, int(x * scale))

    w = [
        shared_chats(s(256), s(2400), s(200), s(900), vocab, seed),
        shared_chats(s(256), s(2400), s(200), s(60), vocab, seed, name="shared_chats_short"),
        generated_shared_prefix(s(64), 16, s(2048), s(128), s(256), vocab, seed),
    ]
    w += [parallel_sampling(n, s(128), vocab=vocab, seed=seed) for n in (2, 4, 6)]
    w += [beam_search(k, s(128), vocab=vocab, seed=seed) for k in (2, 4, 6)]
    w += [multi_turn(s(32), max(2, s(6)), s(512), s(64), s(200), vocab, seed), unique(s(256), s(2600), s(900), vocab, seed)]
    return w
