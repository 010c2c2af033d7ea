"""`radixkv serve MODEL`: the front process (uvicorn + FastAPI) and its engine worker.

MODEL: an HF folder, a .gguf file, or a folder holding one .gguf (radixkv/models/source.py).

Start-up order: load the tokenizer, start the worker and wait for its hello (model
loaded, KV pool allocated), bind the port, print where it listens and the pool size.
Exit codes: 0 after SIGINT/SIGTERM, 1 when the worker died (without
--restart-worker) or could not start, 2 for a bad MODEL.

Shutdown (SIGINT/SIGTERM) drains: the listening socket closes and new requests on open
connections get 503, in-flight requests have --shutdown-timeout seconds to finish, and
whatever is still running then ends with a 503 body, or an error event and `data: [DONE]`
on a stream that has started; only then does the worker stop. A second SIGINT forces exit.
"""

import sys

HEARTBEAT_INTERVAL_S = 1.0
# After the drain has ended every request, what uvicorn still gives responses to be written.
SHUTDOWN_GRACE_S = 5
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
    return out


def main(args) -> int:
    import asyncio
    import gc
    import logging
    import os
    import signal

    import uvicorn

    from radixkv.models.source import tokenizer_source
    from tokenizer_server.app import build_app
    from tokenizer_server.launcher import WorkerSupervisor
    from tokenizer_server.metrics import ServerMetrics
    from tokenizer_server.serving_common import ServerState
    from tokenizer_server.tenants import TenantSalts

    try:
        source = tokenizer_source(args.model_dir)
    except ValueError as e:
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 2
    if source is None:
        print(f"radixkv serve: {args.model_dir!r} has no tokenizer files", file=sys.stderr)
        return 2
    if args.torch_threads is not None and args.torch_threads < 1:
        print(f"radixkv serve: --torch-threads must be >= 1, got {args.torch_threads}", file=sys.stderr)
        return 2
    if not args.worker_timeout > 2 * HEARTBEAT_INTERVAL_S:
        print(f"radixkv serve: --worker-timeout must exceed {2 * HEARTBEAT_INTERVAL_S:g} s (two heartbeats), "
              f"got {args.worker_timeout}", file=sys.stderr)
        return 2
    if not args.shutdown_timeout >= 0:
        print(f"radixkv serve: --shutdown-timeout must be >= 0, got {args.shutdown_timeout}", file=sys.stderr)
        return 2
    secret = args.salt_secret or os.environ.get("RADIXKV_SALT_SECRET")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("radixkv.server")
    try:
        tokenizer = source.load()
    except ValueError as e:
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 2
    exit_code = 0

    def on_fatal(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        server.should_exit = True

    supervisor = WorkerSupervisor(engine_args_from(args), restart=args.restart_worker, on_fatal=on_fatal,
                                  ready_timeout=args.worker_ready_timeout, torch_threads=args.torch_threads,
                                  worker_timeout=args.worker_timeout, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)
    state = ServerState(tokenizer=tokenizer, supervisor=supervisor, metrics=None,
                        served_model_names=args.served_model_name or [str(args.model_dir)], api_keys=args.api_key,
                        salts=TenantSalts(secret.encode() if secret else None, scope=args.cache_salt_scope))
    state.metrics = ServerMetrics(lambda: supervisor.client.stats, supervisor.is_running)

    async def shutdown() -> None:  # the lifespan's end: stop the worker while the loop still runs
        supervisor.stop()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                info = supervisor.client.ready
                print(
                    f"radixkv: serving {', '.join(state.served_model_names)} at http://{host}:{port}/v1 "
                    f"(front pid {os.getpid()}, engine worker pid {supervisor.proc.pid}); KV pool: "
                    f"{info.num_blocks} blocks x {info.block_size} tokens = {info.num_blocks * info.block_size} "
                    f"tokens; max model length {info.max_model_len}",
                    flush=True,
                )

        async def shutdown(self, sockets=None):
            # Drain before uvicorn's own shutdown, which would cut what still runs after its
            # timeout (a plain 500, or a stream without [DONE]).
            state.draining = True
            for srv in self.servers:
                srv.close()  # no new connections
            loop = asyncio.get_running_loop()
            deadline = loop.time() + args.shutdown_timeout
            client = supervisor.client
            if client.num_in_flight:
                log.info("draining %d in-flight request(s), up to %.1f s", client.num_in_flight, args.shutdown_timeout)
            while client.num_in_flight and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if client.num_in_flight:
                log.warning("ending %d request(s) still running at shutdown", client.num_in_flight)
                client.fail_in_flight("the server is shutting down")
            await super().shutdown(sockets)

    app = build_app(state, on_shutdown=shutdown, protect_metrics=args.protect_metrics)
    # Leave what start-up loaded out of every later garbage collection: with transformers (and
    # torch through it) imported, the front tracks ~320k objects and a full collection held the
    # event loop ~200 ms, every few seconds under 20 streams; frozen, none took 50 ms.
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="on")
    server = Server(config)

    async def serve() -> int:
        # Loading the model can take minutes: a signal meanwhile stops the start-up.
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        start, stopped = asyncio.ensure_future(supervisor.start()), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
                # uvicorn re-raises the signal that stopped it once it is done; with a
                # no-op handler in place, that re-raise is harmless and main() returns.
                signal.signal(sig, lambda *_: None)
        if not start.done():
            start.cancel()
            print("radixkv serve: stopped during start-up", file=sys.stderr)
            return 0
        if start.exception() is not None:
            print(f"radixkv serve: {start.exception()}", file=sys.stderr)
            return 1
        await server.serve()
        return exit_code if server.started else 1

    try:
        return asyncio.run(serve())
    finally:
        supervisor.stop()
