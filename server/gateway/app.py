"""The FastAPI application: routes, lifespan (engine start, graceful drain), and the request flow.

Request flow (chat and text completions share it):
    guards (API key, body size) -> pydantic validation (errors -> 400) -> prepare (model, dial,
    prompt length) -> admission (slot, or 429 + Retry-After) -> MultiStream over the engine ->
    JSON response, or SSE stream; a client disconnect at any point cancels generation and returns
    the slot. Logs carry ids, sizes and timings, never prompt or completion text (unless
    `log_content`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.engine.protocol import Engine, EngineError
from server.gateway import errors, playground
from server.gateway.admission import Admission, Overloaded
from server.gateway.errors import APIError, from_engine_error
from server.gateway.generation import (
    ClientDisconnected,
    MultiStream,
    Tracker,
    enable_trace,
    until_disconnect,
)
from server.gateway.metrics import GatewayMetrics
from server.gateway.middleware import GuardMiddleware
from server.gateway.prepare import Prepared, prepare
from server.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from server.gateway.settings import GatewaySettings
from server.gateway.streaming import ChunkFormatter, ClosingEventSourceResponse, sse_events
from verifier.dial import model_names

log = logging.getLogger("dialspec.gateway")

# 499: nginx's "client closed request"; nobody reads it, but access logs show what happened.
CLIENT_CLOSED = 499

_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}


class Gateway:
    """Everything one app instance owns: the engine, settings, metrics, admission control."""

    def __init__(self, engine: Engine, settings: GatewaySettings):
        self.engine = engine
        self.settings = settings
        self.metrics = GatewayMetrics()
        max_running = settings.max_running or engine.info.max_batch
        self.admission = Admission(max_running, settings.max_waiting)
        self.metrics.bind_load(self.admission)
        self.ready = False
        self.draining = False
        self.created = int(time.time())

    async def handle(self, kind: str, body, request: Request) -> Response:
        start = time.monotonic()
        if not self.ready or self.draining:
            self.metrics.errors.labels(status="503").inc()
            raise APIError(
                503,
                "the engine is not ready (starting or shutting down); retry shortly",
                code="engine_not_ready",
                headers={"Retry-After": "1"},
            )
        try:
            prep = prepare(kind, body, self.engine, self.settings)
            if body.dialspec_trace:
                prep.requests = enable_trace(prep.requests, self.engine.info)
        except APIError as exc:
            self.metrics.errors.labels(status=str(exc.status)).inc()
            raise
        slots = len(prep.requests)
        if slots > self.admission.max_running:
            raise APIError(
                400,
                f"n x prompts = {slots} exceeds the server's {self.admission.max_running} "
                "concurrent sequences",
                param="n",
            )
        try:
            await until_disconnect(request, self.admission.acquire(slots))
        except Overloaded:
            self.metrics.errors.labels(status="429").inc()
            retry = str(self.settings.retry_after_s)
            raise APIError(
                429,
                f"the server is at capacity ({self.admission.max_running} running, "
                f"{self.admission.max_waiting} waiting); retry after {retry} s",
                code="server_overloaded",
                headers={"Retry-After": retry},
            ) from None
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

        tracker = Tracker(self.metrics, prep.dial, slots, prep.prompt_tokens, arrival=start)
        run = MultiStream(self.engine, prep.requests).start()
        closed = False

        async def cleanup():
            nonlocal closed
            if closed:
                return
            closed = True
            await run.aclose()  # cancels unfinished streams: the engine frees their rows
            tracker.close()
            self.admission.release(slots)
            self._log(prep, tracker, start)

        handed_off = False  # once the streaming response owns cleanup, it runs when the stream ends
        try:
            if prep.stream:
                first = await until_disconnect(request, run.next_event())
                fmt = ChunkFormatter(kind, prep.request_id, prep.created, prep.model, prep.include_usage)
                response = ClosingEventSourceResponse(
                    sse_events(run, tracker, fmt, first),
                    on_close=cleanup,
                    ping=15,
                    shutdown_grace_period=self.settings.drain_timeout_s,
                    headers={"X-Request-Id": prep.request_id},
                )
                handed_off = True
                return response
            await until_disconnect(request, self._collect(run, tracker))
            return JSONResponse(self._body(prep, tracker), headers={"X-Request-Id": prep.request_id})
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except EngineError as exc:
            tracker.failed = True
            err = from_engine_error(exc)
            self.metrics.errors.labels(status=str(err.status)).inc()
            raise err from None
        finally:
            if not handed_off:
                await cleanup()

    @staticmethod
    async def _collect(run: MultiStream, tracker: Tracker) -> None:
        async for index, chunk in run.events():
            tracker.on_chunk(index, chunk)

    @staticmethod
    def _body(prep: Prepared, tracker: Tracker) -> dict:
        if prep.kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": tracker.text(i)},
                    "logprobs": None,
                    "finish_reason": tracker.finish[i],
                }
                for i in range(tracker.num_choices)
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": tracker.text(i), "logprobs": None, "finish_reason": tracker.finish[i]}
                for i in range(tracker.num_choices)
            ]
            obj = "text_completion"
        for choice, trace in zip(choices, tracker.traces, strict=True):
            if trace is not None:
                choice["dialspec_trace"] = trace
        return {
            "id": prep.request_id,
            "object": obj,
            "created": prep.created,
            "model": prep.model,
            "choices": choices,
            "usage": tracker.usage(),
            "dialspec": tracker.dialspec(),
        }

    def _log(self, prep: Prepared, tracker: Tracker, start: float) -> None:
        usage = tracker.usage()
        log.info(
            "%s %s tier=%s choices=%d prompt_tokens=%d completion_tokens=%d finish=%s %.3fs",
            prep.request_id,
            prep.kind,
            prep.dial.label,
            tracker.num_choices,
            usage["prompt_tokens"],
            usage["completion_tokens"],
            ",".join(str(f) for f in tracker.finish),
            time.monotonic() - start,
        )
        if self.settings.log_content:
            for i in range(tracker.num_choices):
                log.info("%s choice %d text=%r", prep.request_id, i, tracker.text(i))

    async def drain(self) -> None:
        """Stop admitting, then wait (up to drain_timeout_s) for in-flight requests to finish."""
        self.draining = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while not self.admission.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def create_app(
    engine: Engine, settings: GatewaySettings | None = None, on_ready: Callable[[], None] | None = None
) -> FastAPI:
    """Build the app around an engine (not started yet: the lifespan starts and stops it)."""
    settings = settings or GatewaySettings()
    gw = Gateway(engine, settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        gw.ready = True
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            gw.ready = False
            await gw.drain()
            await engine.stop()

    app = FastAPI(
        title="dialspec",
        summary="OpenAI-compatible speculative decoding with a quality dial (DIVERSED ensemble verification)",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.gateway = gw
    errors.install(app)
    app.add_middleware(GuardMiddleware, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Chat completion; `stream: true` answers with server-sent `chat.completion.chunk`s."""
        return await gw.handle("chat", body, request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        """Text completion; `stream: true` answers with server-sent `text_completion` chunks."""
        return await gw.handle("completion", body, request)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        """The pair (default quality) and `<pair>:<tier>` for every tier."""
        names = model_names(engine.info.model, settings.dial_config(), engine.info.has_head)
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": gw.created, "owned_by": "dialspec"} for n in names
            ],
        }

    playground.install(app, engine, settings)

    @app.get("/health")
    async def health():
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready():
        """Readiness: the engine is loaded and the server is not draining."""
        if not gw.ready or gw.draining:
            raise APIError(503, "engine not ready", code="engine_not_ready")
        info = engine.info
        return {
            "status": "ready",
            "model": info.model,
            "backend": info.backend,
            "max_context": info.max_context,
            "num_draft": info.num_draft,
            "has_head": info.has_head,
            "load": engine.load(),
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """Prometheus text exposition (see server/gateway/metrics.py for names and PromQL)."""
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
