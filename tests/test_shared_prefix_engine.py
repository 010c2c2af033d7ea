"""Shared-prefix attention inside the engine: the same tokens as the plain paged kernel, prefix
groups derived only when the decode batch changes, and the padded inputs of a shared-prefix
CUDA graph attending exactly like the unpadded groups.

Without CUDA the Triton kernels run in the interpreter, and the decode graphs' logic (static
inputs, padding, group layout, graph choice) runs with "replays" that re-run the captured
forward; with CUDA the graphs are real (captured for batches of any size here)."""

import random

import numpy as np
import pytest
import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.cuda_graph import DecodeGraphs
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.shared_prefix import PrefixGroupCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 4  # block size of these tests


class EagerReplayGraphs(DecodeGraphs):
    """DecodeGraphs without CUDA: a "graph" re-runs its forward on the static inputs at replay."""

    def _capture(self, key) -> None:
        self.graphs[key] = type("Replay", (), {"replay": staticmethod(lambda: self._run(key))})()
        if key.shared:
            self.num_shared_captures += 1


def decode_graphs(runner, max_batch, **kw):
    cls = DecodeGraphs if runner.device.type == "cuda" else EagerReplayGraphs
    return cls(runner.model, max_batch, -(-runner.max_positions // runner.block_size), runner.device, **kw)


def _run(engine, prompts, max_tokens=5):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    outs, shared_steps, decode_batches = {}, 0, set()
    while engine.has_unfinished_requests():
        running = tuple(s.seq_id for s in engine.scheduler.running)
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        shared_steps += engine.runner.last_step_shared
        if engine.runner.last_step_shared:
            decode_batches.add(running)
    return [outs[f"r{i}"] for i in range(len(prompts))], shared_steps, decode_batches


def test_engine_with_shared_prefix_attention_matches_plain(tiny_llama_dir):
    rng = random.Random(0)
    system = [rng.randrange(3, 2048) for _ in range(40)]  # 10 shared blocks
    prompts = [system + [rng.randrange(3, 2048) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    prompts.append([rng.randrange(3, 2048) for _ in range(19)])  # shares nothing: private from token 0
    common = dict(model_dir=str(tiny_llama_dir), device=DEVICE, dtype="float32", attention_backend="triton",
                  block_size=BS, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64)
    plain = Engine(EngineConfig(**common, enable_shared_prefix_attention=False))
    assert plain.runner.prefix_groups is None
    want, none_shared, _ = _run(plain, prompts)
    assert none_shared == 0
    shared = Engine(EngineConfig(**common, enable_shared_prefix_attention=True, shared_prefix_min_saved_tokens=1))
    # decode graphs with shared-prefix variants for every batch size, not only from 64 rows up
    shared.runner.graphs = decode_graphs(shared.runner, 8, shared_prefix=True, min_shared_batch=1)
    got, shared_steps, batches = _run(shared, prompts)
    assert got == want
    assert shared_steps >= 3
    # groups are derived once per distinct decode batch, not once per step
    assert shared.runner.prefix_groups.num_derived <= len(batches) + 2 < shared_steps + 2
    assert shared.runner.graphs.num_shared_captures > 0


def _tables(rows):
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], np.int32)


def test_group_cache_derives_when_the_batch_changes_and_only_if_it_pays():
    shared = list(range(100, 110))
    rows = [shared + [i] for i in range(4)]  # 4 rows x 10 shared blocks: 30 blocks not re-read
    lens = np.array([len(r) * BS - 1 for r in rows], np.int32)
    cache = PrefixGroupCache(BS, min_saved_tokens=30 * BS)
    g, on_dev = cache.get((1, 2, 3, 4), _tables(rows), lens)
    assert g is not None and g.saved_tokens == 30 * BS and g.shared_lens.tolist() == [10 * BS]
    assert on_dev is g  # no device given: the CPU groups
    again, _ = cache.get((1, 2, 3, 4), _tables(rows), lens + 1)  # rows appended tokens: still valid
    assert again is g and cache.num_derived == 1
    fewer, _ = cache.get((1, 2, 3), _tables(rows[:3]), lens[:3])  # a row left: derived afresh
    assert cache.num_derived == 2 and fewer is None  # 20 blocks saved < the threshold: plain kernel
    assert cache.get((5, 6), _tables([[1, 2], [3, 4]]), np.array([7, 7], np.int32)) == (None, None)


def test_padded_graph_inputs_attend_like_the_unpadded_groups():
    from kernels.reference import paged_attention_ref
    from kernels.shared_prefix import PrefixGroups, derive_groups, shared_prefix_decode
    from radixkv.engine.shared_prefix import LEVELS, pad_groups

    g = torch.Generator().manual_seed(0)
    # 5 rows: rows 0-3 share blocks 1-3, rows 0-1 also 4-5 (two levels), row 4 shares nothing
    rows = [[1, 2, 3, 4, 5, 10], [1, 2, 3, 4, 5, 11, 12], [1, 2, 3, 13], [1, 2, 3, 14, 15], [16, 17, 18]]
    lens = [22, 27, 15, 18, 11]
    n, bs, g_pad, heads, kv_heads, d = len(rows), 8, 4, 4, 2, 16
    groups = derive_groups(rows, lens, block_size=BS, min_shared_blocks=1, max_levels=LEVELS)
    assert groups.num_groups == 2 and groups.num_levels == 2
    padded = pad_groups(groups, n, bs, g_pad)
    ref = groups.padded(num_groups=g_pad + 1, num_members=LEVELS * bs, num_levels=LEVELS)
    for name in ("shared_lens", "cu_members", "members"):
        assert padded[name].tolist() == getattr(ref, name).tolist(), name
    for name in ("seq_slots", "private_start"):
        assert padded[name][:n].tolist() == getattr(ref, name).tolist(), name
    assert (padded["seq_slots"][n:] == -1).all() and (padded["private_start"][n:] == 0).all()

    k_cache = torch.randn(20, BS, kv_heads, d, generator=g)
    v_cache = torch.randn(20, BS, kv_heads, d, generator=g)
    q = torch.randn(bs, heads, d, generator=g)
    tables = np.zeros((bs, 8), np.int32)
    tables[:n, :7] = _tables(rows)
    seq_lens = np.ones(bs, np.int32)  # padding rows: one token of block 0
    seq_lens[:n] = lens
    g_tab = torch.zeros(g_pad + 1, 8, dtype=torch.int32)
    g_tab[: groups.num_groups, : groups.block_tables.shape[1]] = groups.block_tables
    t = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    graph_groups = PrefixGroups(  # the host bounds a captured graph uses: any member count, one split
        block_tables=g_tab.to(DEVICE), shared_lens=t(padded["shared_lens"]), cu_members=t(padded["cu_members"]),
        members=t(padded["members"]), seq_slots=t(padded["seq_slots"]), private_start=t(padded["private_start"]),
        max_members=LEVELS * 16, max_shared_len=1024)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    out = shared_prefix_decode(dev(q), dev(k_cache), dev(v_cache), graph_groups, t(tables), t(seq_lens), scale=0.25)
    want = paged_attention_ref(q[:n], k_cache, v_cache, torch.from_numpy(tables[:n]),
                               torch.arange(n + 1, dtype=torch.int32), torch.from_numpy(seq_lens[:n]),
                               scale=0.25, max_seqlen_q=1)
    tol = 1e-5 if DEVICE == "cpu" else 2e-3  # the GPU's fp32 dots run in TF32
    torch.testing.assert_close(out[:n].cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("field, value", [("enable_shared_prefix_attention", 1),
                                          ("shared_prefix_min_saved_tokens", -1),
                                          ("shared_prefix_min_saved_tokens", 2.5)])
def test_config_rejects_bad_shared_prefix_settings(tiny_llama_dir, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model_dir=str(tiny_llama_dir), **{field: value})
