"""Parallel sampling (n > 1, best_of) on shared blocks, on the tiny Llama (CPU, fp32): samples equal
independent seeded requests, the prompt is computed once, and the per-request block accounting
matches what fork + copy-on-write must hold."""

import random

import pytest

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams
from test_engine_cases import run_engine

B = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model_dir, **kw):
    args = dict(device="cpu", block_size=B, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    return Engine(EngineConfig(model_dir=str(model_dir), **args))


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _cdiv(a, b):
    return -(-a // b)


def test_samples_equal_seeded_singles_and_the_prompt_is_computed_once(tiny_llama_dir):
    prompt, n, max_tokens = _prompt(10), 4, 8  # 10 tokens: two full blocks and a shared partial one
    e = _engine(tiny_llama_dir, max_prefill_chunk=3)  # the prompt takes several chunks, still once
    e.add_request("multi", prompt, SamplingParams(n=n, seed=21, max_tokens=max_tokens, ignore_eos=True))
    out = run_engine(e)["multi"]
    assert [c.index for c in out.outputs] == list(range(n))
    assert out.sharing.num_computed_prompt_tokens == len(prompt)
    m = e.metrics()
    assert m.computed_prompt_tokens == len(prompt)
    assert m.computed_tokens == len(prompt) + n * (max_tokens - 1)
    # three of the four holders of the partial prompt block copy it before writing
    assert m.cache.copy_on_write_blocks == n - 1

    singles = _engine(tiny_llama_dir, enable_prefix_caching=False)
    for i in range(n):
        singles.add_request(f"s{i}", prompt, SamplingParams(seed=21 + i, max_tokens=max_tokens, ignore_eos=True))
    got = run_engine(singles)
    assert [c.token_ids for c in out.outputs] == [got[f"s{i}"].outputs[0].token_ids for i in range(n)]
    assert len({tuple(c.token_ids) for c in out.outputs}) == n
    for i, c in enumerate(out.outputs):
        assert abs(c.cumulative_logprob - got[f"s{i}"].outputs[0].cumulative_logprob) < 1e-4
    assert singles.metrics().computed_prompt_tokens == n * len(prompt)

    # peak: the step that computes each sample's last kept token (prompt + 7 tokens each)
    last = len(prompt) + max_tokens - 1
    assert out.sharing.blocks_without_sharing == n * _cdiv(last, B)
    assert out.sharing.blocks_held == len(prompt) // B + n * (_cdiv(last, B) - len(prompt) // B)
    assert 0 < out.sharing.block_steps_held < out.sharing.block_steps_without_sharing
    solo = got["s0"].sharing
    assert solo.blocks_held == solo.blocks_without_sharing == _cdiv(last, B)
    assert solo.block_steps_held == solo.block_steps_without_sharing


def test_best_of_keeps_the_most_likely_and_counts_every_sample(tiny_llama_dir):
    prompt = _prompt(13, seed=2)
    e = _engine(tiny_llama_dir)
    e.add_request("b", prompt, SamplingParams(n=2, best_of=5, seed=7, max_tokens=6, ignore_eos=True))
    out = run_engine(e)["b"]
    assert [c.index for c in out.outputs] == [0, 1]
    everything = _engine(tiny_llama_dir)
    everything.add_request("all", prompt, SamplingParams(n=5, seed=7, max_tokens=6, ignore_eos=True))
    full = run_engine(everything)["all"]
    best = sorted(full.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert out.sharing.num_computed_prompt_tokens == len(prompt)
    # all five samples held blocks, whatever is returned
    assert out.sharing.blocks_without_sharing == full.sharing.blocks_without_sharing == 5 * _cdiv(len(prompt) + 5, B)
    assert out.sharing.blocks_held == full.sharing.blocks_held < out.sharing.blocks_without_sharing


def test_samples_survive_preemption_and_the_recompute_is_counted(tiny_llama_dir):
    prompt = _prompt(18, seed=3)
    params = SamplingParams(n=4, seed=5, max_tokens=10, ignore_eos=True)
    roomy = _engine(tiny_llama_dir)
    roomy.add_request("r", prompt, params)
    ref = run_engine(roomy)["r"]
    # the four samples end at 27 tokens: 4 shared prompt blocks + 4 x 3 own > 14 blocks of 4
    computed = {}
    for caching in (True, False):
        tight = _engine(tiny_llama_dir, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=16,
                        enable_prefix_caching=caching)
        tight.add_request("r", prompt, params)
        out = run_engine(tight)["r"]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        m = tight.metrics()
        assert m.preemptions > 0 and m.cache.in_use_blocks == 0
        assert out.sharing.blocks_held <= 14
        computed[caching] = out.sharing.num_computed_prompt_tokens
    # a preempted sample recomputes its prompt (counted: it is real work) unless it finds the
    # prompt's committed blocks in the cache
    assert len(prompt) <= computed[True] < computed[False]


def test_samples_mixed_with_other_requests(tiny_llama_dir):
    prompts = [_prompt(9, seed=10), _prompt(22, seed=11), _prompt(5, seed=12)]
    params = [SamplingParams(n=3, seed=1, max_tokens=7), SamplingParams(temperature=0.0, max_tokens=9),
              SamplingParams(n=2, best_of=3, seed=2, max_tokens=5)]
    together = _engine(tiny_llama_dir)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        together.add_request(f"r{i}", p, sp)
    mixed = run_engine(together)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = _engine(tiny_llama_dir)
        alone.add_request("x", p, sp)
        ref = run_engine(alone)["x"]
        assert [c.token_ids for c in mixed[f"r{i}"].outputs] == [c.token_ids for c in ref.outputs]
        assert mixed[f"r{i}"].sharing.num_computed_prompt_tokens == len(p)
