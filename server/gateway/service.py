"""The Gateway: what one app instance owns (engine, settings, metrics, admission) and the request
flow, readiness, the watch on the engine, and the drain at shutdown.

Request flow (chat and text completions share it):
    open? (503 while starting, draining or after an engine fault) -> plan (model, dial, choice
    count, sampling, length bound: cheap, on the loop) -> admission (slot, or 429 + Retry-After at
    once) -> tokenize (on a worker thread) -> exact lengths -> MultiStream over the engine -> JSON
    response or SSE stream. A client disconnect at any point cancels generation and returns the
    slot. Logs carry ids, sizes and timings, never prompt or completion text (unless `log_content`).

Shutdown (`shutdown`, run by the server on SIGTERM/SIGINT): stop admitting (new requests 503 over
HTTP while the listener is still open), let in-flight requests finish for up to `drain_timeout_s`,
then end the rest: streams get a final chunk per unfinished choice (`finish_reason: "abort"`),
the error event `server_shutting_down` and `[DONE]`; non-stream requests a 503 error object.

Engine fault: an engine reporting an unrecoverable `fault` (protocol.engine_fault) makes the
gateway refuse requests, report it on /ready, and call `on_fatal` (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server.engine.protocol import Engine, EngineError, engine_fault, engine_readiness
from server.gateway import prepare as prep_mod
from server.gateway.admission import Admission, Closed, Overloaded
from server.gateway.brownout import TICK_S, Brownout
from server.gateway.errors import APIError, from_engine_error
from server.gateway.generation import (
    ClientDisconnected,
    MultiStream,
    ServerShuttingDown,
    Tracker,
    until_disconnect,
)
from server.gateway.metrics import GatewayMetrics
from server.gateway.prepare import Prepared
from server.gateway.settings import GatewaySettings
from server.gateway.streaming import (
    ChunkFormatter,
    ClosingEventSourceResponse,
    shutting_down,
    sse_events,
)
from verifier.dial import PolicyKind, verification_for

log = logging.getLogger("dialspec.gateway")

# 499: nginx's "client closed request"; nobody reads it, but access logs show what happened.
CLIENT_CLOSED = 499
_WATCH_INTERVAL_S = 0.25  # how often the engine is checked for a fault
_READINESS_TIMEOUT_S = 5.0
_CUT_WAIT_S = 10.0  # after the grace period: how long cut requests get to send their last bytes


class Gateway:
    def __init__(self, engine: Engine, settings: GatewaySettings):
        self.engine = engine
        self.settings = settings
        self.metrics = GatewayMetrics()
        max_running = settings.max_running or engine.info.max_batch
        self.admission = Admission(max_running, settings.max_waiting)
        config = settings.dial_config()
        self.brownout = Brownout(
            config, settings.brownout_ttft_s or None, max_running, self.admission.oldest_wait
        )
        self.metrics.bind_load(self.admission, self.brownout)
        self.metrics.set_acceptance_floors(
            {t: verification_for(PolicyKind.ENSEMBLE, q, config).weight for t, q in config.tiers.items()},
            engine.info.num_draft_limit,
        )
        self.max_choices = min(settings.max_n, max_running)  # n x prompts, published as n's maximum
        self.ready = False  # the lifespan has started the engine
        self.draining = False
        self.failed: str | None = None  # why the engine can never generate again
        self.on_fatal: Callable[[], None] | None = None  # the server's "exit non-zero"
        self.created = int(time.time())
        self._runs: set[MultiStream] = set()
        self._cut = False  # the grace period is over: requests still running are ended
        self._drain_task: asyncio.Task | None = None
        # Tokenization and other CPU work: never on the event loop. Admitted requests are bounded
        # by max_running, so two threads keep a long prompt from holding up the others.
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dialspec-cpu")

    # -- lifecycle ---------------------------------------------------------------------------
    async def watch_engine(self) -> None:
        """Runs for the app's lifetime: turns an engine fault into `failed` and `on_fatal`."""
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            fault = engine_fault(self.engine)
            if fault is not None:
                self.failed = f"the engine failed ({type(fault).__name__}) and cannot generate"
                log.critical("%s; shutting down so that a supervisor restarts the server", self.failed)
                self.admission.close()
                if self.on_fatal is not None:
                    self.on_fatal()
                return

    async def run_brownout(self) -> None:
        """Runs for the app's lifetime: the brownout controller's clock (it decides off the
        request path; a request only reads the level)."""
        while True:
            await asyncio.sleep(TICK_S)
            before = self.brownout.degraded_s
            self.brownout.tick()
            self.metrics.degraded_seconds.inc(self.brownout.degraded_s - before)

    async def shutdown(self) -> None:
        """Drain (idempotent; concurrent callers wait for the same drain)."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        await asyncio.shield(self._drain_task)

    async def _drain(self) -> None:
        self.draining = True
        self.admission.close()  # queued requests get 503 now; running ones keep going
        grace = self.settings.drain_timeout_s
        log.info("draining: %d request(s) in flight, up to %.0f s", self.admission.running_requests, grace)
        deadline = time.monotonic() + grace
        while not self.admission.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.admission.idle:
            return
        log.warning("grace period over: ending %d request(s)", self.admission.running_requests)
        self._cut = True
        for run in list(self._runs):
            run.shutdown()
        deadline = time.monotonic() + _CUT_WAIT_S
        while not self.admission.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # -- readiness -----------------------------------------------------------------------------
    def refuse_if_closed(self) -> None:
        """503 (an OpenAI error object) unless the server takes new requests."""
        if self.failed is not None:
            raise APIError(503, f"{self.failed}; retry on another replica", code="engine_failed")
        if self.draining:
            raise shutting_down()
        if not self.ready:
            raise APIError(
                503,
                "the engine is not ready (starting); retry shortly",
                code="engine_not_ready",
                headers={"Retry-After": "1"},
            )

    async def readiness(self) -> tuple[str, str] | None:
        """None when requests can be served now, else (code, reason)."""
        if self.failed is not None:
            return "engine_failed", self.failed
        if self.draining:
            return "server_draining", "the server is shutting down (draining)"
        if not self.ready:
            return "engine_not_ready", "the engine is not loaded yet"
        try:
            reason = await asyncio.wait_for(engine_readiness(self.engine), _READINESS_TIMEOUT_S)
        except asyncio.TimeoutError:
            reason = f"the engine's readiness check took over {_READINESS_TIMEOUT_S:.0f} s"
        except Exception as exc:  # a probe must not take /ready down with it
            reason = f"the engine's readiness check failed ({type(exc).__name__})"
        return None if reason is None else ("engine_not_ready", reason)

    # -- requests ------------------------------------------------------------------------------
    def _refuse(self, exc: APIError) -> APIError:
        self.metrics.errors.labels(status=str(exc.status)).inc()
        return exc

    async def handle(self, kind: str, body, request: Request) -> Response:
        start = time.monotonic()
        try:
            self.refuse_if_closed()
            plan = prep_mod.plan(kind, body, self.engine, self.settings, self.max_choices)
        except APIError as exc:
            raise self._refuse(exc) from None
        slots = plan.choices
        self.brownout.arrived()
        try:
            await until_disconnect(request, self.admission.acquire(slots))
        except Overloaded:
            self.brownout.refused()
            retry = str(self.settings.retry_after_s)
            raise self._refuse(
                APIError(
                    429,
                    f"the server is at capacity ({self.admission.max_running} running, "
                    f"{self.admission.max_waiting} waiting); retry after {retry} s",
                    code="server_overloaded",
                    headers={"Retry-After": retry},
                )
            ) from None
        except Closed:
            raise self._refuse(
                shutting_down() if self.draining else APIError(503, str(self.failed), code="engine_failed")
            ) from None
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        admitted = time.monotonic()
        self.metrics.queue_time.observe(admitted - start)
        requested = plan.dial
        plan = replace(plan, dial=self.brownout.serve(requested, plan.floor))  # decided once, here
        self.metrics.requests_by_quality.labels(
            requested_tier=requested.label, served_tier=plan.dial.label
        ).inc()

        prep: Prepared | None = None
        tracker: Tracker | None = None
        run: MultiStream | None = None
        closed = False

        async def cleanup():
            nonlocal closed
            if closed:
                return
            closed = True
            if run is not None:
                await run.aclose()  # cancels unfinished streams: the engine frees their rows
                self._runs.discard(run)
            if tracker is not None:
                tracker.close()
                if tracker.done:
                    service_s = time.monotonic() - admitted
                    tokens = sum(tracker.completion_tokens)
                    self.brownout.finished(requested, plan.floor, plan.dial, service_s, tokens, slots)
            self.admission.release(slots)
            if prep is not None and tracker is not None:
                self._log(prep, tracker, start)

        handed_off = False  # once the streaming response owns cleanup, it runs when the stream ends
        try:
            loop = asyncio.get_running_loop()
            tokenized = loop.run_in_executor(self._cpu, prep_mod.tokenize, kind, body, self.engine)
            try:
                prompts = await until_disconnect(request, tokenized)
                prep = prep_mod.build(plan, prompts, self.engine.info, self.settings)
            except APIError as exc:
                raise self._refuse(exc) from None
            tracker = Tracker(
                self.metrics, prep.dial, slots, prep.prompt_tokens, arrival=start, requested=requested,
                floor=plan.floor,
            )  # fmt: skip
            headers = {"X-Request-Id": prep.request_id, **quality_headers(tracker.quality())}
            run = MultiStream(self.engine, prep.requests).start()
            self._runs.add(run)
            if self._cut:
                run.shutdown()
            if prep.stream:
                first = await until_disconnect(request, run.next_event())
                fmt = ChunkFormatter(
                    kind, prep.request_id, prep.created, prep.model, prep.include_usage,
                    self.engine.info.system_fingerprint,
                )  # fmt: skip
                response = ClosingEventSourceResponse(
                    sse_events(run, tracker, fmt, first),
                    on_close=cleanup,
                    ping=15,
                    # sse-starlette ends streams once uvicorn exits; the drain has ended ours by then
                    shutdown_grace_period=2,
                    headers=headers,
                )
                handed_off = True
                return response
            await until_disconnect(request, self._collect(run, tracker))
            body = self._body(prep, tracker, self.engine.info.system_fingerprint)
            return JSONResponse(body, headers=headers)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except ServerShuttingDown:
            raise self._refuse(shutting_down()) from None
        except EngineError as exc:
            if tracker is not None:
                tracker.failed = True
            raise self._refuse(from_engine_error(exc)) from None
        finally:
            if not handed_off:
                await cleanup()

    @staticmethod
    async def _collect(run: MultiStream, tracker: Tracker) -> None:
        async for index, chunk in run.events():
            tracker.on_chunk(index, chunk)

    @staticmethod
    def _body(prep: Prepared, tracker: Tracker, fingerprint: str | None) -> dict:
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
            choice["logprobs"] = tracker.choice_logprobs(prep.kind, choice["index"])
        return {
            "id": prep.request_id,
            "object": obj,
            "created": prep.created,
            "model": prep.model,
            "system_fingerprint": fingerprint,
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


def quality_headers(quality: dict) -> dict[str, str]:
    """Tracker.quality() as response headers, for clients that do not read the `dialspec` body."""
    out = {"X-Dialspec-Tier": quality["tier"], "X-Dialspec-Requested-Tier": quality["requested_tier"]}
    if quality["quality"] is not None:
        out["X-Dialspec-Quality"] = f"{quality['quality']:g}"
        out["X-Dialspec-Requested-Quality"] = f"{quality['requested_quality']:g}"
    return out
