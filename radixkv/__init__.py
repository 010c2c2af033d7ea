"""radixkv: a prefix-caching LLM serving runtime.

`radixkv.cache` is pure Python and importable without torch; the engine names
below are imported lazily so that embedding the cache manager stays torch-free.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "radixkv.engine.llm",
    "SamplingParams": "radixkv.engine.sampling_params",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
