"""The OpenAPI document: what the server really accepts and answers.

- Request limits come from the engine and settings (`schemas.request_models`): the document's
  maxima are the validators' (n, num_draft, max_tokens, token ids, served model names, tiers).
- Validation errors are answered 400 with the error object (errors.py), so FastAPI's default 422
  response and its HTTPValidationError schema are removed.
- Generation endpoints answer `application/json`, or `text/event-stream` when `stream` is true.
- Every error status an endpoint can return is listed with the `ErrorResponse` schema.
- Authentication: with API keys configured, /v1/* (and /metrics, the docs, when the settings say
  so) need `Authorization: Bearer <key>`: a bearer security scheme on those operations, and 401.
  /health and /ready are always open (orchestrator probes carry no keys).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.gateway.schemas import ErrorResponse

SSE_DOC = {
    "description": "`data: {chunk}` events (chat.completion.chunk / text_completion), an error event "
    '`data: {"error": {...}}` if generation fails or the server shuts down mid-stream, then '
    "`data: [DONE]`",
    "schema": {"type": "string"},
}


def error_responses(*statuses: int) -> dict:
    meaning = {
        400: "invalid request (the error's `param` names the field)",
        401: "missing or invalid API key",
        404: "unknown model or path",
        413: "request body too large",
        429: "at capacity: retry after `Retry-After` seconds",
        500: "the engine failed on this request (other requests are unaffected)",
        503: "starting, shutting down, or the engine cannot generate (see /ready)",
    }
    return {s: {"model": ErrorResponse, "description": meaning[s]} for s in statuses}


def generation_responses() -> dict:
    out = error_responses(400, 404, 413, 429, 500, 503)
    out[200] = {"content": {"text/event-stream": SSE_DOC}, "description": "the completion (or its stream)"}
    return out


def install(app: FastAPI, *, auth: bool, protected: tuple[str, ...]) -> None:
    """Replace `app.openapi` with the cleaned-up document described above."""

    def needs_key(path: str) -> bool:
        return path.startswith("/v1/") or any(path == p or path.startswith(p + "/") for p in protected)

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, summary=app.summary, description=app.description,
            routes=app.routes,
        )  # fmt: skip
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if auth:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc["paths"].items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                if auth and needs_key(path):
                    op["security"] = [{"bearer": []}]
                    responses["401"] = {
                        "description": "missing or invalid API key",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                        },
                    }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
