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

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


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

    def _decode(self, ids) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids) -> str:
        """Add new output tokens; return the text they complete (may be "")."""
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
