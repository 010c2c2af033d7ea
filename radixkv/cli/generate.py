"""`radixkv generate MODEL --prompt ...`: offline generation from the command line.

Top-level imports stay light (no torch) so that `radixkv --help` is fast.
"""

from __future__ import annotations

import json
import sys


def add_arguments(p) -> None:
    p.add_argument("model_dir", metavar="MODEL",
                   help="HF model folder (config.json, *.safetensors, tokenizer files), a .gguf file, "
                        "or a folder holding one .gguf")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model's chat template")
    from radixkv.sampling_params import add_cli_arguments  # one flag per SamplingParams field

    add_cli_arguments(p.add_argument_group("sampling"), p.add_argument_group("beam search"),
                      defaults={"max_tokens": 64, "temperature": 0.0},
                      helps={"temperature": "0 = greedy (default)", "n": "samples per prompt",
                             "best_of": "samples drawn; the --n most likely are printed",
                             "beam_width": "beam search with this many beams (--n best printed)"})
    e = p.add_argument_group("engine")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    e.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    e.add_argument("--load-format", default="safetensors", choices=("safetensors", "dummy"))
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: sized from memory)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "lpm"))
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--no-async-scheduling", action="store_true", help="no overlapped engine loop (default on CUDA)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of plain text")


def main(args) -> int:
    import logging

    from radixkv.engine.llm import LLM
    from radixkv.engine.outputs import SharingStats
    from radixkv.sampling_params import from_cli_args

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params = from_cli_args(args)
    try:
        params.validate()
        llm = LLM(args.model_dir, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  block_size=args.block_size, num_blocks=args.num_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.scheduling_policy,
                  enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None)
        prompts = _chat_prompts(llm.tokenizer, args.prompt) if args.chat else args.prompt
        outputs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text, out in zip(args.prompt, outputs):
        sh = out.sharing or SharingStats()  # none: the prompt could not even be added
        if args.json:
            print(json.dumps({
                "prompt": text, "prompt_token_ids": out.prompt_token_ids,
                "num_cached_tokens": out.num_cached_tokens,
                "num_computed_prompt_tokens": sh.num_computed_prompt_tokens,
                "blocks_held": sh.blocks_held, "blocks_without_sharing": sh.blocks_without_sharing,
                "block_steps_held": sh.block_steps_held,
                "block_steps_without_sharing": sh.block_steps_without_sharing,
                "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason, "cumulative_logprob": c.cumulative_logprob}
                            for c in out.outputs],
            }))
            continue
        for c in out.outputs:
            tag = f" [{c.index}]" if len(out.outputs) > 1 else ""
            print(f"--- prompt{tag}: {text!r} ({len(out.prompt_token_ids)} tokens, "
                  f"{out.num_cached_tokens} cached)")
            print(f"{c.text}\n--- finish: {c.finish_reason}, {len(c.token_ids)} tokens, "
                  f"cumulative logprob {c.cumulative_logprob:.3f}")
        if len(out.outputs) > 1 or sh.blocks_held < sh.blocks_without_sharing:
            print(f"--- KV blocks at peak: {sh.blocks_held} held, {sh.blocks_without_sharing} without sharing")
    m = llm.engine.metrics()
    print(f"steps {m.steps}, preemptions {m.preemptions}, cached prompt tokens {m.cached_prompt_tokens}",
          file=sys.stderr)
    return 0


def _chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of a one-message chat per text; the template writes the special tokens itself."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the model has no chat template")
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]
