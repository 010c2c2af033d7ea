"""The FastAPI app: routes, bearer auth with per-key cache salts, body size limit."""

import hashlib
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


def key_salt(api_key: str) -> str:
    """A tenant's default cache salt: derived from its key, so no other tenant can name it
    without the key, and stable across restarts."""
    return "key-" + hashlib.sha256(b"radixkv cache salt\0" + api_key.encode()).hexdigest()[:32]


class GuardMiddleware:
    """Pure ASGI (streams pass through untouched): 413 on an oversized body, 401 on /v1/*
    without a configured bearer key; a good key's salt goes into the scope."""

    def __init__(self, app, api_keys: list[str], max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.keys = [(k.encode(), key_salt(k)) for k in api_keys]
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            err = APIError(413, f"request body larger than {self.max_body_bytes} bytes", code="request_too_large")
            return await _send_error(send, err)
        if self.keys and scope["path"].startswith("/v1/"):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            salt = None
            if scheme.lower() == b"bearer":
                for key, key_salt_ in self.keys:
                    if hmac.compare_digest(token.strip(), key):
                        salt = key_salt_
            if salt is None:
                err = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                return await _send_error(send, err, [(b"www-authenticate", b"Bearer")])
            scope["radixkv.key_salt"] = salt
        await self.app(scope, receive, send)


async def _send_error(send, err: APIError, extra_headers=()) -> None:
    body = _json.encode(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _json_response(obj) -> Response:
    if isinstance(obj, Response):
        return obj
    return Response(_json.encode(obj), media_type="application/json")


def build_app(state: ServerState, *, on_shutdown=None) -> FastAPI:
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
    app.add_middleware(GuardMiddleware, api_keys=state.api_keys)
    app.state.radixkv = state

    @app.get("/health")
    async def health():
        if state.supervisor.is_running():
            return _json_response({"status": "ok"})
        err = APIError(503, "the engine worker is not running", code="engine_unavailable")
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
