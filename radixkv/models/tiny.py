"""Build tiny random-weight HF model folders for tests, demos and benchmarks.

A folder holds what a real checkpoint holds: config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json and chat_template.jinja.
The tokenizer is a byte-level BPE (2,048 tokens) trained once and shipped in
radixkv/assets, so the folder does not depend on the machine it is built on.
Weights come from a seeded generator in a fixed order: the same arguments give
byte-identical files.
"""

import json
import math
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
ARCHS = ("llama", "qwen3")
EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VOCAB_SIZE = 2048

# ChatML: the turn ends with <|im_end|>, which is also an EOS id in generation_config.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _config(arch: str, hidden: int, layers: int, heads: int, kv_heads: int, max_len: int) -> dict:
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": [0, 2],
        "dtype": "float32",
    }
    if arch == "llama":
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    return {
        **common,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }


def _weights(cfg: dict, seed: int) -> dict:
    """Seeded weights in a fixed order. Scales keep logits well spread (std ~2), so
    greedy decoding has clear winners and fp32 comparisons are not decided by ties."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def linear(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    # A tied embedding is also the output head: scale it like one.
    embed_std = 2.0 / math.sqrt(h) if cfg["tie_word_embeddings"] else 1.0
    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=g) * embed_std}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(nq * d, h)
        w[p + "self_attn.k_proj.weight"] = linear(nkv * d, h)
        w[p + "self_attn.v_proj.weight"] = linear(nkv * d, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, nq * d)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(v, h, gain=2.0)
    return {k: t.contiguous() for k, t in w.items()}


def build_tiny_model(
    out_dir,
    arch: str = "llama",
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a tiny HF model folder to `out_dir` and return its path."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(arch, hidden_size, num_layers, num_heads, num_kv_heads, max_position_embeddings)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": [0, 2], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    save_file(_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(ASSETS / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    return out
