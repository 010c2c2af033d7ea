"""`radixkv bench grammar-masks` on a tiny subset: one schema, batch 2, a few steps; the JSON has a row
for each library, the schema compiles and its valid document is accepted by both."""

import importlib.util
import json

import pytest

from radixkv.models.smollm2 import INSTALL, smollm2_gguf

LIBRARIES = ("xgrammar", "llguidance")


@pytest.mark.parametrize("lib", LIBRARIES)
def test_library_importable_or_skip(lib):
    if importlib.util.find_spec(lib) is None:
        pytest.skip(f"{lib} is not installed: pip install '.[grammar-bench]' (see pyproject.toml)")


def test_tiny_run_has_both_libraries(tmp_path):
    for lib in LIBRARIES:
        if importlib.util.find_spec(lib) is None:
            pytest.skip(f"{lib} is not installed: pip install '.[grammar-bench]' (see pyproject.toml)")
    pytest.importorskip("transformers", reason="the tokenizer is loaded from the GGUF by transformers")
    if smollm2_gguf() is None:
        pytest.skip(f"SmolLM2-135M-Instruct's GGUF is not installed ({INSTALL})")
    from benchmarks import grammar_masks

    rc = grammar_masks.main(["--cases", "flat_object", "--batches", "2", "--steps", "4", "--repeats", "1",
                             "--compile-repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "grammar_masks.json").read_text())
    assert [r["library"] for r in result["libraries"]] == list(LIBRARIES)
    for r in result["libraries"]:
        case = r["cases"]["flat_object"]
        assert case["compiles"] and case["accepted"], case
        assert r["mask_cases"] == ["flat_object"]
        assert {(m["threads"], m["batch"]) for m in r["masks"]} == {(1, 2), (2, 2)}
        assert all(m["failures"] == 0 and m["step_ms"]["median"] > 0 for m in r["masks"])
    assert (tmp_path / "grammar_masks.md").read_text().startswith("# Grammar masks: xgrammar")
