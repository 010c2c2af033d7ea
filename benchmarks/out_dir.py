"""Where a benchmark writes its files: `--out`, else a new temporary folder.

The default is never benchmarks/results/: that folder holds the committed results, refreshed
on purpose with `--out benchmarks/results`, so an ordinary run leaves the checkout clean.
"""

import tempfile
from pathlib import Path

OUT_HELP = "folder for the result files (default: a new temporary folder, printed at the end)"


def out_dir(out: str | None, name: str) -> Path:
    """The folder `--out` names (created if missing), or a fresh temporary one for `name`."""
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=f"radixkv-bench-{name}-"))
