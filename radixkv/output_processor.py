"""Token ids in, text out, per output choice: incremental detokenization and stop strings.

One OutputProcessor per choice (sample or beam) turns the engine's new token ids into the text
to show now, and decides when a stop string ends the choice. The HTTP front
(tokenizer_server/generation.py) and the offline LLM (radixkv/engine/llm.py) use the same one,
so `SamplingParams(stop=[...])` means the same text offline and over HTTP. Pure Python: the
front imports it without torch.

Decoding token by token breaks characters: a byte-level BPE splits one emoji or CJK
character over several tokens, and a lone piece decodes to U+FFFD. The detokenizer
decodes a short sliding window (a few tokens already shown, plus the new ones) and
emits new text only once the window no longer ends in U+FFFD; the window also keeps
the left context a SentencePiece-style decoder needs to place leading spaces. The
concatenated deltas equal decoding all output tokens at once.

NOTE: what is held back and when a choice ends is decided here, nowhere else. Text that could
be the start of a stop string is held until the next tokens settle it, so no part of a stop
string is ever shown (unless include_stop_str_in_output). With stop strings, a delta of several
tokens (best_of and beam search report all of a choice's tokens at the end) is fed one token at
a time, so the choice ends at the token that completes the stop string and min_tokens counts
exactly; `num_tokens` is then the number of tokens the text covers. Tokens that come after a
choice has ended are ignored; the caller aborts the engine request once all its choices ended.
"""

from __future__ import annotations

import random
import weakref

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
_SELF_CHECK_SEQUENCES = 64  # random sequences a tokenizer's piece table is checked against


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return (type(decoder).__name__ == "ByteLevel" and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and hasattr(tokenizer, "batch_decode"))


def _build_pieces(tokenizer, skip_special_tokens: bool) -> dict[int, str] | None:
    """{token id: its text} for the tokens whose text can be appended as is: a byte-level BPE
    decodes the bytes of all tokens together, so a token whose bytes are whole UTF-8 characters
    (no U+FFFD when decoded alone) adds exactly its own text after text that ends on a character
    boundary. Added and special tokens are left out. None for any other tokenizer, or one whose
    table fails a check against decode() on random sequences."""
    if not _is_byte_level(tokenizer):
        return None
    try:
        vocab = len(tokenizer)
        texts = tokenizer.batch_decode([[t] for t in range(vocab)], skip_special_tokens=skip_special_tokens)
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(tokenizer.all_special_ids)
        pieces = {t: s for t, s in enumerate(texts) if s and REPLACEMENT_CHAR not in s and t not in added}
        rng = random.Random(0)
        ids = sorted(pieces)
        for _ in range(_SELF_CHECK_SEQUENCES if ids else 0):
            seq = [rng.choice(ids) for _ in range(rng.randint(1, 12))]
            if tokenizer.decode(seq, skip_special_tokens=skip_special_tokens) != "".join(pieces[t] for t in seq):
                return None
    except Exception:  # an unusual tokenizer: the general path only
        return None
    return pieces


_PIECES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PIECES_BY_ID: dict = {}  # tokenizers that take no weak reference: id -> (tokenizer, tables)


def token_pieces(tokenizer, skip_special_tokens: bool = True) -> dict[int, str] | None:
    """The tokenizer's piece table (_build_pieces), built once per tokenizer and setting."""
    try:
        tables = _PIECES.setdefault(tokenizer, {})
    except TypeError:
        tables = _PIECES_BY_ID.setdefault(id(tokenizer), (tokenizer, {}))[1]
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = _build_pieces(tokenizer, skip_special_tokens)
    return tables[skip_special_tokens]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids=(), *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a character would make every window end in U+FFFD.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._tokens = context
        self._prefix_offset = 0  # window start
        self._read_offset = len(context)  # tokens before this are already shown
        self._num_context = len(context)
        self._pieces = token_pieces(tokenizer, skip_special_tokens)

    def _decode(self, ids) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids) -> str:
        """Add new output tokens; return the text they complete (may be "")."""
        pieces = self._pieces
        if pieces is not None and self._read_offset == len(self._tokens):
            # Nothing held back and every new token whole characters: its text is its piece (what
            # the window below would give, without decoding).
            texts = [pieces.get(t) for t in token_ids]
            if texts and None not in texts:
                self._prefix_offset = self._read_offset
                self._tokens.extend(token_ids)
                self._read_offset = len(self._tokens)
                return "".join(texts)
        self._tokens.extend(token_ids)
        shown = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window = self._decode(self._tokens[self._prefix_offset :])
        if len(window) > len(shown) and not window.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return window[len(shown) :]
        return ""

    def flush(self) -> str:
        """At the end of output: whatever is still held back, broken character or not."""
        shown = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window = self._decode(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return window[len(shown) :]


class StopStringMatcher:
    """Finds the first stop string in streamed text, across delta boundaries.

    Text that might be the start of a stop string is held back until the next delta
    settles it, so a stop string never reaches the client, not even a part of one
    (include_stop_str: the stop string found ends the text, the rest is dropped).
    """

    def __init__(self, stop: list[str], *, include_stop_str: bool = False):
        for s in stop:
            assert isinstance(s, str) and s, "stop strings are non-empty str"
        self._stop = list(stop)
        self._include = include_stop_str
        self._pending = ""
        # the characters a held-back suffix can end with: text ending in none of them holds nothing
        self._prefix_ends = {c for s in stop for c in s[:-1]}

    @property
    def active(self) -> bool:
        return bool(self._stop)

    def feed(self, delta: str, *, match: bool = True) -> tuple[str, bool]:
        """Returns (text safe to show, stopped). match=False (before min_tokens) shows all."""
        text = self._pending + delta
        self._pending = ""
        if not self._stop:
            return text, False
        if not match:
            return text, False
        found = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if found:
            cut, s = min(found, key=lambda f: f[0])  # the earliest; at a tie, the first listed
            return text[: cut + len(s) if self._include else cut], True
        hold = self._longest_stop_prefix_suffix(text)
        if hold:
            self._pending = text[-hold:]
            text = text[:-hold]
        return text, False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._prefix_ends:
            return 0
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


class OutputProcessor:
    """One choice's text. `params`: a SamplingParams or its wire form (the same fields: stop,
    include_stop_str_in_output, skip_special_tokens, min_tokens)."""

    def __init__(self, tokenizer, prompt_token_ids, params):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self.stopper = StopStringMatcher(params.stop, include_stop_str=params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.num_tokens = 0  # output tokens the text covers (up to the one completing a stop string)
        self.text = ""  # everything emitted so far
        self.finish_reason: str | None = None  # set once the choice has ended (here or in the engine)
        self.stopped_by_string = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, new_token_ids, finish_reason: str | None = None) -> str | None:
        """The engine's next tokens of this choice and its finish_reason (None while running).
        Returns the text to show now (may be ""), or None if the choice had already ended."""
        if self.finish_reason is not None:
            return None
        if finish_reason is None and not self.stopper.active:  # the common step: no stop strings to watch
            self.num_tokens += len(new_token_ids)
            text = self.detok.push(new_token_ids)
            self.text += text
            return text
        ids = list(new_token_ids)
        chunks = [[t] for t in ids] if self.stopper.active and len(ids) > 1 else [ids]
        out = []
        for k, chunk in enumerate(chunks):
            self.num_tokens += len(chunk)
            text = self.detok.push(chunk)
            if finish_reason is not None and k == len(chunks) - 1:
                text += self.detok.flush()
            text, stopped = self.stopper.feed(text, match=self.num_tokens >= self.min_tokens)
            out.append(text)
            if stopped:
                self.finish_reason, self.stopped_by_string = "stop", True
                break
        else:
            if finish_reason is not None:
                out.append(self.stopper.flush())
                self.finish_reason = finish_reason
        text = "".join(out)
        self.text += text
        return text
