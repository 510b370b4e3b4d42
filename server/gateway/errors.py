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
    """EngineError.kind -> HTTP status: invalid_request 400, capacity 429, unavailable 503,
    internal 500 (the engine faulted on this request alone and goes on serving)."""
    if exc.kind == "invalid_request":
        return APIError(400, str(exc), code="invalid_request")
    if exc.kind == "capacity":
        return APIError(429, str(exc), code="engine_capacity", headers={"Retry-After": "1"})
    if exc.kind == "internal":
        return APIError(500, str(exc), code="engine_fault")
    return APIError(503, str(exc), code="engine_unavailable")


def _is_union_tag(part: str) -> bool:
    # Pydantic appends the union member tried ("str", "constrained-int", "list[str]", ...).
    return any(c in part for c in "[]-") or part in ("str", "int", "float", "bool")


def _loc_to_param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(p for p in parts if not _is_union_tag(p)) or None


def _best(errors: list[dict]) -> dict:
    """The error to report. A value that fails a union gets one error per member tried; report
    the member the client meant: one whose shape matched (only constraint errors, e.g. [1, -2] is
    a token list with a negative id, not a malformed string), else the one that got deepest."""
    groups: dict[tuple, list[dict]] = {}
    for e in errors:
        loc = [str(p) for p in e.get("loc", ())]
        tag = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
        groups.setdefault(tuple(loc[: tag + 1]) if tag is not None else (), []).append(e)

    def depth(e: dict) -> int:
        return sum(not _is_union_tag(str(p)) for p in e.get("loc", ()))

    def rank(group: list[dict]):
        shape_ok = not any(str(e.get("type", "")).endswith("_type") for e in group)
        return (shape_ok, max(map(depth, group)), -len(group))

    best = max(groups.values(), key=rank)
    return max(best, key=depth)


_COMPLETION_LENGTH = ("max_tokens", "max_completion_tokens")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) for the most relevant problem of a failed validation."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_value"
    first = _best(errors)
    param = _loc_to_param(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if "UNSUPPORTED:" in msg:  # raised by schemas._Common._unsupported
        name = msg.split("UNSUPPORTED:", 1)[1].strip()
        return (
            f"'{name}' is not supported by this server; remove it from the request",
            name,
            "unsupported_parameter",
        )
    if first.get("type") == "lone_surrogate":  # schemas._Common._valid_unicode: the path is in ctx
        return msg, first["ctx"]["param"], "invalid_unicode"
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None, "invalid_value"
    if first.get("type") == "missing" and param:
        return f"'{param}' is a required property", param, "invalid_value"
    if param in _COMPLETION_LENGTH and first.get("type") == "less_than_equal":
        # the limit is the context window less one prompt token (schemas.Limits.max_tokens)
        return (
            f"{param}: {msg}, the model's context window less one prompt token",
            param,
            "context_length_exceeded",
        )
    fields = {_loc_to_param(e.get("loc", ())[:2]) for e in errors} - {_loc_to_param(first.get("loc", ())[:2])}
    if fields:
        msg += f" (and problems with {', '.join(sorted(str(f) for f in fields))})"
    return (f"{param}: {msg}" if param else msg), param, "invalid_value"


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
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
