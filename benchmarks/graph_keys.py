"""Which shared-prefix decode-graph shapes a workload meets while it is served (CPU).

A GPU engine with shared-prefix attention replays one CUDA graph per (batch size, groups,
splits) shape and captures the shapes it did not capture at start on first use, inside a
served step. This runs the workload through the engine on the CPU (the tiny model is
enough: the schedule depends on lengths, not on the model), derives each decode batch's
prefix groups as the GPU engine does, and counts the graph shapes it would replay.

    python3 -m benchmarks.graph_keys [--model-dir DIR] [--groups 64 --per-group 16 ...]
"""

import argparse
import collections
import json
import tempfile
import time


def measure(model_dir: str, groups: int, per_group: int, prefix: int, question: int, output: int,
            max_num_seqs: int) -> dict:
    from benchmarks.workloads import generated_shared_prefix
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.cuda_graph import capture_sizes
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling_params import SamplingParams
    from radixkv.engine.shared_prefix import (MIN_SHARED_BATCH, PrefixGroupCache, shared_graph_key,
                                              start_up_shared_keys)

    w = generated_shared_prefix(groups, per_group, prefix, question, output)
    per_seq = -(-(prefix + question + output) // 16)
    cfg = EngineConfig(model_dir=model_dir, device="cpu", max_num_seqs=max_num_seqs,
                       num_blocks=groups * -(-prefix // 16) + len(w.requests) * per_seq)
    e = Engine(cfg)
    sizes = capture_sizes(min(cfg.max_cuda_graph_batch, cfg.max_num_seqs))
    max_blocks = -(-e.runner.max_positions // e.runner.block_size)
    at_start = set(start_up_shared_keys(sizes, MIN_SHARED_BATCH))
    cache = PrefixGroupCache(e.runner.block_size, cfg.shared_prefix_min_saved_tokens)
    keys, decode_steps = collections.Counter(), 0
    execute = e.runner.execute

    def observe(scheduled, block_table, copy_ops):
        nonlocal decode_steps
        batch, logits = execute(scheduled, block_table, copy_ops)
        if batch.is_decode:
            decode_steps += 1
            g, _ = cache.get(tuple(s.seq_id for s, _ in scheduled), batch.block_tables, batch.seq_lens)
            keys[shared_graph_key(len(batch.seq_lens), g, sizes, MIN_SHARED_BATCH, max_blocks)] += 1
        return batch, logits

    e.runner.execute = observe
    for i, r in enumerate(w.requests):
        e.add_request(f"r{i}", r.prompt, SamplingParams(temperature=0.0, max_tokens=len(r.output), ignore_eos=True))
    t, steps = time.perf_counter(), 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
    shared = {k: n for k, n in keys.items() if k is not None}
    return {"workload": w.params, "steps": steps, "decode_steps": decode_steps,
            "plain_graph_steps": keys[None], "shared_graph_steps": sum(shared.values()),
            "group_derivations": cache.num_derived, "shapes": len(shared),
            "shapes_captured_while_serving": sorted(k for k in shared if k not in at_start),
            "steps_by_shape": {str(k): n for k, n in sorted(shared.items())},
            "wall_s": time.perf_counter() - t}


def add_arguments(p) -> None:
    p.add_argument("--model-dir", default=None, help="HF model folder (default: a tiny Llama in a temp dir)")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--question", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)


def main(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from radixkv.models.tiny import build_tiny_model

            model_dir = str(build_tiny_model(tmp))
        r = measure(model_dir, args.groups, args.per_group, args.prefix, args.question, args.output,
                    args.max_num_seqs)
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
