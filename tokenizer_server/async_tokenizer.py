"""Prompt tokenization and chat templating for the front, off the event loop when the text is long.

Measured on the tiny model's byte-level BPE tokenizer (tokenizers 0.23.3, transformers 5.24, a
2-core VM), 30 MB of text (14.2M tokens) encoded in a thread while the loop timed its 5 ms sleeps:

- tokenizers' Tokenizer.encode holds the GIL throughout: the loop stops for the whole encode;
- Tokenizer.encode_batch and encode_batch_fast release it while the Rust code runs, but
  transformers' tokenizer.encode (encode_batch underneath) then builds Python lists of every id
  and mask with the GIL held: stalls of 0.4-0.7 s;
- encode_batch_fast (no offsets: twice as fast) holds it only to copy the text in (~25 ms) and to
  free the 14.2M-token Encoding (~60 ms); the loop's wake-ups stay within 5 ms otherwise. Both
  grow with the text, and the encode peaks at ~140 bytes of memory per input byte (4 GB here).

So a thread is enough for ordinary prompts, as long as the ids of a prompt longer than the
context never become a Python list (their count alone says the prompt is refused). Texts up to
INLINE_MAX_CHARS are encoded inline: that takes at most ~0.2 ms, about what a hop to a thread and
back costs. From BULK_MIN_CHARS, a text is encoded by a child process of its own, fed 1 MiB at
a time from a thread of a separate lane: the front then never holds the GIL for more than one
such slice, never holds the encode's memory, and one bulk text never holds up ordinary prompts.
"""

import asyncio
import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

INLINE_MAX_CHARS = 1024
BULK_MIN_CHARS = 1 << 20  # ~0.3-0.7 s of tokenization and up; a process starts in ~0.15 s
BULK_SLICE_CHARS = 1 << 20
# The child yields the CPU to serving (the event loop, the engine worker) whenever they want it
# and takes what they leave: with a busy-looping process beside 20 streams on 2 cores, /health
# took up to 134 ms at niceness 0 and at most 48 ms at 10, and the streams kept their pace.
BULK_NICENESS = 10


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
        self._bulk_slot = asyncio.Semaphore(1)  # one bulk encode at a time: each may take GBs
        # spawn: a fresh interpreter, not a fork of this threaded one
        self._processes = multiprocessing.get_context("spawn")

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
        if num_chars < self._bulk_min_chars:
            return await asyncio.get_running_loop().run_in_executor(self._lane, fn, *args)
        async with self._bulk_slot:
            return await _in_daemon_thread(fn, *args)

    def _encode(self, texts: list[str], max_tokens: int, add_special_tokens: bool) -> list[Encoded]:
        if self._backend is None:
            ids = [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
            return [Encoded(len(i), i if len(i) <= max_tokens else None) for i in ids]
        if sum(map(len, texts)) >= self._bulk_min_chars:
            return self._encode_in_child(texts, max_tokens, add_special_tokens)
        return _encode_with(self._backend, texts, max_tokens, add_special_tokens)

    def _encode_chat(self, conversation: list[dict], add_generation_prompt: bool, max_tokens: int) -> Encoded:
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as e:  # the template's own checks (raise_exception) and its runtime errors
            raise ChatTemplateError(str(e)) from e
        # The template writes the special tokens itself.
        return self._encode([text], max_tokens, add_special_tokens=False)[0]

    def _encode_in_child(self, texts: list[str], max_tokens: int, add_special_tokens: bool) -> list[Encoded]:
        """Blocks its thread, mostly in pipe I/O without the GIL."""
        conn, child_conn = self._processes.Pipe()
        child = self._processes.Process(
            target=_child_main, args=(child_conn, self._backend.to_str(), max_tokens, add_special_tokens),
            name="tokenize-bulk", daemon=True,  # daemon: killed, not awaited, when the server exits
        )
        child.start()
        child_conn.close()
        try:
            _send_texts(conn, texts)
            return [Encoded(n, ids) for n, ids in conn.recv()]
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the tokenizer process exited with code {child.exitcode}") from e
        finally:
            conn.close()
            child.join()


async def _in_daemon_thread(fn, *args):
    """fn(*args) in a daemon thread of its own: unlike an executor's threads, an exiting server
    does not wait for it (a bulk encode can take a minute; its daemon child is killed at exit)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, error) -> None:
        if done.done():  # the request was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name="tokenize-bulk", daemon=True).start()
    return await done


def _rust_backend(tokenizer):
    """The tokenizers.Tokenizer under a transformers tokenizer, or None where calling it directly
    would not give what tokenizer.encode() gives."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None  # a Python tokenizer; or transformers flips the backend's flag on each call
    return backend


def _encode_with(backend, texts: list[str], max_tokens: int, add_special_tokens: bool) -> list[Encoded]:
    encodings = backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    return [Encoded(len(e), e.ids if len(e) <= max_tokens else None) for e in encodings]


def _send_texts(conn, texts: list[str]) -> None:
    """Each text as UTF-8 slices, then b"": the GIL is held for one slice's encode at a time."""
    conn.send(len(texts))
    for text in texts:
        for start in range(0, len(text), BULK_SLICE_CHARS):
            conn.send_bytes(text[start:start + BULK_SLICE_CHARS].encode())
        conn.send_bytes(b"")


def _recv_texts(conn) -> list[str]:
    texts = []
    for _ in range(conn.recv()):
        parts = []
        while part := conn.recv_bytes():
            parts.append(part)
        texts.append(b"".join(parts).decode())
    return texts


def _child_main(conn, tokenizer_json: str, max_tokens: int, add_special_tokens: bool) -> None:
    """A bulk encode in a process of its own: only the counts, and the ids that fit, go back."""
    from tokenizers import Tokenizer

    os.nice(BULK_NICENESS)
    backend = Tokenizer.from_str(tokenizer_json)
    encoded = _encode_with(backend, _recv_texts(conn), max_tokens, add_special_tokens)
    conn.send([(e.num_tokens, e.token_ids) for e in encoded])
    conn.close()
