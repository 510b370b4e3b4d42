"""OpenAI-style error objects and the exception handlers that produce them.

Every error leaves the gateway as `{"error": {"message", "type", "param", "code"}}` with the HTTP
status the `openai` client maps to its exception classes (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413, 429 RateLimitError, 503 InternalServerError).
Pydantic's 422 becomes 400 with `param` naming the offending field, as OpenAI does.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine.protocol import EngineError

log = logging.getLogger("dialspec.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # OpenAI uses this type with code model_not_found
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to return to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - mirrors the OpenAI field name
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: EngineError) -> APIError:
    """EngineError.kind -> HTTP status: invalid_request 400, capacity 429, unavailable 503."""
    if exc.kind == "invalid_request":
        return APIError(400, str(exc), code="invalid_request")
    if exc.kind == "capacity":
        return APIError(429, str(exc), code="engine_capacity", headers={"Retry-After": "1"})
    return APIError(503, str(exc), code="engine_unavailable")


def _loc_to_param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Pydantic appends the union member tried ("str", "list[str]", ...) to the location; drop it.
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float")]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    param = _loc_to_param(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if "UNSUPPORTED:" in msg:  # raised by schemas._Common._unsupported
        name = msg.split("UNSUPPORTED:", 1)[1].strip()
        return f"'{name}' is not supported by this server; remove it from the request", name
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if first.get("type") == "missing" and param:
        return f"'{param}' is a required property", param
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s))"
    return (f"{param}: {msg}" if param else msg), param


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        code = "unsupported_parameter" if "not supported" in message else "invalid_value"
        return APIError(400, message, param=param, code=code).response()

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError):
        return from_engine_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            detail = "no such endpoint (see /docs for the API)"
        return APIError(exc.status_code, detail, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        # Logged with the type only: the message may quote a prompt.
        log.exception("unhandled error %s", type(exc).__name__)
        return APIError(500, "internal server error", code="internal_error").response()
