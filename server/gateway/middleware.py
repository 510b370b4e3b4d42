"""Pure-ASGI guards that run before FastAPI parses anything: API keys, then the body size limit.

Pure ASGI (not BaseHTTPMiddleware) so the endpoint keeps the server's own `receive` and can still
see the client's `http.disconnect` after the body has been read (generation.until_disconnect).
"""

from __future__ import annotations

import hmac

from server.gateway.errors import APIError

DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")


class GuardMiddleware:
    """401 for a missing/wrong Bearer key on /v1/* and on `protected` paths (when keys are
    configured); 413 for a body over `max_body_bytes` (by Content-Length up front, or counted
    while reading a chunked body)."""

    def __init__(self, app, *, api_keys: list[str], max_body_bytes: int, protected: tuple[str, ...] = ()):
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.protected = protected  # exact paths or prefixes ("/docs" covers "/docs/oauth2-redirect")

    def _needs_key(self, path: str) -> bool:
        return path.startswith("/v1/") or any(path == p or path.startswith(p + "/") for p in self.protected)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        # compare against every key (constant time each) so timing does not reveal which matched
        return any([hmac.compare_digest(token.strip(), key) for key in self.api_keys])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_keys and self._needs_key(scope["path"]) and not self._authorized(headers):
            err = APIError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await err.response()(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)

        too_large = APIError(
            413,
            f"request body exceeds the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > self.max_body_bytes:
                    return await too_large.response()(scope, receive, send)
            except ValueError:
                return await APIError(400, "invalid Content-Length header").response()(scope, receive, send)

        # Buffer the body (bounded by the limit), then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # client gone before sending its body: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await too_large.response()(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
