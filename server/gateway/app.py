"""The FastAPI application: routes, lifespan (engine start, engine watch, drain, engine stop).

The request flow, readiness and shutdown live in `service.py` (the Gateway); the OpenAPI document
in `openapi.py`. Endpoints open without an API key: /health and /ready always (probes), /metrics
unless `metrics_need_key`, /docs, /redoc and /openapi.json unless `docs_need_key`; /v1/* needs a
key whenever keys are configured.

Each handler finds its app's Gateway in `app.state.gateway` (and the published limits in
`app.state.limits`), so the routes are defined once, at module level; only the two generation
routes are built per app, because their body models carry the engine's limits.
"""

# No `from __future__ import annotations`: the request models are built per app (their limits
# come from the engine), and FastAPI resolves string annotations in module globals only.

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.engine.protocol import Engine
from server.gateway import errors, openapi, playground
from server.gateway.errors import APIError
from server.gateway.middleware import DOCS_PATHS, GuardMiddleware
from server.gateway.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    EngineRuntime,
    ModelCard,
    ModelList,
    ReadyResponse,
)
from server.gateway.schemas import Limits, request_models
from server.gateway.service import Gateway
from server.gateway.settings import GatewaySettings
from server.gateway.slow_clients import BodyDeadlineMiddleware
from verifier.dial import AUTO, model_names


def limits_for(gw: Gateway) -> Limits:
    info, config = gw.engine.info, gw.settings.dial_config()
    return Limits(
        max_n=gw.max_choices,
        max_num_draft=info.num_draft_limit,
        max_tokens=info.max_context - 1,
        vocab_size=info.vocab_size,
        models=tuple(model_names(info.model, config, info.has_head)),
        tiers=tuple([*config.tiers, AUTO] if info.has_head else config.tiers),
    )


def create_app(
    engine: Engine, settings: GatewaySettings | None = None, on_ready: Callable[[], None] | None = None
) -> FastAPI:
    """Build the app around an engine (not started yet: the lifespan starts and stops it)."""
    settings = settings or GatewaySettings()
    gw = Gateway(engine, settings)
    limits = limits_for(gw)
    app = FastAPI(
        title="dialspec",
        summary="OpenAI-compatible speculative decoding with a quality dial (DIVERSED ensemble verification)",
        version="0.1.0",
        lifespan=_lifespan,
    )
    app.state.gateway, app.state.limits, app.state.on_ready = gw, limits, on_ready
    errors.install(app)
    protected = (("/metrics",) if settings.metrics_need_key else ()) + (
        DOCS_PATHS if settings.docs_need_key else ()
    )
    app.add_middleware(
        GuardMiddleware,
        api_keys=settings.api_keys,
        max_body_bytes=settings.max_body_bytes,
        protected=protected,
    )
    # Added last, so outermost: the deadline covers the guard's own reading of a chunked body.
    app.add_middleware(BodyDeadlineMiddleware, seconds=settings.body_timeout_s)
    openapi.install(app, auth=bool(settings.api_keys), protected=protected)
    app.include_router(_generation_routes(*request_models(limits)))
    app.include_router(routes)
    playground.install(app, engine, settings)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """Start the engine and the gateway's two clocks; at the end drain, stop them, stop the engine."""
    gw: Gateway = app.state.gateway
    await gw.engine.start()
    gw.ready = True
    watch = asyncio.ensure_future(gw.watch_engine())
    brownout = asyncio.ensure_future(gw.run_brownout())
    if app.state.on_ready is not None:
        app.state.on_ready()
    try:
        yield
    finally:
        await gw.shutdown()  # a no-op when the server already drained (listen.GatewayServer)
        gw.ready = False
        for task in (watch, brownout):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await gw.engine.stop()
        gw.close()


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _generation_routes(chat_request: type, completion_request: type) -> APIRouter:
    """The two generation endpoints. Their body models carry this engine's limits (`request_models`),
    so they are built per app; the handlers only pass the body on to `Gateway.handle`."""
    router = APIRouter()

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=openapi.generation_responses(ChatCompletionChunk),
    )
    async def chat_completions(body: chat_request, request: Request):
        """Chat completion; `stream: true` answers with server-sent `chat.completion.chunk`s."""
        return await _gateway(request).handle("chat", body, request)

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=openapi.generation_responses(CompletionChunk),
    )
    async def completions(body: completion_request, request: Request):
        """Text completion; `stream: true` answers with server-sent `text_completion` chunks."""
        return await _gateway(request).handle("completion", body, request)

    return router


# Every other route: the same for any engine, so defined once; each reads its app's Gateway.
routes = APIRouter()


def _card(gw: Gateway, name: str) -> dict:
    return {"id": name, "object": "model", "created": gw.created, "owned_by": "dialspec"}


@routes.get("/v1/models", response_model=ModelList)
async def models(request: Request):
    """The pair (default quality) and `<pair>:<tier>` for every tier."""
    gw, limits = _gateway(request), request.app.state.limits
    return {"object": "list", "data": [_card(gw, n) for n in limits.models]}


@routes.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=openapi.error_responses(404))
async def model(model_id: str, request: Request):
    """One served model (any id that GET /v1/models lists)."""
    if model_id not in request.app.state.limits.models:
        raise APIError(
            404,
            f"The model '{model_id}' does not exist; GET /v1/models lists the served names",
            param="model",
            code="model_not_found",
        )
    return _card(_gateway(request), model_id)


@routes.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP (open without a key)."""
    return {"status": "ok"}


@routes.get("/ready", response_model=ReadyResponse, responses=openapi.error_responses(503))
async def ready(request: Request):
    """Readiness (open without a key): 200 when the engine can generate now; 503 with the reason
    (starting, draining, engine failed, SGLang runtime unreachable) otherwise."""
    gw = _gateway(request)
    problem = await gw.readiness()
    if problem is not None:
        code, reason = problem
        raise APIError(503, reason, code=code)
    info = gw.engine.info
    return {
        "status": "ready",
        "model": info.model,
        "backend": info.backend,
        "max_context": info.max_context,
        "num_draft": info.num_draft,
        "adaptive_draft": info.adaptive_draft,
        "has_head": info.has_head,
        "load": gw.engine.load(),
    }


@routes.get("/v1/engine/runtime", response_model=EngineRuntime)
async def engine_runtime(request: Request):
    """What the engine measured about itself (behind the API key, like every /v1 path): the
    dtype and how it was chosen, the draft-length mode, and for engines that keep one the live
    cost model in ms per stage (target forward for T = 1..N_max+1 new tokens, draft step, the
    first draft step after the target's forward, check, other) at batch 1 and max_batch; and
    the gateway's brownout controller (level, arrival rate, measured capacity per level)."""
    gw = _gateway(request)
    runtime = dict(gw.engine.info.runtime)
    live = getattr(gw.engine, "cost_model_summary", None)  # the embedded engine's, refined by every round
    if callable(live) and (summary := live()) is not None:
        runtime["cost_model"] = summary
    runtime["brownout"] = gw.brownout.summary()  # the gateway's own measurements (brownout.py)
    return {"backend": gw.engine.info.backend, "runtime": runtime}


@routes.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    """Prometheus text exposition (see server/gateway/metrics.py for names and PromQL)."""
    gw = _gateway(request)
    gw.metrics.ready.set(0 if await gw.readiness() else 1)
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)
