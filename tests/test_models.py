"""The decoder against HF transformers on the same folders (fp32, CPU, torch reference attention)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from radixkv.models.attention import AttentionMetadata
from radixkv.models.config import load_model_config
from radixkv.models.loader import load_model, load_weights
from radixkv.models.rope import rope_inv_freq

BLOCK = 4


def _engine_model(path, **kw):
    cfg = load_model_config(str(path))
    model = load_model(str(path), cfg, device="cpu", dtype=torch.float32, backend="torch", **kw)
    return cfg, model


def _bind_cache(cfg, model, num_blocks):
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = kv[i, 0], kv[i, 1]


def _step(model, seqs, tables):
    """seqs: list of (token ids of this chunk, start position); tables: block ids per sequence.
    Returns logits of every new token, flattened."""
    ids, pos, slots, cu, lens = [], [], [], [0], []
    for (toks, start), table in zip(seqs, tables):
        for j, t in enumerate(toks):
            p = start + j
            ids.append(t)
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        cu.append(cu[-1] + len(toks))
        lens.append(start + len(toks))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots), bt, torch.tensor(cu, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), max(len(s[0]) for s in seqs))
    return model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta))


def _hf_logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _check_paged_vs_hf(path, lengths=(13, 6)):
    """Two sequences: prefill in two chunks mixed in one batch, then decodes; shuffled block
    tables; every position's logits equal HF's full forward."""
    cfg, model = _engine_model(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    perm = torch.randperm(16, generator=g).tolist()
    tables = [perm[:8], perm[8:]]
    _bind_cache(cfg, model, 16)
    a, b = prompts
    out1 = _step(model, [(a[:7], 0), (b[:4], 0)], tables)
    out2 = _step(model, [(a[7:], 7), (b[4:], 4)], tables)
    out3 = _step(model, [(a[-1:], len(a)), (b[-1:], len(b))], tables)  # decode one more (repeated) token
    ref_a = _hf_logits(path, a + a[-1:])
    ref_b = _hf_logits(path, b + b[-1:])
    mine_a = torch.cat([out1[:7], out2[: len(a) - 7], out3[:1]])
    mine_b = torch.cat([out1[7:], out2[len(a) - 7 :], out3[1:]])
    torch.testing.assert_close(mine_a, ref_a, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(mine_b, ref_b, atol=2e-5, rtol=1e-5)
    return cfg


def test_tiny_llama_matches_hf(tiny_llama_dir):
    cfg = _check_paged_vs_hf(tiny_llama_dir)
    assert cfg.family == "llama" and cfg.eos_token_ids == (0, 2) and not cfg.tie_word_embeddings


def test_tiny_qwen3_matches_hf(tiny_qwen3_dir):
    cfg = _check_paged_vs_hf(tiny_qwen3_dir)
    assert cfg.family == "qwen3" and cfg.qk_norm and cfg.tie_word_embeddings


def _save_hf(tmp_path, config, name, **save_kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    path = tmp_path / name
    model.save_pretrained(str(path), **save_kw)
    return path


SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def test_qwen2_biases_and_sharded_weights(tmp_path):
    path = _save_hf(tmp_path, Qwen2Config(**SMALL, tie_word_embeddings=False), "qwen2", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    cfg = _check_paged_vs_hf(path)
    assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.o_bias


def test_mistral_with_llama3_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = _save_hf(tmp_path, MistralConfig(**SMALL, sliding_window=None, rope_parameters=rope), "mistral")
    cfg = _check_paged_vs_hf(path, lengths=(20, 9))
    assert cfg.family == "mistral" and cfg.rope_type == "llama3" and cfg.sliding_window is None


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from radixkv.models.config import from_hf_config

    hf = LlamaConfig(head_dim=128, hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192},
                     architectures=["LlamaForCausalLM"])
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    mine = rope_inv_freq(from_hf_config(hf))
    torch.testing.assert_close(mine, ref, rtol=0, atol=0)


def test_sliding_window_caps_context(tmp_path):
    path = _save_hf(tmp_path, MistralConfig(**SMALL, sliding_window=32), "mistral-sw")
    cfg = load_model_config(str(path))
    assert cfg.sliding_window == 32 and cfg.max_model_len == 32


def _edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def test_unsupported_configs_rejected(tmp_path):
    path = _save_hf(tmp_path, LlamaConfig(**SMALL), "llama")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="architectures"):
        load_model_config(str(path))
    _edit_config(path, architectures=["LlamaForCausalLM"],
                 rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type"):
        load_model_config(str(path))
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(str(tmp_path / "nowhere"))


def test_loader_rejects_bad_weights(tiny_llama_dir):
    from radixkv.models.loader import iter_safetensors

    cfg, model = _engine_model(tiny_llama_dir)
    weights = dict(iter_safetensors(str(tiny_llama_dir)))
    missing = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="missing or partial"):
        load_weights(model, missing.items())
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_weights(model, [("model.extra.weight", torch.zeros(1))])
    bad = dict(weights)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        load_weights(model, bad.items())


def test_dummy_weights_are_seeded(tiny_llama_dir):
    _, a = _engine_model(tiny_llama_dir, load_format="dummy", seed=3)
    _, b = _engine_model(tiny_llama_dir, load_format="dummy", seed=3)
    _, c = _engine_model(tiny_llama_dir, load_format="dummy", seed=4)
    wa, wb, wc = (m.model.layers[0].mlp.down_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
