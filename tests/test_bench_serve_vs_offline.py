"""`radixkv bench serve-vs-offline --tiny`: the offline engine and a real `radixkv serve` on the
same tiny dummy-weight model and prompts; its helpers (the generated model folder, the engine
options passed to both sides)."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serve_vs_offline as svo

REPO = Path(__file__).resolve().parent.parent


def _args(*argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    svo.add_arguments(ap)
    args = ap.parse_args(list(argv))
    svo.resolve(args)
    return args


def test_defaults_gpu_and_tiny():
    gpu, tiny = _args(), _args("--tiny")
    assert svo.engine_args(gpu) == {"device": "cuda", "dtype": "bfloat16", "load_format": "dummy"}
    assert (gpu.num_requests, gpu.scale) == (1024, 1.0)
    assert svo.engine_args(tiny) == {"device": "cpu", "dtype": "float32", "load_format": "dummy"}
    assert tiny.num_requests == svo.TINY_NUM_REQUESTS and tiny.scale == svo.TINY_SCALE
    # a given model loads its own weights unless told otherwise
    assert "load_format" not in svo.engine_args(_args("--model", "/some/dir"))


def test_engine_options_reach_the_server_as_its_flags():
    from radixkv.cli import serve

    args = _args("--tiny", "--block-size", "32", "--max-num-seqs", "64", "--num-blocks", "300", "--seed", "5",
                 "--enforce-eager", "--no-prefix-caching")
    engine = svo.engine_args(args)
    assert engine == {"device": "cpu", "dtype": "float32", "block_size": 32, "num_blocks": 300, "max_num_seqs": 64,
                      "seed": 5, "load_format": "dummy", "enforce_eager": True, "enable_prefix_caching": False}
    ap = argparse.ArgumentParser()
    serve.add_arguments(ap)
    parsed = ap.parse_args(["MODEL", *svo.serve_flags(engine)])
    assert serve.engine_args_from(parsed) == {"model_dir": "MODEL", **engine}
    assert svo.same_engine_args({"model_dir": "MODEL", "torch_threads": None, **engine}, engine)
    assert not svo.same_engine_args({"model_dir": "MODEL", **engine, "max_num_seqs": 8}, engine)


def test_model_folder_tokenizer_covers_every_id(tmp_path):
    from radixkv.models.config import load_model_config
    from radixkv.models.source import load_tokenizer
    from radixkv.output_processor import token_pieces

    path = svo.write_model_folder(tmp_path / "m", tiny=True)
    cfg = load_model_config(str(path))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (2048, 64, 2)
    tok = load_tokenizer(str(path))
    assert len(tok) == cfg.vocab_size and tok.eos_token_id in cfg.eos_token_ids
    assert tok.decode([3, 17, 2047]) == " t3 t17 t2047"
    pieces = token_pieces(tok)  # the front's per-token fast path, as for a real byte-level BPE
    assert pieces is not None and len(pieces) == cfg.vocab_size - 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_llama3_8b_shape_is_the_default():
    from benchmarks.throughput import LLAMA3_8B

    assert svo.model_config(tiny=False) == LLAMA3_8B


def test_tiny_run(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "radixkv.cli", "bench", "serve-vs-offline", "--tiny", "--no-progress",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(rf"^results in {re.escape(str(out))}/serve_vs_offline\.\*$", r.stdout, re.M)
    result = json.loads((out / "serve_vs_offline.json").read_text())
    offline, served = result["offline"], result["served"]
    expected = svo.TINY_NUM_REQUESTS * int(256 * svo.TINY_SCALE)
    assert offline["output_tokens"] == served["output_tokens"] == offline["expected_output_tokens"] == expected
    assert result["same_output_tokens"] and result["same_prompts"]
    assert served["failed"] == 0 and served["server_exit_code"] == 0
    assert result["meta"]["same_engine_args"] is True
    assert result["ratio_http_over_offline"] == pytest.approx(served["output_tok_per_s"] / offline["output_tok_per_s"])
    assert result["ratio_http_over_offline"] > 0
    # the workload shares prefixes: both sides hit the cache, and the same share of the prompts
    assert offline["hit_rate"] > 0.5 and served["server_hit_rate"] == pytest.approx(offline["hit_rate"])
    assert "HTTP / offline" in (out / "serve_vs_offline.md").read_text()
