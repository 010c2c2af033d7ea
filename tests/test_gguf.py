"""GGUF loading on tiny random models written here with the gguf library's GGUFWriter, laid out
the way llama.cpp's converter lays them out (names, Q/K row permutation of llama files, Llama 3
rope factors as a tensor, no output.weight when tied): every supported tensor type comes back
within its own error (F32 exactly), the permutation is undone, greedy output equals HF's on the
source folder, and what is not supported is refused by name."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from radixkv.engine.llm import LLM  # noqa: E402
from radixkv.engine.sampling_params import SamplingParams  # noqa: E402
from radixkv.models.config import load_model_config  # noqa: E402
from radixkv.models.loader import load_model  # noqa: E402
from radixkv.models.source import load_tokenizer, resolve_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYER_NAMES = {  # HF module -> GGUF tensor, per layer
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def to_ggml_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """What the llama converter does to q/k rows: each head's two halves (HF's rotary layout)
    interleaved into adjacent pairs (GGML's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- K-quant encoders: the tests' own, from the block layouts the GGUF format defines ----------

def _f16(x):
    return x.astype(np.float16)


def _encode_q6_k(x):
    """256-value blocks: 16 groups of 16 with an int8 scale each, 6-bit signed values."""
    n = x.shape[0]
    g = x.reshape(n, 16, 16)
    group_scale = np.abs(g).max(-1) / 31
    d = _f16(group_scale.max(-1) / 127).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.ceil(group_scale / np.where(d > 0, d, 1)[:, None]), 0).clip(-128, 127)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    q = np.where(step > 0, np.round(g / np.where(step > 0, step, 1)), 0).clip(-32, 31)
    qu = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (qu[:, :, :64] & 0xF) | ((qu[:, :, 64:] & 0xF) << 4)
    hi = ((qu >> 4) & 3).reshape(n, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    packed = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                             _f16(d).reshape(n, 1).view(np.uint8)], axis=1)
    return packed, (step * q).reshape(n, 256)


def _pack_k_scales(sc, m):
    """Eight 6-bit scales and mins in 12 bytes: the low 6 bits of the first four of each in
    bytes 0-7, the last four's low nibbles in bytes 8-11, their top 2 bits atop bytes 0-7."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    first = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    second = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([first, second, third], axis=1)


def _encode_k_affine(x, levels):
    """Q4_K / Q5_K values: 8 groups of 32, value = d * sc * q - dmin * m, q in [0, levels]."""
    n = x.shape[0]
    g = x.reshape(n, 8, 32)
    offset_needed = -np.minimum(g.min(-1), 0)
    dmin = _f16(offset_needed.max(-1) / 63).astype(np.float32)
    m = np.where(dmin[:, None] > 0, np.ceil(offset_needed / np.where(dmin > 0, dmin, 1)[:, None]), 0).clip(0, 63)
    offset = dmin[:, None] * m.astype(np.float32)
    scale_needed = (g.max(-1) + offset) / levels
    d = _f16(scale_needed.max(-1) / 63).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.ceil(scale_needed / np.where(d > 0, d, 1)[:, None]), 0).clip(0, 63)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    q = np.where(step > 0, np.round((g + offset[..., None]) / np.where(step > 0, step, 1)), 0).clip(0, levels)
    q = q.astype(np.uint8)
    lo = (q & 0xF).reshape(n, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    head = [_f16(d).reshape(n, 1).view(np.uint8), _f16(dmin).reshape(n, 1).view(np.uint8), _pack_k_scales(sc, m)]
    if levels == 31:
        bits = ((q >> 4) & 1).astype(np.uint8)  # [n, 8 groups, 32]: bit g of byte j is group g's value j
        head.append(sum(bits[:, k] << k for k in range(8)).astype(np.uint8))
    decoded = step * q.astype(np.float32) - offset[..., None]
    return np.concatenate(head + [qs], axis=1), decoded.reshape(n, 256)


K_ENCODERS = {"Q4_K": lambda x: _encode_k_affine(x, 15), "Q5_K": lambda x: _encode_k_affine(x, 31),
              "Q6_K": _encode_q6_k}
# largest error allowed, as a share of the largest magnitude in the value's block
# (half a quantization step, or a whole one where the type's rounding can clip)
BLOCK_ERROR = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31,
               "Q4_K": 1 / 10, "Q5_K": 1 / 20, "Q6_K": 1 / 40}


def encode(w: np.ndarray, qtype: str):
    """(what GGUFWriter stores, the values it decodes to) for a float32 [rows, cols] array."""
    if qtype in K_ENCODERS:
        packed, decoded = K_ENCODERS[qtype](w.reshape(-1, 256))
        return packed.reshape(w.shape[0], -1), decoded.reshape(w.shape)
    data = quantize(w, QT[qtype])
    return data, dequantize(data, QT[qtype])


# ---- writing a GGUF from an HF folder -----------------------------------------------------------

def write_gguf(path, model_dir, qtype="F32", *, arch=None, permute=True, tokenizer=True, rope_factors=None,
               skip=(), extra_tensors=()):
    """`model_dir`'s weights as a GGUF of `qtype` (2-D weights; norms stay F32). Returns, per HF
    name, the values the file decodes to (the originals for F32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        _add_tokenizer(w, model_dir)
    decoded = {}
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if name in skip:
            continue
        a = t.float().numpy()
        if permute and name.endswith("q_proj.weight"):
            a = to_ggml_rotary(a, heads)
        elif permute and name.endswith("k_proj.weight"):
            a = to_ggml_rotary(a, kv_heads)
        if a.ndim == 2 and qtype != "F32":
            data, back = encode(a, qtype)
            w.add_tensor(gguf_name(name), data, raw_dtype=QT[qtype])
        else:
            back = a
            w.add_tensor(gguf_name(name), a)
        decoded[name] = back
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    for name, data, raw in extra_tensors:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def _add_tokenizer(w, model_dir):
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template((model_dir / "chat_template.jinja").read_text().strip())


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """Rows of 256 and 768 values: what the 256-value blocks of the K-quants need."""
    from radixkv.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide-llama"), "llama", seed=1, hidden_size=256, num_heads=4,
                            num_kv_heads=2)


def _params(path):
    cfg = load_model_config(str(path))
    model = load_model(str(path), cfg, device="cpu", dtype=torch.float32, backend="torch")
    return cfg, dict(model.named_parameters())


def _hf_greedy(model_dir, prompts, max_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: max_tokens each
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in prompts]


PROMPTS = [[5, 17, 300, 41], [1000, 3, 77, 9, 512, 64, 2000, 11, 8], [42] * 6]


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_f32_gguf_loads_the_folders_weights_exactly_and_generates_like_hf(fixture, request, tmp_path):
    """llama files have their q/k rows permuted (undone on load); qwen3 files do not (none undone)."""
    model_dir = request.getfixturevalue(fixture)
    path = tmp_path / "model.gguf"
    write_gguf(path, model_dir, permute=fixture == "tiny_llama_dir")
    cfg, params = _params(path)
    ref_cfg, ref = _params(model_dir)
    assert params.keys() == ref.keys()
    for name in ref:
        assert torch.equal(params[name], ref[name]), name
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "qk_norm",
                  "qkv_bias", "max_position_embeddings"):
        assert getattr(cfg, field) == pytest.approx(getattr(ref_cfg, field)), field
    assert cfg.eos_token_ids == (2,) and cfg.dtype == "float32"
    llm = LLM(str(path), device="cpu", block_size=4, num_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    want = _hf_greedy(model_dir, PROMPTS, 8)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_llama_qk_permutation_is_undone(tiny_llama_dir, tmp_path):
    """The permutation the converter applies is not the identity, and the loader inverts it:
    loading the same file as an unpermuted architecture leaves the rows interleaved."""
    from radixkv.models.gguf import iter_gguf_weights, unpermute_rotary_rows

    path = tmp_path / "model.gguf"
    write_gguf(path, tiny_llama_dir)
    cfg = load_model_config(str(path))
    hf = load_file(str(tiny_llama_dir / "model.safetensors"))
    q_hf = hf["model.layers.0.self_attn.q_proj.weight"]
    k_hf = hf["model.layers.0.self_attn.k_proj.weight"]
    loaded = dict(iter_gguf_weights(str(path), cfg))
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], q_hf)
    assert torch.equal(loaded["model.layers.0.self_attn.k_proj.weight"], k_hf)
    as_stored = dict(iter_gguf_weights(str(path), cfg.__class__(**{**cfg.__dict__, "family": "qwen3"})))
    q_raw = as_stored["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q_raw, q_hf)
    assert torch.equal(q_raw, torch.from_numpy(to_ggml_rotary(q_hf.numpy(), cfg.num_heads)))
    assert torch.equal(unpermute_rotary_rows(q_raw, cfg.num_heads), q_hf)
    bias = torch.arange(16.0)  # biases follow their rows: 2 heads of 8
    assert unpermute_rotary_rows(torch.from_numpy(to_ggml_rotary(bias.numpy(), 2)), 2).tolist() == bias.tolist()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_weights_come_back_within_the_types_error(qtype, wide_llama_dir, tmp_path):
    path = tmp_path / f"model-{qtype}.gguf"
    decoded = write_gguf(path, wide_llama_dir, qtype, tokenizer=False)
    original = load_file(str(wide_llama_dir / "model.safetensors"))
    cfg, params = _params(path)
    assert cfg.dtype == {"F16": "float16"}.get(qtype, "bfloat16")
    loaded = _split_merged(params, cfg)
    block = 256 if qtype.endswith("_K") else 32
    for name, want in original.items():
        got = loaded[name]
        # the loader gives exactly what the file decodes to (in the HF layout) ...
        np.testing.assert_allclose(got.numpy(), _unpermuted(name, decoded[name], cfg), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
        # ... which is the original within the type's error
        if want.ndim == 1:
            assert torch.equal(got, want), name
        elif qtype == "F16":
            torch.testing.assert_close(got, want, rtol=2 ** -11, atol=2 ** -24)
        elif qtype == "BF16":
            torch.testing.assert_close(got, want, rtol=2 ** -8, atol=0)
        else:
            err = (got - want).abs().reshape(-1, block).amax(-1)
            amax = want.abs().reshape(-1, block).amax(-1)
            # + 2**-9: the block's scale and offset are fp16 themselves, off by up to 2**-11 of
            # their value, which the top level multiplies
            assert (err <= (BLOCK_ERROR[qtype] + 2 ** -9) * amax).all(), (name, (err / amax).max().item())
            assert (err > 0).any(), name  # it is quantized


def _split_merged(params, cfg):
    """Our merged q|k|v and gate|up back into HF's tensors."""
    out = {}
    for name, p in params.items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = p.detach().split([cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2)
            for sub, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                out[name.replace("qkv_proj", sub)] = t
        elif name.endswith("gate_up_proj.weight"):
            gate, up = p.detach().split(cfg.intermediate_size)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = p.detach()
    return out


def _unpermuted(name, a, cfg):
    heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads if "k_proj" in name else None
    if heads is None:
        return a
    return a.reshape(heads, a.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(a.shape)


def _save_hf(folder, config, tiny_dir):
    """A random HF model of `config` with the tiny models' tokenizer (2048 tokens). HF's init
    (std 0.02) gives near-uniform logits: weights are spread so greedy choices are clear."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(25)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    for f in ("tokenizer.json", "chat_template.jinja"):
        (folder / f).write_text((tiny_dir / f).read_text())
    return folder


SMALL_HF = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_qwen2_biases_and_mistral_as_llama(family, tiny_llama_dir, tmp_path):
    """Qwen2 files carry q/k/v biases, unpermuted; Mistral's are written as architecture llama,
    q/k permuted (biases would follow their rows)."""
    from transformers import MistralConfig, Qwen2Config

    if family == "qwen2":
        config, arch, permute = Qwen2Config(**SMALL_HF, tie_word_embeddings=False), "qwen2", False
    else:
        config, arch, permute = MistralConfig(**SMALL_HF, sliding_window=None), "llama", True
    folder = _save_hf(tmp_path / family, config, tiny_llama_dir)
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, folder, arch=arch, permute=permute)
    cfg, params = _params(path)
    _, ref = _params(folder)
    assert cfg.qkv_bias == (family == "qwen2") and not cfg.o_bias
    for name in ref:
        assert torch.equal(params[name], ref[name]), name
    llm = LLM(str(path), device="cpu", block_size=4, num_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(folder, PROMPTS, 8)


def test_llama3_rope_factors_from_the_tensor(tiny_llama_dir, tmp_path):
    """Llama 3 files carry rope scaling as per-frequency divisors (rope_freqs): same inverse
    frequencies as HF's llama3 rope, and greedy output equals HF's on the folder."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from radixkv.models.rope import rope_inv_freq

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf_cfg = LlamaConfig(**SMALL_HF, rope_parameters=rope, tie_word_embeddings=True)
    folder = _save_hf(tmp_path / "llama3", hf_cfg, tiny_llama_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    path = tmp_path / "llama3.gguf"
    write_gguf(path, folder, rope_factors=(plain / scaled).numpy(), skip=("lm_head.weight",))
    cfg = load_model_config(str(path))
    assert cfg.rope_type == "llama3" and cfg.tie_word_embeddings
    torch.testing.assert_close(rope_inv_freq(cfg), scaled.float(), rtol=1e-6, atol=0)
    prompts = [[5, 17, 300, 41] * 6, [100, 3, 77, 9, 12, 64, 200, 11] * 3]  # past the original 16 positions
    llm = LLM(str(path), device="cpu", block_size=4, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(folder, prompts, 8)


def test_tokenizer_and_chat_template_come_from_the_file_alone(tiny_llama_dir, tmp_path):
    folder = tmp_path / "gguf-folder"
    folder.mkdir()
    write_gguf(folder / "tiny.gguf", tiny_llama_dir)
    # a stranger's tokenizer beside the file must not be picked up
    (folder / "tokenizer.json").write_text((tiny_llama_dir / "tokenizer.json").read_text().replace("<|im_end|>",
                                                                                                   "<|xx|>"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "BOGUS"}))
    tok = load_tokenizer(str(folder / "tiny.gguf"))
    ref = load_tokenizer(str(tiny_llama_dir))
    texts = ["Hello there, world!", "  two  spaces\nand a line", "<|im_start|>user\nhi<|im_end|>", "déjà vu 42"]
    for text in texts:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tok.eos_token == "<|im_end|>"


def test_a_folder_with_one_gguf_loads_it_and_two_are_refused(tiny_llama_dir, tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    write_gguf(folder / "a.gguf", tiny_llama_dir)
    assert resolve_model(str(folder)).path == str(folder / "a.gguf")
    llm = LLM(str(folder), device="cpu", block_size=4, num_blocks=32)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text is not None
    write_gguf(folder / "b.gguf", tiny_llama_dir)
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_model_config(str(folder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tiny_llama_dir / "config.json"))


def test_unsupported_architecture_refused_by_name(tiny_llama_dir, tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, tiny_llama_dir, arch="gpt2", tokenizer=False)
    with pytest.raises(ValueError, match="architecture 'gpt2' not supported"):
        load_model_config(str(path))
    with pytest.raises(ValueError, match="architecture 'gpt2' not supported"):
        LLM(str(path), device="cpu")


def test_unsupported_tensor_type_refused_by_name(tiny_llama_dir, tmp_path):
    path = tmp_path / "q2k.gguf"
    q2k = np.zeros((4, 84), dtype=np.uint8)  # 4 rows of one 256-value Q2_K block
    write_gguf(path, tiny_llama_dir, tokenizer=False, extra_tensors=[("blk.0.attn_extra.weight", q2k, QT.Q2_K)])
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_extra\.weight' has type Q2_K, not supported"):
        load_model_config(str(path))


def test_unknown_tensor_refused_by_name(tiny_llama_dir, tmp_path):
    path = tmp_path / "extra.gguf"
    write_gguf(path, tiny_llama_dir, tokenizer=False,
               extra_tensors=[("blk.0.attn_extra.weight", np.zeros((2, 2), np.float32), None)])
    cfg = load_model_config(str(path))
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_extra\.weight' has no place"):
        load_model(str(path), cfg, device="cpu", dtype=torch.float32, backend="torch")


def test_generate_command_on_a_gguf(tiny_llama_dir, tmp_path, capsys):
    from radixkv.cli import main

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama_dir)
    common = ["generate", str(path), "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos", "--device", "cpu",
              "--num-blocks", "32", "--json"]
    assert main(common) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["outputs"][0]["token_ids"]) == 4
    assert main(common + ["--chat"]) == 0  # the file's chat template around the prompt
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = load_tokenizer(str(path)).apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                         add_generation_prompt=True)
    assert out["prompt"] == "Hello" and out["prompt_token_ids"] == load_tokenizer(str(path))(want)["input_ids"]


def test_k_quant_encoders_agree_with_the_librarys_decoder():
    """The tests' own K-quant encoders pack what the gguf library unpacks."""
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32) * np.array([1e-3, 1, 50])[:, None].repeat(
        2, 0)
    for qtype in K_ENCODERS:
        packed, decoded = encode(x, qtype)
        np.testing.assert_allclose(dequantize(packed, QT[qtype]), decoded, rtol=1e-6, atol=1e-9, err_msg=qtype)
        rel = np.abs(decoded - x).reshape(-1, 256).max(-1) / np.abs(x).reshape(-1, 256).max(-1)
        assert rel.max() <= BLOCK_ERROR[qtype] + 2 ** -9, (qtype, rel.max())


def test_serve_a_gguf(tiny_llama_dir, tmp_path):
    """`radixkv serve FILE.gguf`: the front's tokenizer and chat template come from the file, the
    worker's weights too; the answer is the offline engine's. A bad MODEL exits with 2."""
    import subprocess
    import sys

    import httpx
    from test_server_harness import running_server

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    llm = LLM(str(path), device="cpu", block_size=16, num_blocks=32)
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    with running_server(path, tmp_path) as srv:
        r = httpx.post(srv.api + "/chat/completions", timeout=60, json={
            "model": srv.model, "messages": chat, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == want.text
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(path.read_bytes())
    bad = subprocess.run([sys.executable, "-m", "radixkv.cli", "serve", str(tmp_path / "two")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "holds 2 .gguf files" in bad.stderr
