"""Incremental detokenization and stop strings live in radixkv/output_processor.py, shared with
the offline LLM; the front's names for them."""

from radixkv.output_processor import (  # noqa: F401
    PROMPT_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    OutputProcessor,
    StopStringMatcher,
)
