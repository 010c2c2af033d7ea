"""OpenAI-style error bodies, and the handlers that turn every bad input into one.

Body: {"error": {"message", "type", "param", "code"}}. The message starts with the
field it is about, so a client sees what to fix without reading the docs.
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


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        err_type = _TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    # A union reports one error per member; the deepest names the field most precisely.
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2]]
    first = max(same_field, key=lambda e: len(e.get("loc", ())))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    if not loc:
        if first.get("type") == "missing":
            return APIError(400, "request body is required (a JSON object)")
        return APIError(400, f"request body: {first.get('msg')} (expected a JSON object)")
    # A union member's name (e.g. "list[int]") is not part of the field's path.
    path = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    param = ".".join(path)
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


def install_error_handlers(app) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
