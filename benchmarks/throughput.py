"""GPU throughput: our engine vs HF transformers, same model, same requests, one process.

Workload (DESIGN section 6): N requests of a 1,024-token shared system prompt + a
128-token unique question, 128 output tokens each, greedy, EOS ignored; N = 64 and
256. Peers, measured in this same run on the same weights:
- HF `generate`, one static batch of N (every prompt is the same length: no padding);
- HF `generate_batch`, its own continuous batching with a paged cache.
Ours alone also runs the generated-shared-prefix workload (64 groups x 16 prompts,
2,048-token prefix, 128-token question, 256 output tokens).

Also measured in the run: copy bandwidth (a large clone) and the bf16 matmul rate,
from which the roofline floor of the work is computed: prefill FLOPs with prefix
caching / matmul rate + per decode step (weights + KV read) / copy bandwidth, once
with every sequence reading the shared prefix and once with it read once per step.

The model is a random-initialised Llama-3-8B shape (timing does not depend on the
weights' values) written to an HF folder that both HF and we load from disk.
"""

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.out_dir import OUT_HELP
from benchmarks.out_dir import out_dir as make_out_dir

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)


def _sync_time(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def measure_hardware() -> dict:
    """Copy bandwidth (read + write of a 4 GiB clone) and dense bf16 matmul rate."""
    import torch
    from triton.testing import do_bench

    x = torch.empty(2 * 1024**3, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: x.clone(), warmup=5, rep=50)
    copy_bw = 2 * x.numel() * 2 / (ms * 1e-3)
    del x
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=5, rep=50)
    flops = 2 * n**3 / (ms * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "matmul_flops_per_s": flops}


def make_requests(n: int, shared: int, unique: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1000, vocab - 1000) for _ in range(shared)]
    return [system + [rng.randrange(1000, vocab - 1000) for _ in range(unique)] for _ in range(n)]


def roofline(cfg: dict, prompts, output_len: int, hw: dict, shared: int) -> dict:
    """Floor of the work with prefix caching: the shared prefix is prefilled once."""
    h, L, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kvh, d = cfg["num_key_value_heads"], cfg["head_dim"]
    layer_params = 2 * h * h + 2 * h * kvh * d + 3 * h * inter
    weight_bytes = 2 * (L * layer_params + v * h)  # lm_head read every step, embedding rows negligible
    kv_bytes_per_token = L * 2 * kvh * d * 2
    n = len(prompts)
    prefill_tokens = shared + sum(len(p) - shared for p in prompts)
    prefill_flops = 2 * L * layer_params * prefill_tokens + 2 * v * h * n
    # attention: QK^T and PV over the context each new token sees (causal inside a prompt)
    nq = cfg["num_attention_heads"]
    prefill_flops += 4 * L * nq * d * (shared * shared / 2 + sum((len(p) - shared) * (len(p) + shared) / 2 for p in prompts))
    prefill_s = prefill_flops / hw["matmul_flops_per_s"]
    every, once = 0.0, 0.0
    plen = len(prompts[0])
    for step in range(1, output_len):
        ctx = plen + step
        every += (weight_bytes + n * ctx * kv_bytes_per_token) / hw["copy_bytes_per_s"]
        once += (weight_bytes + (shared + n * (ctx - shared)) * kv_bytes_per_token) / hw["copy_bytes_per_s"]
    return {"prefill_tokens": prefill_tokens, "floor_s": prefill_s + every, "floor_shared_once_s": prefill_s + once}


def run_hf_generate(model, prompts, output_len: int) -> dict:
    import torch

    ids = torch.tensor(prompts, device="cuda")
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    model.generate(ids[:2, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    torch.cuda.reset_peak_memory_stats()
    out = None

    def go():
        nonlocal out
        out = model.generate(ids, **kw)

    s = _sync_time(go)
    assert out.shape[1] == ids.shape[1] + output_len
    return {"seconds": s, "output_tokens": len(prompts) * output_len, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def run_hf_generate_batch(model, prompts, output_len: int) -> dict:
    import torch
    from transformers import GenerationConfig
    from transformers import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=8192, allow_block_sharing=True)
    torch.cuda.reset_peak_memory_stats()
    outs = None

    def go():
        nonlocal outs
        outs = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb)

    s = _sync_time(go)
    produced = sum(len(o.generated_tokens) for o in outs.values())
    return {"seconds": s, "output_tokens": produced, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def run_ours(engine, prompts, output_len: int, tag: str) -> dict:
    import torch

    from radixkv.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.reset_peak_memory_stats()
    graphs = engine.runner.graphs  # shared-prefix graphs are captured on first use, inside the timing
    captures0 = (graphs.num_shared_captures, graphs.shared_capture_s) if graphs else (0, 0.0)
    produced = cached = 0
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += sum(len(c.token_ids) for c in out.outputs)
                cached += out.num_cached_tokens
        steps += 1
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    captures = (graphs.num_shared_captures, graphs.shared_capture_s) if graphs else (0, 0.0)
    return {"seconds": s, "output_tokens": produced, "cached_prompt_tokens": cached, "steps": steps,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "shared_graph_captures": captures[0] - captures0[0], "shared_capture_s": captures[1] - captures0[1]}


def write_model_folder(path: Path, cfg: dict):
    """Random bf16 weights of the given shape, saved as an HF folder; returns the HF model (on the GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.eval()
    if not (path / "config.json").exists():
        model.save_pretrained(path, safe_serialization=True)
    return model


def add_arguments(p) -> None:
    p.add_argument("--num-requests", type=int, nargs="+", default=[64, 256])
    p.add_argument("--shared", type=int, default=1024)
    p.add_argument("--unique", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--model-dir", default="/tmp/radixkv-llama3-8b", help="where the random model folder is written")
    p.add_argument("--peers", nargs="*", default=["hf_generate", "hf_generate_batch"])
    p.add_argument("--generate-batch-max-requests", type=int, default=256,
                   help="run HF generate_batch only up to this many requests (it is slow)")
    p.add_argument("--gsp", action="store_true", help="also run the generated-shared-prefix workload (every config of ours)")
    p.add_argument("--engine-args", default="{}", help="JSON of EngineConfig fields common to every config of ours")
    p.add_argument("--configs", default='{"radixkv": {}}',
                   help="JSON {name: EngineConfig fields}: each of ours runs in a fresh engine")
    p.add_argument("--out", default=None, help=OUT_HELP)


def main(args) -> int:
    import torch

    from radixkv.engine.config import EngineConfig
    from radixkv.engine.engine import Engine

    assert torch.cuda.is_available(), "the throughput benchmark needs a CUDA device"
    out_dir = make_out_dir(args.out, "throughput")
    hw = measure_hardware()
    print(f"copy {hw['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {hw['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s",
          flush=True)
    model_dir = Path(args.model_dir)
    t = time.perf_counter()
    hf = write_model_folder(model_dir, LLAMA3_8B)
    print(f"model folder ready in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    for n in args.num_requests:
        prompts = make_requests(n, args.shared, args.unique, LLAMA3_8B["vocab_size"], seed=n)
        floor = roofline(LLAMA3_8B, prompts, args.output_len, hw, args.shared)
        for peer in args.peers:
            if peer == "hf_generate_batch" and n > args.generate_batch_max_requests:
                continue
            fn = {"hf_generate": run_hf_generate, "hf_generate_batch": run_hf_generate_batch}[peer]
            try:
                r = fn(hf, prompts, args.output_len)
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append({"system": peer, "requests": n, **r, **floor})
            print(rows[-1], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    del hf
    gc.collect()
    torch.cuda.empty_cache()

    configs = json.loads(args.configs)
    for ci, (name, fields) in enumerate(configs.items()):
        try:
            t = time.perf_counter()
            engine = Engine(EngineConfig(model_dir=str(model_dir), device="cuda", dtype="bfloat16",
                                         **{**json.loads(args.engine_args), **fields}))
            # warm-up at the measured shapes (its own prompts): the kernels of full-size prefill
            # chunks compile here, not inside the first config's timing
            run_ours(engine, make_requests(max(args.num_requests), args.shared, args.unique, LLAMA3_8B["vocab_size"],
                                           seed=99), 4, "warmup")
            print(f"{name}: engine ready in {time.perf_counter() - t:.1f} s", flush=True)
            for n in args.num_requests:
                # a fresh system prompt per run: no run is served from another's cache
                prompts = make_requests(n, args.shared, args.unique, LLAMA3_8B["vocab_size"], seed=1000 * (ci + 1) + n)
                floor = roofline(LLAMA3_8B, prompts, args.output_len, hw, args.shared)
                rows.append({"system": name, "requests": n, **run_ours(engine, prompts, args.output_len, f"r{n}"),
                             **floor})
                print(rows[-1], flush=True)
            if args.gsp:
                rng = random.Random(7)
                prompts = []
                for g in range(64):
                    system = [rng.randrange(1000, 120000) for _ in range(2048)]
                    prompts += [system + [rng.randrange(1000, 120000) for _ in range(128)] for _ in range(16)]
                r = run_ours(engine, prompts, 256, "gsp")
                rows.append({"system": name, "workload": "generated_shared_prefix", "requests": len(prompts), **r})
                print(rows[-1], flush=True)
        except Exception as e:  # one failing config must not lose the others' figures
            import traceback

            traceback.print_exc()
            rows.append({"system": name, "requests": 0, "error": f"{type(e).__name__}: {e}"[:300]})
        finally:
            engine = None
            gc.collect()
            torch.cuda.empty_cache()

    for r in rows:
        if "seconds" in r:
            r["output_tok_per_s"] = r["output_tokens"] / r["seconds"]
            if "floor_s" in r:
                r["x_floor"] = r["seconds"] / r["floor_s"]
                r["x_floor_shared_once"] = r["seconds"] / r["floor_shared_once_s"]
    peers = set(args.peers)
    for r in rows:
        if r["system"] not in peers and "floor_s" in r:
            for peer in rows:
                if peer["system"] in peers and peer["requests"] == r["requests"] and "seconds" in peer:
                    r[f"x_{peer['system']}"] = r["output_tok_per_s"] / peer["output_tok_per_s"]
    date = time.strftime("%Y-%m-%d")
    result = {"date": date, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "hardware": hw,
              "rows": rows, "command": "python3 -m benchmarks.throughput " + " ".join(sys.argv[1:])}
    (out_dir / "throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| system | workload | requests | output tok/s | seconds | x floor | x floor (shared once) | vs HF generate "
             "| peak GiB | shared graphs captured (s) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['system']} | shared prompt | {r['requests']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['system']} | {r.get('workload', 'shared prompt')} | {r['requests']} | {r['output_tok_per_s']:,.0f} | "
            f"{r['seconds']:.2f} | {r.get('x_floor', float('nan')):.2f} | {r.get('x_floor_shared_once', float('nan')):.2f} | "
            f"{r.get('x_hf_generate', float('nan')):.1f} | {r['peak_gib']:.1f} | "
            + (f"{r['shared_graph_captures']} ({r['shared_capture_s']:.1f}) |" if "shared_graph_captures" in r else "- |"))
    table = "\n".join(lines)
    (out_dir / "throughput.md").write_text(
        f"# GPU throughput\n\n{date}, {result['device']}, torch {torch.__version__}; copy "
        f"{hw['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {hw['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s.\n\n"
        f"`{result['command']}`\n\n{table}\n")
    print(table)
    print(f"results in {out_dir}/throughput.*")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
