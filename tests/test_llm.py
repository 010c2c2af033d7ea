"""End to end on the CPU (fp32, torch reference attention): the engine's greedy tokens equal HF
transformers' `generate` on the same folder, under chunked prefill, preemption and prefix caching."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixkv.engine.llm import LLM
from radixkv.engine.sampling_params import SamplingParams

MAX_TOKENS = 12


def _prompts(seed=0, lengths=(3, 29, 11, 40, 17, 6)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]


def _hf_greedy(model_dir, prompts, max_tokens=MAX_TOKENS):
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding, HF's own EOS handling from generation_config
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
            outs.append(ids[0, len(p):].tolist())
    return outs


# a small pool (18 blocks of 4 tokens for ~6 x 30 tokens of work) forces preemption;
# chunks of at most 5 prompt tokens per sequence per step force chunked prefill
SMALL = dict(device="cpu", block_size=4, num_blocks=18, max_num_seqs=4, max_num_batched_tokens=12, max_prefill_chunk=5)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_greedy_equals_hf_generate_with_chunking_and_preemption(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = _prompts()
    llm = LLM(str(model_dir), **SMALL)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    ref = _hf_greedy(model_dir, prompts)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, r in zip(outs, ref):
        assert o.outputs[0].finish_reason == ("length" if len(r) == MAX_TOKENS else "stop")
    m = llm.engine.metrics()
    assert m.preemptions > 0, m
    assert m.running == m.waiting == 0
    llm.engine.cache.check_invariants()
    assert m.cache.in_use_blocks == 0


def test_prefix_cache_on_off_identical_and_hits_on_rerun(tiny_llama_dir):
    rng = random.Random(1)
    system = [rng.randrange(3, 2048) for _ in range(37)]
    prompts = [system + [rng.randrange(3, 2048) for _ in range(n)] for n in (5, 9, 2, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    cfg = dict(device="cpu", block_size=4, num_blocks=128, max_prefill_chunk=8)
    on = LLM(str(tiny_llama_dir), **cfg)
    off = LLM(str(tiny_llama_dir), enable_prefix_caching=False, **cfg)
    first = on.generate(prompts, params)
    plain = off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in plain]
    assert all(o.num_cached_tokens == 0 for o in plain)
    again = on.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    # the whole prompt's full blocks are cached now (capped so one token is computed)
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert on.engine.metrics().cached_prompt_tokens > 0


def test_text_prompts_and_logprobs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_blocks=64)
    outs = llm.generate(["Hello there", "def f(x):"], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))
    for o in outs:
        c = o.outputs[0]
        assert o.prompt_token_ids == llm.tokenizer(o.prompt)["input_ids"]
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and 1 <= len(lp) <= 3
            assert lp[tok] == max(lp.values())  # greedy picks the most likely token
        assert c.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(c.token_ids, c.logprobs)), abs=1e-4)


def test_generate_rejects_bad_prompt_and_adds_nothing(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_token_ids"):
        llm.generate([[5, 6, 7], [5, 99999]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt_token_ids: prompt of 200 tokens"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=4))  # pool holds 128 tokens
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.cache.stats().in_use_blocks == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
