"""Prompt tokenization and chat templating for the front, off the event loop when the text is long.

Measured on the tiny model's byte-level BPE tokenizer (tokenizers 0.23.3, transformers 5.24, a
2-core machine), 30 MB of text (14.2M tokens) encoded in a thread while the loop timed its 5 ms
sleeps:

- tokenizers' Tokenizer.encode holds the GIL throughout: the loop stops for the whole encode;
- Tokenizer.encode_batch and encode_batch_fast release it while the Rust code runs, but
  transformers' tokenizer.encode (encode_batch underneath) then builds Python lists of every id
  and mask with the GIL held: stalls of 0.4-0.7 s;
- encode_batch_fast (no offsets: twice as fast) holds it only to copy the text in (~25 ms) and
  to free the Encoding (~60 ms); the loop's wake-ups stay within 5 ms otherwise.

So a thread is enough, as long as the ids of a prompt longer than the context never become a
Python list: their count alone says the prompt is refused. Short texts are encoded inline: up to
INLINE_MAX_CHARS that takes at most ~0.2 ms, about what a hop to a thread and back costs. Very
long texts queue in a lane of their own, so one of them never holds up ordinary prompts.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

INLINE_MAX_CHARS = 1024
BULK_MIN_CHARS = 1 << 20  # ~0.2-0.5 s of tokenization and up; a 30 MB prompt takes 15-50 s


class ChatTemplateError(Exception):
    """The model's chat template refused the conversation (e.g. roles out of order)."""


@dataclass(frozen=True)
class Encoded:
    num_tokens: int
    token_ids: list[int] | None  # None when num_tokens is over the limit asked for: never listed


class AsyncTokenizer:
    """Wraps a transformers tokenizer; encode() and encode_chat() give what tokenizer.encode()
    and apply_chat_template() + encode() would, without blocking the loop on long text."""

    def __init__(self, tokenizer, *, inline_max_chars: int = INLINE_MAX_CHARS, bulk_min_chars: int = BULK_MIN_CHARS):
        self.tokenizer = tokenizer
        self._backend = _rust_backend(tokenizer)
        self._inline_max_chars, self._bulk_min_chars = inline_max_chars, bulk_min_chars
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._bulk_lane = ThreadPoolExecutor(1, thread_name_prefix="tokenize-bulk")

    async def encode(self, texts: list[str], *, max_tokens: int, add_special_tokens: bool = True) -> list[Encoded]:
        """One Encoded per text; token_ids is None for a text of more than max_tokens tokens."""
        return await self._run(sum(map(len, texts)), self._encode, texts, max_tokens, add_special_tokens)

    async def encode_chat(self, conversation: list[dict], *, add_generation_prompt: bool, max_tokens: int) -> Encoded:
        """The conversation rendered by the model's chat template, then encoded; ChatTemplateError
        if the template refuses it."""
        size = sum(len(m["content"]) for m in conversation)
        return await self._run(size, self._encode_chat, conversation, add_generation_prompt, max_tokens)

    async def _run(self, num_chars: int, fn, *args):
        if num_chars <= self._inline_max_chars:
            return fn(*args)
        lane = self._bulk_lane if num_chars >= self._bulk_min_chars else self._lane
        return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)

    def _encode(self, texts: list[str], max_tokens: int, add_special_tokens: bool) -> list[Encoded]:
        if self._backend is None:
            ids = [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
            return [Encoded(len(i), i if len(i) <= max_tokens else None) for i in ids]
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [Encoded(len(e), e.ids if len(e) <= max_tokens else None) for e in encodings]

    def _encode_chat(self, conversation: list[dict], add_generation_prompt: bool, max_tokens: int) -> Encoded:
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as e:  # the template's own checks (raise_exception) and its runtime errors
            raise ChatTemplateError(str(e)) from e
        # The template writes the special tokens itself.
        return self._encode([text], max_tokens, add_special_tokens=False)[0]


def _rust_backend(tokenizer):
    """The tokenizers.Tokenizer under a transformers tokenizer, or None where calling it directly
    would not give what tokenizer.encode() gives."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None  # a Python tokenizer; or transformers flips the backend's flag on each call
    return backend
