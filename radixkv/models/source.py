"""What a MODEL argument names: an HF folder, a .gguf file, or a folder holding one .gguf.

The offline LLM, `radixkv generate`, `radixkv serve` (its front and its engine worker) and the
tokenizer pool all resolve MODEL here, so they agree on what it is and where its tokenizer is.
Nothing heavy is imported at the top: the front and `radixkv --help` import this module.
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelSource:
    path: str  # the HF folder, or the .gguf file
    is_gguf: bool


def resolve_model(model: str) -> ModelSource:
    """An HF folder (config.json wins over any .gguf beside it), a .gguf file, or a folder
    with no config.json and exactly one .gguf. ValueError naming MODEL otherwise."""
    model = os.fspath(model)
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf; give a .gguf file or an HF model folder")
        return ModelSource(model, True)
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} not found: give an HF model folder (config.json) or a .gguf file")
    if os.path.isfile(os.path.join(model, "config.json")):
        return ModelSource(model, False)
    found = sorted(glob.glob(os.path.join(glob.escape(model), "*.gguf")))
    if len(found) == 1:
        return ModelSource(found[0], True)
    if not found:
        raise ValueError(f"model {model!r} is not a model folder: no config.json and no .gguf file")
    names = ", ".join(os.path.basename(f) for f in found)
    raise ValueError(f"model {model!r} holds {len(found)} .gguf files ({names}): give the one to load")


@dataclass(frozen=True)
class TokenizerSource:
    """How to load a model's tokenizer: plain strings, so it can be sent to another process."""

    path: str  # the HF folder, or the .gguf file
    is_gguf: bool

    def load(self):
        from transformers import AutoTokenizer

        if not self.is_gguf:
            return AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        # NOTE: transformers builds a GGUF's tokenizer from the file's metadata (vocabulary,
        # merges, special tokens, chat template), but it reads tokenizer files lying beside
        # the .gguf first: a tokenizer.json there wins over the file's own vocabulary. A
        # private folder holding only a link to the .gguf makes the file the one source.
        with tempfile.TemporaryDirectory(prefix="radixkv-gguf-") as private:
            name = os.path.basename(self.path)
            os.symlink(os.path.abspath(self.path), os.path.join(private, name))
            try:
                return AutoTokenizer.from_pretrained(private, gguf_file=name, local_files_only=True)
            except ValueError as e:  # e.g. a file without tokenizer.ggml.* metadata
                raise ValueError(f"GGUF {self.path!r}: no tokenizer could be built from the file: {e}") from None


def tokenizer_source(model: str) -> TokenizerSource | None:
    """Where MODEL's tokenizer comes from; None for an HF folder without tokenizer files."""
    src = resolve_model(model)
    if not src.is_gguf and not any(os.path.isfile(os.path.join(src.path, f)) for f in HF_TOKENIZER_FILES):
        return None
    return TokenizerSource(src.path, src.is_gguf)


def load_tokenizer(model: str):
    """MODEL's transformers tokenizer (with its chat template), or None when it has none."""
    src = tokenizer_source(model)
    return None if src is None else src.load()
