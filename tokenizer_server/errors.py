"""OpenAI-style error bodies, and the handlers that turn every bad input into one.

Body: {"error": {"message", "type", "param", "code"}}. The message starts with the
field it is about, so a client sees what to fix without reading the docs. Server-side
failures (5xx) carry a fixed, generic message: what went wrong inside goes to the log.
"""

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}
# How pydantic names a union member in an error's location (api_models tags members by the
# JSON value's shape: "str", "list[int]", ...): not part of the field's path.
_SCALAR_TYPE_NAMES = ("str", "int", "float", "bool")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        err_type = _TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def engine_failed() -> APIError:
    """The engine failed this request (the worker logged why); the client learns only that."""
    return APIError(500, "the engine failed while generating this request", code="engine_error")


def internal_error() -> APIError:
    return APIError(500, "internal server error", code="internal_error")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _is_union_label(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _SCALAR_TYPE_NAMES)


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]  # the models' unions are discriminated: one error per bad value
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    if not loc:
        if first.get("type") == "missing":
            return APIError(400, "request body is required (a JSON object)")
        return APIError(400, f"request body: {first.get('msg')} (expected a JSON object)")
    param = ".".join(str(p) for p in loc if not _is_union_label(p))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "field required"
    return APIError(400, f"{param}: {msg}", param=param)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error_to_api_error(exc))


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(exc.status_code, str(exc.detail))
    return JSONResponse(err.body(), status_code=err.status, headers=getattr(exc, "headers", None))


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback after this response is sent; the client sees none of it.
    return error_response(internal_error())


def install_error_handlers(app) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
