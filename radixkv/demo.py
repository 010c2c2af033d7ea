"""`radixkv demo`: the whole product in one run, on a tiny model.

Builds the tiny model folder if it is missing, starts `radixkv serve` on it (front +
engine worker), sends chats that share one system prompt through the official
`openai` client, prints the answers with their cached-token counts, the prefix-cache
figures and the block accounting from /metrics, then stops the server with SIGTERM.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SYSTEM_PROMPT = (
    "You are the support assistant of a small bakery. The bakery opens at seven in the morning and "
    "closes at six in the evening, every day but Monday. It sells sourdough, rye and spelt loaves, "
    "croissants, cinnamon rolls and seasonal fruit tarts. Orders for cakes need two days' notice. "
    "Answer in one or two friendly sentences, name prices in euros, and never promise a delivery "
    "the bakery cannot make: it delivers only within the town, on weekdays, before noon."
)
QUESTIONS = [
    "When do you open on Saturday?",
    "Can I order a birthday cake for tomorrow?",
    "Do you deliver to the next village?",
    "What bread do you recommend for sandwiches?",
]
METRIC_PREFIXES = ("radixkv_prefix_cache", "radixkv_kv_", "radixkv_num_", "radixkv_blocks")


def add_arguments(p) -> None:
    p.add_argument("--model-dir", default="models/tiny-llama", help="model folder (built if missing)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument("--max-tokens", type=int, default=24)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, url: str, timeout: float = 180.0) -> None:
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


def main(args) -> int:
    import httpx
    from openai import OpenAI

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        from radixkv.models.tiny import build_tiny_model

        build_tiny_model(model_dir, arch="llama", seed=0)
        print(f"built the tiny model in {model_dir}")
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", str(model_dir), "--port", str(port), "--host", "127.0.0.1"]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_healthy(proc, url)
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        print(f"\n{len(QUESTIONS)} chats share a system prompt (random weights: the answers are noise)\n")
        for q in QUESTIONS:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
                max_tokens=args.max_tokens,
                temperature=0,
            )
            details = r.usage.prompt_tokens_details
            cached = details.cached_tokens if details else 0
            print(f"Q: {q}\nA: {r.choices[0].message.content!r}")
            print(f"   prompt {r.usage.prompt_tokens} tokens, {cached} from the prefix cache\n")
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
