"""The server's run: the front process (uvicorn + FastAPI) and its engine worker.

`radixkv serve` (radixkv/cli/serve.py) parses the options and calls run().

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


def run(model_dir: str, engine_args: dict, *, host: str, port: int, api_keys: list[str],
        served_model_names: list[str], restart_worker: bool, worker_timeout: float, shutdown_timeout: float,
        salt_secret: str | None, cache_salt_scope: str, protect_metrics: bool, torch_threads: int | None,
        worker_ready_timeout: float, log_level: str, access_log: bool, stream_interval: int = 1,
        worker_cmd: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; the exit code (see the module's docstring). stream_interval: a
    stream's chunk carries the text of up to that many tokens of a choice (its last chunk goes out
    at once). worker_cmd: the worker's command line before its config JSON (default: the engine's
    worker; the front's benchmark gives a stand-in)."""
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
        source = tokenizer_source(model_dir)
    except ValueError as e:
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 2
    if source is None:
        print(f"radixkv serve: {model_dir!r} has no tokenizer files", file=sys.stderr)
        return 2
    if torch_threads is not None and torch_threads < 1:
        print(f"radixkv serve: --torch-threads must be >= 1, got {torch_threads}", file=sys.stderr)
        return 2
    if not worker_timeout > 2 * HEARTBEAT_INTERVAL_S:
        print(f"radixkv serve: --worker-timeout must exceed {2 * HEARTBEAT_INTERVAL_S:g} s (two heartbeats), "
              f"got {worker_timeout}", file=sys.stderr)
        return 2
    if stream_interval < 1:
        print(f"radixkv serve: --stream-interval must be >= 1, got {stream_interval}", file=sys.stderr)
        return 2
    if not shutdown_timeout >= 0:
        print(f"radixkv serve: --shutdown-timeout must be >= 0, got {shutdown_timeout}", file=sys.stderr)
        return 2
    secret = salt_secret or os.environ.get("RADIXKV_SALT_SECRET")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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

    supervisor = WorkerSupervisor(engine_args, restart=restart_worker, on_fatal=on_fatal,
                                  ready_timeout=worker_ready_timeout, torch_threads=torch_threads,
                                  worker_timeout=worker_timeout, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                                  worker_cmd=worker_cmd)
    state = ServerState(tokenizer=tokenizer, supervisor=supervisor, metrics=None,
                        served_model_names=served_model_names or [str(model_dir)], api_keys=api_keys,
                        salts=TenantSalts(secret.encode() if secret else None, scope=cache_salt_scope),
                        stream_interval=stream_interval)
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
            deadline = loop.time() + shutdown_timeout
            client = supervisor.client
            if client.num_in_flight:
                log.info("draining %d in-flight request(s), up to %.1f s", client.num_in_flight, shutdown_timeout)
            while client.num_in_flight and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if client.num_in_flight:
                log.warning("ending %d request(s) still running at shutdown", client.num_in_flight)
                client.fail_in_flight("the server is shutting down")
            await super().shutdown(sockets)

    app = build_app(state, on_shutdown=shutdown, protect_metrics=protect_metrics)
    # Leave what start-up loaded out of every later garbage collection: with transformers (and
    # torch through it) imported, the front tracks ~320k objects and a full collection held the
    # event loop ~200 ms, every few seconds under 20 streams; frozen, none took 50 ms.
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=access_log, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="on")
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
