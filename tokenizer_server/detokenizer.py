"""Incremental detokenization and stop strings, per output choice.

Decoding token by token breaks characters: a byte-level BPE splits one emoji or CJK
character over several tokens, and a lone piece decodes to U+FFFD. The detokenizer
decodes a short sliding window (a few tokens already shown, plus the new ones) and
emits new text only once the window no longer ends in U+FFFD; the window also keeps
the left context a SentencePiece-style decoder needs to place leading spaces. The
concatenated deltas equal decoding all output tokens at once.
"""

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
    settles it, so a stop string never reaches the client, not even a part of one.
    """

    def __init__(self, stop: list[str]):
        for s in stop:
            assert isinstance(s, str) and s, "stop strings are non-empty str"
        self._stop = list(stop)
        self._pending = ""

    def feed(self, delta: str, *, match: bool = True) -> tuple[str, bool]:
        """Returns (text safe to show, stopped). match=False (before min_tokens) shows all."""
        text = self._pending + delta
        self._pending = ""
        if not self._stop:
            return text, False
        if not match:
            return text, False
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
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
