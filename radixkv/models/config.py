"""ModelConfig: the few fields of an HF config.json (or a GGUF's metadata, gguf.py) that the
Llama-family decoder needs.

transformers' AutoConfig parses the file (it knows each architecture's defaults and normalises
old `rope_theta`/`rope_scaling` into `rope_parameters`); we copy what we use into a plain
dataclass so that the model code does not depend on transformers' config classes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# architecture name in config.json -> family; the family picks the decoder's variant flags
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_type: str = "default"
    rope_parameters: dict = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # None = full attention. With a window W, contexts of at most W tokens attend exactly like
    # full attention, so the engine caps the context at W instead of implementing the window.
    sliding_window: int | None = None
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_size


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_window(hf) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    return int(window)


def from_hf_config(hf, generation_eos=None) -> ModelConfig:
    """Build a ModelConfig from a transformers PretrainedConfig (checks what we support)."""
    archs = getattr(hf, "architectures", None) or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        raise ValueError(f"model architectures {archs!r} not supported; supported: {sorted(ARCHITECTURES)}")
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} not supported (only 'silu')")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 not supported")
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
    attention_bias = bool(getattr(hf, "attention_bias", False))
    eos = generation_eos if generation_eos is not None else getattr(hf, "eos_token_id", None)
    return ModelConfig(
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_parameters=rope,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o bias; the others follow attention_bias
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=_sliding_window(hf),
        dtype=str(dtype).removeprefix("torch."),
        eos_token_ids=_as_id_tuple(eos),
        bos_token_id=getattr(hf, "bos_token_id", None),
    )


def load_model_config(model_dir: str) -> ModelConfig:
    """The config of an HF folder (config.json, and generation_config.json's eos_token_id, which
    wins) or of a GGUF file's metadata (a .gguf, or a folder holding one: see source.py)."""
    from radixkv.models.source import resolve_model

    src = resolve_model(model_dir)
    if src.is_gguf:
        from radixkv.models.gguf import load_gguf_config

        return load_gguf_config(src.path)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    gen_eos = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
    return from_hf_config(hf, gen_eos)
