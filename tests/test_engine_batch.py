"""Batch tensors of a mixed step, and the generate command."""

import subprocess
import sys

import numpy as np

from radixkv.engine.batch import build_batch
from radixkv.engine.block_tables import BlockTables
from radixkv.engine.sampling_params import SamplingParams
from radixkv.cache import KVCacheManager
from radixkv.engine.sequence import Request, Sequence, Status


def _seq(cache, i, tokens, computed):
    """A running sequence with `computed` tokens in the cache (their KV is never written here)."""
    req = Request(f"r{i}", tokens[:5], SamplingParams(), arrival=i)
    s = Sequence(i, req, 0, list(tokens), cache, status=Status.RUNNING)
    req.seqs.append(s)
    cache.add_sequence(i, tokens[:5])
    assert cache.try_reserve(i, len(tokens) - cache.num_computed_tokens(i))
    cache.mark_tokens_computed(i, tokens[cache.num_computed_tokens(i) : computed])
    return s


def test_build_batch_mixed_prefill_chunk_and_decode():
    cache = KVCacheManager(16, 4)
    a = _seq(cache, 0, [10, 11, 12, 13, 14, 15, 16], computed=2)  # chunk of 3 of its prompt: positions 2..4
    b = _seq(cache, 1, [20, 21, 22, 23, 24, 25], computed=5)  # decode of its last token at position 5
    tables = BlockTables(max_rows=4, max_blocks=8, block_size=4)
    tables.sync([(5, [6, 6, 6], 4)])  # another sequence's row, with a longer table
    rows = tables.sync([(0, [7, 3], a.num_computed_tokens), (1, [1, 9], b.num_computed_tokens)])
    batch = build_batch([(a, 3), (b, 1)], tables, rows)
    assert batch.input_ids.tolist() == [12, 13, 14, 25]
    assert batch.positions.tolist() == [2, 3, 4, 5]
    assert batch.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 9 * 4 + 1]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4] and batch.cu_seqlens_q.dtype == np.int32
    assert batch.seq_lens.tolist() == [5, 6]
    assert batch.block_tables.tolist() == [[7, 3], [1, 9]]
    assert batch.max_seqlen_q == 3 and not batch.is_decode
    # a's chunk ends before its last token: only b samples
    assert batch.sample_rows.tolist() == [3] and batch.sample_seqs == [b]


def test_block_table_rows_refresh_only_what_can_change():
    t = BlockTables(max_rows=2, max_blocks=6, block_size=4)
    [r] = t.sync([(0, [4, 5], 5)])  # block 0 is computed: final from now on
    assert t.table[r, :2].tolist() == [4, 5]
    t.sync([(0, [4, 8, 9], 9)])  # copy-on-write replaced block 1, block 2 appended
    assert t.table[r, :3].tolist() == [4, 8, 9] and t.lens[r] == 3
    t.table[r, 0] = 77  # a final entry is not rewritten...
    t.sync([(0, [4, 8, 9], 9)])
    assert t.table[r, 0] == 77
    t.release(0)  # ...until the row is released (preemption, finish) and synced afresh
    [r2] = t.sync([(0, [4, 8, 9], 0)])
    assert t.table[r2, :3].tolist() == [4, 8, 9]


def test_warmup_steps_write_nothing_to_the_cache(tiny_llama_dir):
    """The start-up warm-up (run on CUDA) attends over scratch inputs; the cache stays as it was."""
    import torch

    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine

    e = Engine(EngineConfig(model_dir=str(tiny_llama_dir), device="cpu", block_size=16, num_blocks=64,
                            max_num_seqs=70, max_num_batched_tokens=200))
    kv = e.runner.kv_cache
    kv.normal_(generator=torch.Generator().manual_seed(0))
    before = kv.clone()
    e.runner._warmup()
    assert torch.equal(kv, before)


def test_generate_command(tiny_llama_dir, capsys):
    import argparse

    from radixkv.cli import generate as generate_cmd

    p = argparse.ArgumentParser()
    generate_cmd.add_arguments(p)
    args = p.parse_args([str(tiny_llama_dir), "--prompt", "Hello", "--prompt", "abc", "--max-tokens", "5",
                         "--num-blocks", "64", "--device", "cpu", "--json"])
    assert generate_cmd.main(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(lines) == 2 and '"finish_reason"' in lines[0]
    bad = p.parse_args([str(tiny_llama_dir), "--prompt", "x", "--temperature", "-1", "--device", "cpu"])
    assert generate_cmd.main(bad) == 2
    assert "temperature" in capsys.readouterr().err


def test_generate_command_imports_no_torch():
    code = "import sys, radixkv.cli.generate; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
