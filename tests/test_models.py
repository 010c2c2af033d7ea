"""The decoder against HF transformers on the same folders (fp32, CPU, torch reference attention),
and with the Triton backend (its attention and fused element-wise kernels: Triton's interpreter
without CUDA)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from radixkv.models.attention import AttentionMetadata
from radixkv.models.config import load_model_config
from radixkv.models.loader import load_model, load_weights
from radixkv.models.rope import rope_inv_freq

BLOCK = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # of the Triton backend's tests


def _engine_model(path, backend="torch", device="cpu", **kw):
    cfg = load_model_config(str(path))
    model = load_model(str(path), cfg, device=device, dtype=torch.float32, backend=backend, **kw)
    return cfg, model


def _bind_cache(cfg, model, num_blocks, device="cpu"):
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, device=device)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = kv[i, 0], kv[i, 1]


def _step(model, seqs, tables, device="cpu"):
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
    ten = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    bt = ten([row + [0] * (width - len(row)) for row in tables], torch.int32)
    meta = AttentionMetadata(ten(slots), bt, ten(cu, torch.int32), ten(lens, torch.int32),
                             max(len(s[0]) for s in seqs))
    return model.compute_logits(model(ten(ids), ten(pos), meta)).cpu()


def _hf_logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _check_paged_vs_hf(path, lengths=(13, 6), backend="torch", device="cpu", atol=2e-5):
    """Two sequences: prefill in two chunks mixed in one batch, then decodes; shuffled block
    tables; every position's logits equal HF's full forward."""
    cfg, model = _engine_model(path, backend, device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    perm = torch.randperm(16, generator=g).tolist()
    tables = [perm[:8], perm[8:]]
    _bind_cache(cfg, model, 16, device)
    a, b = prompts
    out1 = _step(model, [(a[:7], 0), (b[:4], 0)], tables, device)
    out2 = _step(model, [(a[7:], 7), (b[4:], 4)], tables, device)
    out3 = _step(model, [(a[-1:], len(a)), (b[-1:], len(b))], tables, device)  # decode one more (repeated) token
    ref_a = _hf_logits(path, a + a[-1:])
    ref_b = _hf_logits(path, b + b[-1:])
    mine_a = torch.cat([out1[:7], out2[: len(a) - 7], out3[:1]])
    mine_b = torch.cat([out1[7:], out2[len(a) - 7 :], out3[1:]])
    torch.testing.assert_close(mine_a, ref_a, atol=atol, rtol=1e-5)
    torch.testing.assert_close(mine_b, ref_b, atol=atol, rtol=1e-5)
    return cfg


def test_tiny_llama_matches_hf(tiny_llama_dir):
    cfg = _check_paged_vs_hf(tiny_llama_dir)
    assert cfg.family == "llama" and cfg.eos_token_ids == (0, 2) and not cfg.tie_word_embeddings


def test_tiny_qwen3_matches_hf(tiny_qwen3_dir):
    cfg = _check_paged_vs_hf(tiny_qwen3_dir)
    assert cfg.family == "qwen3" and cfg.qk_norm and cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_with_fused_ops_matches_hf(tiny_llama_dir, tiny_qwen3_dir, arch):
    """Triton attention plus the fused add+RMSNorm / RoPE / silu*mul kernels (Qwen3's q/k norms
    keep RoPE unfused), in fp32: HF's logits up to summation order."""
    path = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    _, model = _engine_model(path, "triton", DEVICE)
    assert model.model.layers[0].self_attn.fused_rope == (arch == "llama")
    assert model.model.layers[0].mlp._silu_mul is not None
    _check_paged_vs_hf(path, backend="triton", device=DEVICE, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_their_references(dtype):
    from kernels import fused

    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    # fp32: equal up to summation order; bf16: one rounding of the result apart at most, in
    # the interpreter two (its fp32 -> bf16 casts truncate)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=2 ** -6)
    x, res, w = rnd(5, 96), rnd(5, 96), 1 + 0.1 * rnd(96)
    for r in (res, None):
        out, h = fused.add_rms_norm(x, r, w, 1e-6)
        want, want_h = fused.add_rms_norm_ref(x, r, w, 1e-6)
        torch.testing.assert_close(out, want, **tol)
        torch.testing.assert_close(h, want_h, **tol)
    assert fused.add_rms_norm(x, None, w, 1e-6)[1] is x
    gate_up = rnd(3, 80)
    torch.testing.assert_close(fused.silu_mul(gate_up, 40), fused.silu_mul_ref(gate_up, 40), **tol)
    t, heads, kv_heads, d = 4, 4, 2, 12  # head_dim / 2 = 6: not a power of two
    qkv = rnd(t, (heads + 2 * kv_heads) * d)
    pos = torch.tensor([0, 5, 3, 9], device=DEVICE)
    freqs = torch.outer(torch.arange(16.0), 1 / 10000 ** (torch.arange(0, d, 2) / d)).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    c, s = cos[pos].unsqueeze(1).to(dtype), sin[pos].unsqueeze(1).to(dtype)
    want_q = fused.rope_ref(qkv[:, : heads * d].view(t, heads, d), c, s)
    want_k = fused.rope_ref(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d), c, s)
    v = qkv[:, (heads + kv_heads) * d :].clone()
    assert fused.rope_qk_(qkv, pos, cos, sin, heads, kv_heads, d) is qkv  # in place
    torch.testing.assert_close(qkv[:, : heads * d].view(t, heads, d), want_q, **tol)
    torch.testing.assert_close(qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d), want_k, **tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v)  # v untouched


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
