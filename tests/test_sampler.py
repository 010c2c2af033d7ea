"""Sampler: each option against a direct computation on small logits."""

import math

import pytest
import torch

from radixkv.engine.sampler import Sampler, apply_top_k_top_p
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sequence import Request, Sequence

EOS = (0,)


def _seq(params, prompt=(5, 6), output=(), index=0):
    req = Request("r", list(prompt), params, arrival=0)
    s = Sequence(seq_id=index, request=req, index=index, token_ids=list(prompt) + list(output), cache=None)
    req.seqs.append(s)
    return s


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seqs = [_seq(SamplingParams(temperature=0.0, logprobs=3)) for _ in range(3)]
    out = Sampler("cpu", EOS)(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    lp = logits.log_softmax(-1)
    for i in range(3):
        top = lp[i].topk(3)
        expect = {int(t): float(v) for t, v in zip(top.indices, top.values)}
        assert out.top_logprobs[i] == pytest.approx(expect)
        assert out.logprobs[i] == pytest.approx(float(lp[i].max()))


def _frequencies(params, logits_row, rows=4000, seed=0):
    logits = logits_row.expand(rows, -1).clone()
    seqs = [_seq(params) for _ in range(rows)]
    toks = torch.tensor(Sampler("cpu", EOS, seed=seed)(logits, seqs).token_ids)
    return torch.bincount(toks, minlength=logits.shape[1]).float() / rows


def test_temperature_sampling_follows_softmax():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for temp in (1.0, 0.5):
        freq = _frequencies(SamplingParams(temperature=temp), row)
        expect = (row / temp).softmax(-1)
        assert (freq - expect).abs().max() < 0.03, (temp, freq, expect)


def test_top_k_top_p_min_p_restrict_the_support():
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    probs = row.softmax(-1)
    freq = _frequencies(SamplingParams(top_k=2), row)
    assert freq[2:].sum() == 0
    assert abs(freq[0] - probs[0] / probs[:2].sum()) < 0.03
    # top_p: the smallest prefix whose mass reaches p
    p = float(probs[:2].sum()) - 1e-3
    freq = _frequencies(SamplingParams(top_p=p), row)
    assert freq[2:].sum() == 0 and freq[1] > 0
    freq = _frequencies(SamplingParams(min_p=float(probs[2] / probs[0]) + 1e-3), row)
    assert freq[2:].sum() == 0 and freq[1] > 0


def test_apply_top_k_top_p_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=g)
    k = torch.tensor([1, 5, 30, 30, 3, 10])
    p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.2, 0.99])
    out = apply_top_k_top_p(logits, k, p)
    for i in range(6):
        order = logits[i].argsort(descending=True)
        keep = set(order[: int(k[i])].tolist())
        probs = logits[i][order[: int(k[i])]].softmax(-1)
        mass, kept = 0.0, set()
        for j, tok in enumerate(order[: int(k[i])].tolist()):
            if mass >= float(p[i]):
                break
            kept.add(tok)
            mass += float(probs[j])
        assert set(torch.isfinite(out[i]).nonzero().flatten().tolist()) == kept & keep


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 100, generator=g)
    alone = Sampler("cpu", EOS)(logits[2:3], [_seq(SamplingParams(seed=7))]).token_ids
    seqs = [_seq(SamplingParams(seed=s)) for s in (1, 2, 7, 3, 4)]
    seqs[2] = _seq(SamplingParams(seed=7))
    batched = Sampler("cpu", EOS, seed=99)(logits, seqs).token_ids
    assert batched[2] == alone[0]
    # sample i of a request uses seed + i
    child = _seq(SamplingParams(seed=5, n=2), index=1)
    single = _seq(SamplingParams(seed=6))
    a = Sampler("cpu", EOS)(logits[:1], [child]).token_ids
    b = Sampler("cpu", EOS)(logits[:1], [single]).token_ids
    assert a == b


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    # repetition 2: token 1 (prompt, negative) doubles, token 2 (output, positive) halves
    s = _seq(SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=0), prompt=(1,), output=(2,))
    close = torch.tensor([[1.0, -1.0, 1.5, 1.2]])  # 1.5 / 2 = 0.75 < 1.2 -> token 3
    assert Sampler("cpu", EOS)(close, [s]).token_ids == [3]
    # frequency 0.4 per occurrence + presence 0.3: token 0 seen twice loses 1.1 -> 0.9 < 1.0
    s = _seq(SamplingParams(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.3), output=(0, 0))
    assert Sampler("cpu", EOS)(logits, [s]).token_ids == [3]
    s = _seq(SamplingParams(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.0), output=(0, 0))
    assert Sampler("cpu", EOS)(logits, [s]).token_ids == [0]  # 2.0 - 0.8 = 1.2 > 1.0


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    eos_first = _seq(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]), output=(3,))
    assert Sampler("cpu", EOS)(logits, [eos_first]).token_ids == [2]
    done = _seq(SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[1]), output=(3,))
    assert Sampler("cpu", EOS)(logits, [done]).token_ids == [0]
    ignore = _seq(SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True))
    assert Sampler("cpu", EOS)(logits, [ignore]).token_ids == [0]  # EOS not masked when ignored


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("best_of", 1), ("temperature", -0.1), ("temperature", math.inf), ("top_p", 0.0), ("top_k", -2),
    ("min_p", 1.5), ("seed", -1), ("repetition_penalty", 0.0), ("frequency_penalty", 2.5),
    ("presence_penalty", -3.0), ("max_tokens", 0), ("min_tokens", 100), ("stop_token_ids", [-1]),
    ("logprobs", 21), ("use_beam_search", True), ("ignore_eos", 1), ("n", True),
])
def test_bad_sampling_params_name_the_field(field, value):
    kw = {field: value}
    if field == "best_of":
        kw["n"] = 2
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).validate()
