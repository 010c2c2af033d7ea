"""`radixkv serve MODEL`: the OpenAI-compatible server (front + engine worker).

The options are parsed here; the run itself (worker, drain on shutdown) is
tokenizer_server/serve.py, imported in main so that `radixkv --help` stays fast.
"""

# Engine options passed to the worker only when given, so the engine's defaults apply.
ENGINE_OPTIONS = {
    "device": str, "dtype": str, "block_size": int, "num_blocks": int, "max_num_seqs": int,
    "max_num_batched_tokens": int, "max_model_len": int, "max_prefill_chunk": int,
    "gpu_memory_utilization": float, "cpu_kv_cache_gib": float, "seed": int, "load_format": str,
    "scheduling_policy": str, "hash_algo": str,
}


def add_arguments(p) -> None:
    p.add_argument("model_dir", metavar="MODEL",
                   help="HF model folder (config.json, *.safetensors, tokenizer files), a .gguf file, "
                        "or a folder holding one .gguf")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable: one key per tenant; each key "
                        "gets its own default cache salt)")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="model name(s) clients use (repeatable; default: MODEL_DIR as given)")
    for name, typ in ENGINE_OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=f"engine option {name}")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="run each engine step to the end before scheduling the next (default on CUDA: the next "
                        "step is launched while the last one's tokens are processed)")
    p.add_argument("--restart-worker", action="store_true",
                   help="restart a dead or frozen engine worker instead of exiting, retrying with exponential "
                        "backoff (0.5 s doubling to 30 s) until one is ready; in-flight requests fail with 503")
    p.add_argument("--worker-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a ready worker that sends nothing (it sends a heartbeat every second) for this long is "
                        "killed and handled as dead: its clients get 503 (default 60)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long in-flight requests may run before they are ended (default 5)")
    p.add_argument("--salt-secret", default=None, metavar="SECRET",
                   help="secret for tenant cache salts (default: $RADIXKV_SALT_SECRET, else random per start); "
                        "give the same one to replicas that share a router")
    p.add_argument("--cache-salt-scope", choices=["key", "global"], default="key",
                   help="key: a request's cache_salt is private to its API key (default); global: the same "
                        "cache_salt shares cache across API keys")
    p.add_argument("--protect-metrics", action="store_true", help="require an API key on /metrics too")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of the engine worker (default: all cores but one, left to the front)")
    p.add_argument("--worker-ready-timeout", type=float, default=600.0, help="seconds to wait for the worker to load")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="a streamed chunk carries the text of up to N tokens of a choice: fewer, larger chunks "
                        "for less front CPU per token; a choice's last chunk and its finish_reason go out at "
                        "once (default 1: a chunk per token)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def engine_args_from(args) -> dict:
    out = {"model_dir": str(args.model_dir)}
    for name in ENGINE_OPTIONS:
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    if args.no_prefix_caching:
        out["enable_prefix_caching"] = False
    if args.enforce_eager:
        out["enforce_eager"] = True
    if args.no_async_scheduling:
        out["async_scheduling"] = False
    return out


def main(args) -> int:
    from tokenizer_server.serve import run

    return run(args.model_dir, engine_args_from(args), host=args.host, port=args.port, api_keys=args.api_key,
               served_model_names=args.served_model_name, restart_worker=args.restart_worker,
               worker_timeout=args.worker_timeout, shutdown_timeout=args.shutdown_timeout,
               salt_secret=args.salt_secret, cache_salt_scope=args.cache_salt_scope,
               protect_metrics=args.protect_metrics, torch_threads=args.torch_threads,
               worker_ready_timeout=args.worker_ready_timeout, log_level=args.log_level, access_log=args.access_log,
               stream_interval=args.stream_interval)
