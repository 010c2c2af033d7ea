"""Weights: HF safetensors folders (sharded or not) or GGUF files (gguf.py) into the decoder,
or seeded random ones.

HF names map onto ours except for the merged projections (q/k/v -> qkv_proj, gate/up ->
gate_up_proj), which each Linear describes with its `shards`.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixkv.models.layers import Linear

_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model_dir {model_dir!r} has no *.safetensors weights")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"model_dir {model_dir!r}: weight files listed in the index are missing: {missing}")
    return files


def iter_safetensors(model_dir: str, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _resolve(model: nn.Module, name: str) -> tuple[nn.Parameter, tuple[int, int] | None]:
    """Our parameter for an HF tensor name, plus the row range inside it for merged shards."""
    params = dict(model.named_parameters())
    if name in params:
        return params[name], None
    module_path, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.q_proj / weight
    parent_path, _, sub = module_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    for child_name, child in parent.named_children():
        if isinstance(child, Linear) and sub in child.shards:
            return getattr(child, leaf), child.shards[sub]
    raise KeyError(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every named tensor into the model; every parameter must be filled exactly once."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    filled: dict[str, int] = {}
    ids = {id(p): n for n, p in model.named_parameters()}
    rows_needed = {n: p.shape[0] for n, p in model.named_parameters()}
    for name, tensor in weights:
        if name.endswith(_SKIP_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        try:
            param, shard = _resolve(model, name)
        except (KeyError, AttributeError):
            raise ValueError(f"weights: unexpected tensor {name!r} for this architecture") from None
        target = param.data if shard is None else param.data.narrow(0, shard[0], shard[1])
        if target.shape != tensor.shape:
            raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        pname = ids[id(param)]
        filled[pname] = filled.get(pname, 0) + (param.shape[0] if shard is None else shard[1])
    missing = [n for n, rows in rows_needed.items() if filled.get(n, 0) != rows]
    if missing:
        raise ValueError(f"weights: missing or partial tensors for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights for timing real shapes without a checkpoint (norm weights = 1)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)


def load_model(
    model_dir: str | None,
    cfg,
    *,
    device: str,
    dtype: torch.dtype,
    backend: str,
    load_format: str = "safetensors",
    max_positions: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """Build the decoder for `cfg` on `device` in `dtype` and fill its weights.

    NOTE: load_format picks real weights or seeded random ones, not the file format: the
    default ("safetensors") reads whatever checkpoint model_dir names, an HF folder's
    safetensors or a GGUF's tensors, so the engine and its options do not change for GGUF."""
    from radixkv.models.llama import LlamaForCausalLM
    from radixkv.models.source import resolve_model

    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} not in ('safetensors', 'dummy')")
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, backend, max_positions)
    finally:
        torch.set_default_dtype(old_dtype)
    # RoPE tables are built in explicit float32 whatever the default dtype
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif (src := resolve_model(model_dir)).is_gguf:
        from radixkv.models.gguf import iter_gguf_weights

        load_weights(model, iter_gguf_weights(src.path, cfg))
    else:
        load_weights(model, iter_safetensors(model_dir, device))
    return model.eval().requires_grad_(False)
