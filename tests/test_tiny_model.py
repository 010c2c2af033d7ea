import hashlib
import subprocess
import sys

import pytest

from radixkv.models.tiny import build_tiny_model


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_arguments_give_identical_bytes(tmp_path, arch):
    # Built through the CLI, in fresh processes, as a user would.
    for name in ("a", "b"):
        subprocess.run(
            [sys.executable, "-m", "radixkv.cli", "make-tiny-model", str(tmp_path / name), "--arch", arch, "--seed", "3"],
            check=True,
            capture_output=True,
        )
    a, b = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert set(a) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert a == b


def test_different_seed_gives_different_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_folder_loads_in_transformers(request, fixture):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.vocab_size == len(tok) == 2048
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("héllo wörld, the cache", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "héllo wörld, the cache"
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tmp_path, seed=-1)
