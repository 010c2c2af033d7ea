"""GGUF files: metadata -> ModelConfig, tensors -> the decoder's (HF-named) parameters.

The `gguf` library parses the file (memory-mapped) and dequantizes whole tensors with numpy,
block-wise, into float32; load_weights then copies them into the engine's dtype.

What the GGUF writer changed, undone here:
- names: blk.N.attn_q -> model.layers.N.self_attn.q_proj, ... (GGUF_TO_HF);
- Llama-architecture files (Llama, Mistral and their fine-tunes) have the rows of attn_q and
  attn_k permuted within each head, because GGML rotates adjacent pairs of a head's dims
  where the HF layout rotates its two halves; unpermute_rotary_rows restores HF's order.
  Qwen2/Qwen3 files are written unpermuted (GGML rotates those halves-wise too);
- Llama 3's rope scaling is stored as a tensor of per-frequency divisors (rope_freqs), not
  as config: it becomes rope_parameters["freq_factors"];
- a model with tied embeddings simply has no output.weight.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from radixkv.models.config import ModelConfig

# GGUF general.architecture -> our family. Mistral's own models are written as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# architectures whose attn_q / attn_k rows the writer permuted for GGML's rotary layout
PERMUTED_QK = ("llama",)
# Tensor types dequantized here, each checked against its own error in tests/test_gguf.py.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
ROPE_FREQS = "rope_freqs.weight"

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _Reader(GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of the file's memory map.

    NOTE: the reader slices its memory map once or more per metadata value, ~1M times for a
    49k-token vocabulary; slicing numpy's memmap subclass costs ~3x a plain array's (2.2 s
    against 0.7 s for SmolLM2 here). The view shares the mapped pages, so tensors still come
    straight from the file."""

    @property
    def data(self):
        return self._mapped

    @data.setter
    def data(self, mapped):
        self._mapped = np.asarray(mapped)


def open_gguf(path: str) -> GGUFReader:
    try:
        return _Reader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from None


def _get(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for what the config consumed (rope_freqs)."""
    if gguf_name == ROPE_FREQS:
        return None
    if gguf_name in GGUF_TOP_LEVEL:
        return GGUF_TOP_LEVEL[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m.group(2) not in GGUF_TO_HF:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family decoder")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{GGUF_TO_HF[part]}.{kind}"


def _check_types(path: str, tensors) -> None:
    for t in tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF {path!r}: tensor {t.name!r} has type {t.tensor_type.name}, not supported; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")


def _model_dtype(tensors) -> str:
    """The checkpoint dtype that `dtype="auto"` starts from on a GPU: that of the 2-D weights
    when they are unquantized; bfloat16 for quantized ones (the range of float32, and values
    whose few significant bits bfloat16 keeps nearly exactly)."""
    kinds = Counter(t.tensor_type.name for t in tensors if len(t.shape) == 2)
    main = kinds.most_common(1)[0][0] if kinds else "F32"
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(main, "bfloat16")


def _rope(reader, arch: str, tensors: dict, path: str) -> tuple[str, dict]:
    theta = float(_get(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = _get(reader, f"{arch}.rope.scaling.type", "none")
    params = {"rope_theta": theta}
    if ROPE_FREQS in tensors:
        if scaling != "none":
            raise ValueError(f"GGUF {path!r}: rope scaling {scaling!r} with rope_freqs not supported")
        factors = _dequantize(tensors[ROPE_FREQS])
        return "llama3", {**params, "rope_type": "llama3", "freq_factors": [float(f) for f in factors]}
    if scaling == "none":
        return "default", {**params, "rope_type": "default"}
    if scaling == "linear":
        factor = float(_get(reader, f"{arch}.rope.scaling.factor", 1.0))
        return "linear", {**params, "rope_type": "linear", "factor": factor}
    raise ValueError(f"GGUF {path!r}: rope scaling {scaling!r} not supported; supported: none, linear, "
                     "Llama 3's rope_freqs")


def _one_value(value, key: str, path: str) -> int:
    """Per-layer lists (some GGUFs give head counts per layer) must hold one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {path!r}: {key} differs between layers ({sorted(set(value))}), not supported")
        value = value[0]
    return int(value)


def config_from_gguf(reader, path: str) -> ModelConfig:
    arch = _get(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF {path!r}: architecture {arch!r} not supported; supported: "
                         f"{', '.join(ARCHITECTURES)} (Mistral models are written as llama)")
    if int(_get(reader, "split.count", 1)) > 1:
        raise ValueError(f"GGUF {path!r} is one part of a split model: merge the parts into one file first")
    if int(_get(reader, f"{arch}.expert_count", 0) or 0) > 0:
        raise ValueError(f"GGUF {path!r}: a mixture-of-experts {arch} model, not supported")
    _check_types(path, reader.tensors)
    tensors = {t.name: t for t in reader.tensors}

    def need(key):
        value = _get(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF {path!r}: metadata {arch}.{key} missing")
        return value

    hidden = int(need("embedding_length"))
    heads = _one_value(need("attention.head_count"), "head_count", path)
    kv_heads = _one_value(_get(reader, f"{arch}.attention.head_count_kv", heads), "head_count_kv", path)
    head_dim = int(_get(reader, f"{arch}.attention.key_length", hidden // heads))
    if int(_get(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {path!r}: value_length != key_length, not supported")
    if int(_get(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"GGUF {path!r}: rotary over part of the head dim (rope.dimension_count), not supported")
    rope_type, rope = _rope(reader, arch, tensors, path)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"GGUF {path!r}: no token_embd.weight")
    vocab = int(_get(reader, f"{arch}.vocab_size", int(embed.shape[1])))
    window = _get(reader, f"{arch}.attention.sliding_window")
    eos = [_get(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    layer0 = "blk.0."
    return ModelConfig(
        family=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_one_value(need("feed_forward_length"), "feed_forward_length", path),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        rope_theta=rope["rope_theta"],
        rope_type=rope_type,
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors,
        # biases and q/k norms: whatever the file carries (Qwen2: q/k/v biases; Qwen3: norms)
        qkv_bias=layer0 + "attn_q.bias" in tensors,
        o_bias=layer0 + "attn_output.bias" in tensors,
        mlp_bias=layer0 + "ffn_up.bias" in tensors,
        qk_norm=layer0 + "attn_q_norm.weight" in tensors,
        sliding_window=int(window) if window else None,
        dtype=_model_dtype(reader.tensors),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),  # eot: chat turns end there
        bos_token_id=_get(reader, "tokenizer.ggml.bos_token_id"),
    )


def load_gguf_config(path: str) -> ModelConfig:
    return config_from_gguf(open_gguf(path), path)


def _dequantize(tensor) -> np.ndarray:
    """float32 [rows, cols] (numpy's order: GGUF lists the dims innermost first)."""
    out = dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a read-only view of the mapped file; torch wants memory it may write
    return out if out.flags.writeable else out.copy()


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GGML's interleaved rotary rows back to HF's halves, per head: GGUF row 2i + j of a head
    is HF row j * head_dim / 2 + i (j = 0, 1). Works on weights [rows, cols] and biases [rows]."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of the file, in the HF layout; one tensor's
    float32 copy is alive at a time."""
    reader = open_gguf(path)
    _check_types(path, reader.tensors)
    permuted = cfg.family in PERMUTED_QK
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = torch.from_numpy(_dequantize(t))
        if permuted and ".q_proj." in name:
            w = unpermute_rotary_rows(w, cfg.num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rotary_rows(w, cfg.num_kv_heads)
        yield name, w
