"""The embedding example runs end to end (it checks every token its toy engine reads back)."""

import runpy
from pathlib import Path


def test_embed_example_runs(capsys):
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "embed_cache.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "req1: 340 prompt tokens, 288 from the cache" in out
    assert "tenant-b: 303 prompt tokens, 0 from the cache" in out
