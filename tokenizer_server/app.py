"""The FastAPI app: routes, bearer auth, body size limit, and the gate that closes at shutdown."""

import hmac
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenizer_server.api_models import ChatCompletionRequest, CompletionRequest
from tokenizer_server.errors import APIError, install_error_handlers
from tokenizer_server.serving_chat import create_chat_completion
from tokenizer_server.serving_common import ServerState
from tokenizer_server.serving_completions import create_completion

MAX_BODY_BYTES = 32 * 1024 * 1024
_json = msgspec.json.Encoder()


class GuardMiddleware:
    """Pure ASGI (streams pass through untouched), in front of every route:
    - 413 on a body over the cap, whether announced by Content-Length or sent chunked (a
      chunked body is read here up to the cap, then handed on whole);
    - 401 on /v1/* (and /metrics with protect_metrics) without a configured bearer key; the
      key that matched goes into the scope, for the tenant's cache salt;
    - 503 on /v1/* once the server is draining for shutdown."""

    def __init__(self, app, state: ServerState, max_body_bytes: int = MAX_BODY_BYTES,
                 protect_metrics: bool = False):
        self.app, self.state = app, state
        self.keys = [k.encode() for k in state.api_keys]
        self.max_body_bytes = max_body_bytes
        self.protect_metrics = protect_metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, self._too_large())
        path = scope["path"]
        if self.keys and (path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")):
            key = self._bearer_key(headers)
            if key is None:
                err = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                return await _send_error(send, err, [(b"www-authenticate", b"Bearer")])
            scope["radixkv.api_key"] = key
        if self.state.draining and path.startswith("/v1/"):
            return await _send_error(send, APIError(503, "the server is shutting down", code="engine_unavailable"))
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._read_capped(receive)
            if receive is None:
                return await _send_error(send, self._too_large())
        await self.app(scope, receive, send)

    def _bearer_key(self, headers) -> bytes | None:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(token, key):
                found = key
        return found

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_body_bytes} bytes", code="request_too_large")

    async def _read_capped(self, receive):
        """Read a body of unannounced length (chunked) up to the cap: a receive() that replays it,
        or None once it grows past the cap."""
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away: let the app see it
                break
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return None
            if not msg.get("more_body", False):
                msg = None
                break
        pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]
        if msg is not None:
            pending.append(msg)

        async def replay():
            return pending.pop(0) if pending else await receive()

        return replay


async def _send_error(send, err: APIError, extra_headers=()) -> None:
    body = _json.encode(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _json_response(obj) -> Response:
    if isinstance(obj, Response):
        return obj
    return Response(_json.encode(obj), media_type="application/json")


def build_app(state: ServerState, *, on_shutdown=None, protect_metrics: bool = False) -> FastAPI:
    """on_shutdown: an async callable run when the app's lifespan ends."""

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(title="radixkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state, protect_metrics=protect_metrics)
    app.state.radixkv = state

    @app.get("/health")
    async def health():
        if state.supervisor.is_running() and not state.draining:
            return _json_response({"status": "ok"})
        why = "the server is shutting down" if state.draining else state.supervisor.client.down_reason
        err = APIError(503, why, code="engine_unavailable")
        return Response(_json.encode(err.body()), status_code=503, media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        info = state.supervisor.client.ready
        data = [
            {"id": name, "object": "model", "created": state.created, "owned_by": "radixkv",
             "max_model_len": info.max_model_len if info else None}
            for name in state.served_model_names
        ]
        return _json_response({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return _json_response(await create_completion(state, body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return _json_response(await create_chat_completion(state, body, request))

    return app
