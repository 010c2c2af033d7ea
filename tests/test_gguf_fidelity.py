"""Fidelity on trained weights: SmolLM2-135M-Instruct's Q4_1 GGUF, CPU, fp32. radixkv's greedy
tokens equal HF transformers' `generate` on the same file (HF dequantizes it itself, through
`gguf_file`) for chat prompts with the chat template applied: cache cold and warm, with chunked
prefill and under preemption; seeded sampling gives the same tokens again, whatever the batch
and schedule; the text equals HF's decode of the same ids.

HF's load takes ~15-35 s here, so HF and each engine are built once per module. The default run
compares 16 new tokens per chat; the slow case (-m slow) longer answers and more chats.
"""

import os

import pytest
import torch

from radixkv.cli.demo import SYSTEM_PROMPT
from radixkv.engine.llm import LLM
from radixkv.engine.sampling_params import SamplingParams
from radixkv.models.smollm2 import INSTALL, smollm2_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 16
CHATS = [
    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "When are you open?"}],
    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "How much is a croissant?"}],
    [{"role": "user", "content": "What is the capital of France?"}],  # the template adds its own system turn
    [{"role": "user", "content": "Give me one tip for sleeping better."}],
]
MORE_CHATS = CHATS + [
    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Can I order a birthday cake?"},
     {"role": "assistant", "content": "Yes, with two days' notice."}, {"role": "user", "content": "And delivery?"}],
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    [{"role": "user", "content": "List three fruits that are red."}],
]


@pytest.fixture(scope="module")
def gguf_path():
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct's GGUF is not installed ({INSTALL})")
    return path


@pytest.fixture(scope="module")
def hf(gguf_path):
    """HF's own model and tokenizer from the same file: the reference."""
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


def _chat_ids(tok, chats):
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]


def _hf_greedy(hf, prompts, max_tokens):
    model, _ = hf
    with torch.no_grad():  # one at a time: no padding; HF stops at the file's EOS (<|im_end|>)
        return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


@pytest.fixture(scope="module")
def prompts(hf):
    return _chat_ids(hf[1], CHATS)


@pytest.fixture(scope="module")
def reference(hf, prompts):
    return _hf_greedy(hf, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, device="cpu")


# A pool of 58 blocks of 4 tokens (the longest chat and its answer need 56) for chats of ~200
# and ~40 tokens: they cannot all run at once (preemption); at most 8 prompt tokens of a sequence
# and 16 tokens in all per step (chunked prefill).
SMALL = dict(device="cpu", block_size=4, num_blocks=58, max_num_seqs=4, max_num_batched_tokens=16,
             max_prefill_chunk=8)


@pytest.fixture(scope="module")
def small_llm(gguf_path):
    return LLM(gguf_path, **SMALL)


def _check_against_hf(outs, reference, tok, max_tokens):
    for o, want in zip(outs, reference):
        c = o.outputs[0]
        assert c.token_ids == want
        assert c.text == tok.decode(want, skip_special_tokens=True)
        assert c.finish_reason == ("length" if len(want) == max_tokens else "stop")


def test_tokenizer_and_chat_template_equal_hfs(llm, hf, prompts):
    tok = hf[1]
    assert _chat_ids(llm.tokenizer, CHATS) == prompts
    assert llm.tokenizer.chat_template == tok.chat_template
    cfg = llm.engine.model_config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (tok.eos_token_id,)


def test_greedy_equals_hf_cache_cold_then_warm(llm, hf, prompts, reference):
    cold_start = llm.engine.counters.prompt_tokens == 0
    cold = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    _check_against_hf(cold, reference, hf[1], MAX_TOKENS)
    if cold_start:
        assert cold[0].num_cached_tokens == 0
    warm = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    _check_against_hf(warm, reference, hf[1], MAX_TOKENS)
    # every full block of every prompt is cached now (one token is always computed)
    assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert min(o.num_cached_tokens for o in warm[:2]) >= 160  # the shared system prompt's blocks
    llm.engine.cache.check_invariants()


def test_greedy_equals_hf_with_chunked_prefill_and_preemption(small_llm, hf, prompts, reference):
    outs = small_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    _check_against_hf(outs, reference, hf[1], MAX_TOKENS)
    m = small_llm.engine.metrics()
    assert m.preemptions > 0, m
    assert m.running == m.waiting == 0 and m.cache.in_use_blocks == 0
    small_llm.engine.cache.check_invariants()


def test_seeded_sampling_is_reproducible(llm, small_llm, prompts):
    def sample(engine, seed):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=12)
        return [o.outputs[0].token_ids for o in engine.generate(prompts[1:3], params)]

    first = sample(llm, 7)
    assert sample(llm, 7) == first  # again, with the prompts cached now
    assert sample(small_llm, 7) == first  # other batches, chunks and preemptions
    assert sample(llm, 8) != first


@pytest.mark.slow
def test_longer_answers_equal_hf(llm, gguf_path, hf):
    prompts = _chat_ids(hf[1], MORE_CHATS)
    want = _hf_greedy(hf, prompts, 48)
    preempting = LLM(gguf_path, **{**SMALL, "num_blocks": 72})  # 288 tokens: the longest chat + 48
    for engine in (llm, preempting):
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48))
        _check_against_hf(outs, want, hf[1], 48)
    assert preempting.engine.metrics().preemptions > 0
