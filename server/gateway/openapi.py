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

from server.gateway.responses import ChatCompletionChunk, CompletionChunk, ErrorResponse

_REF = "#/components/schemas/{model}"


def sse_doc(chunk: type) -> dict:
    """`text/event-stream`: the schema of one event (OpenAPI 3.1 reads `schema` per event)."""
    payload = {
        "anyOf": [{"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model="ErrorResponse")}]
    }
    data = {
        "description": "a chunk; an error object if generation fails or the server shuts down "
        "mid-stream; then the literal [DONE]",
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ],
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
            "data": data,
        },
    }
    return {"schema": event}


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


def generation_responses(chunk: type) -> dict:
    out = error_responses(400, 404, 413, 429, 500, 503)
    out[200] = {
        "content": {"text/event-stream": sse_doc(chunk)},
        "description": "the completion, or its events",
    }
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
        for model in (ChatCompletionChunk, CompletionChunk):  # referenced by the SSE documents only
            chunk = model.model_json_schema(ref_template=_REF)
            schemas.update(chunk.pop("$defs", {}))
            schemas[model.__name__] = chunk
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
