"""CPU time the engine spends per step around the forward, at a full decode batch.

    radixkv bench overhead MODEL_DIR [--seqs 256] [--prompt 1152] [--shared 1024]

The model's forward is swapped for fixed logits (the batch tensors are still built), so what
is timed is the Python the GPU waits for each step: scheduling, block-table sync and batch
building, commit to the cache and outputs (the sampler is timed apart: its tensor math, CPU
work here, runs on the device in a GPU engine). Thread CPU time, so other
processes on the machine do not inflate it.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def measure(model_dir: str, seqs: int = 256, prompt: int = 1152, shared: int = 1024, output: int = 128) -> dict:
    import torch

    from radixkv.engine.batch import build_batch
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling_params import SamplingParams

    e = Engine(EngineConfig(model_dir=model_dir, device="cpu", max_num_seqs=seqs,
                            num_blocks=seqs * -(-(prompt + output) // 16) + 64))
    vocab = e.model_config.vocab_size
    logits = torch.zeros(seqs, vocab)  # allocated once: a fresh one per step costs page faults

    def no_forward(scheduled, block_table, copy_ops):
        tables = e.runner.block_tables
        batch = build_batch(scheduled, tables, tables.sync_step(scheduled, block_table))
        return batch, logits[: len(batch.sample_seqs)]

    e.runner.execute = no_forward
    phases = {"schedule": 0.0, "run": 0.0, "sampler": 0.0, "outputs": 0.0}

    def timed(name, fn):
        def wrapper(*args):
            t = time.thread_time()
            try:
                return fn(*args)
            finally:
                phases[name] += time.thread_time() - t
        return wrapper

    e.scheduler.schedule = timed("schedule", e.scheduler.schedule)
    e._run = timed("run", e._run)
    e._output = timed("outputs", e._output)
    e.sampler = timed("sampler", e.sampler)
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(shared)]
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(seqs):
        e.add_request(f"r{i}", system + [rng.randrange(3, vocab) for _ in range(prompt - shared)], params)
    totals, steps = dict.fromkeys(phases, 0.0), 0
    while e.has_unfinished_requests():
        full = len(e.scheduler.running) == seqs and not e.scheduler.waiting
        for k in phases:
            phases[k] = 0.0
        e.step()
        if full:
            steps += 1
            for k in phases:
                totals[k] += phases[k]
    totals["run"] -= totals["sampler"]  # "run": block tables, batch, commit, appends
    ms = {k: round(v / steps * 1e3, 3) for k, v in totals.items()}
    # the sampler's tensor math runs on the device in a GPU engine; here it is CPU work
    host = round(sum(v for k, v in ms.items() if k != "sampler"), 3)
    return {"running": seqs, "decode_steps": steps, "cpu_ms_per_step": ms, "host_ms_without_sampler": host}


def add_arguments(p) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1152)
    p.add_argument("--shared", type=int, default=1024)


def main(args) -> int:
    print(json.dumps(measure(args.model_dir, args.seqs, args.prompt, args.shared)))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
