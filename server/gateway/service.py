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
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

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
from server.gateway.prepare import Plan, Prepared
from server.gateway.settings import GatewaySettings
from server.gateway.streaming import (
    ChunkFormatter,
    ClosingEventSourceResponse,
    shutting_down,
    sse_events,
)
from verifier.dial import DialPoint, PolicyKind, verification_for

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
        """One request: plan -> admit -> prepare and start -> respond (JSON, or an SSE stream).

        What admission gave (the slots, then the engine rows and the accounting) is released once,
        when the response is over: by `owner` for a JSON answer or an error; a stream takes the
        release over from `owner` (`pop_all`) and runs it when the stream ends.
        """
        start = time.monotonic()
        plan = self._plan(kind, body)
        try:
            await self._admit(plan, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        admitted = self._serve_admitted(plan, start)
        async with contextlib.AsyncExitStack() as owner:
            owner.push_async_callback(admitted.release)
            try:
                prep = await self._prepare(admitted, kind, body, request)
                if prep.stream:
                    first = await until_disconnect(request, admitted.run.next_event())
                    stream = self._sse(admitted, first)
                    owner.pop_all()  # the stream releases them now, when it ends
                    return stream
                await until_disconnect(request, self._collect(admitted.run, admitted.tracker))
                body = self._body(prep, admitted.tracker, self.engine.info.system_fingerprint)
                return JSONResponse(body, headers=admitted.headers())
            except ClientDisconnected:
                return Response(status_code=CLIENT_CLOSED)
            except ServerShuttingDown:
                raise self._refuse(shutting_down()) from None
            except EngineError as exc:
                if admitted.tracker is not None:
                    admitted.tracker.failed = True
                raise self._refuse(from_engine_error(exc)) from None

    def _plan(self, kind: str, body) -> Plan:
        """The cheap checks and decisions, on the loop (503 while closed, 4xx on a bad body)."""
        try:
            self.refuse_if_closed()
            return prep_mod.plan(kind, body, self.engine, self.settings, self.max_choices)
        except APIError as exc:
            raise self._refuse(exc) from None

    async def _admit(self, plan: Plan, request: Request) -> None:
        """A slot per choice, or at once a 429 (at capacity) or 503 (closing or failed)."""
        self.brownout.arrived()
        try:
            await until_disconnect(request, self.admission.acquire(plan.choices))
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

    def _serve_admitted(self, plan: Plan, start: float) -> Admitted:
        """The quality an admitted request is served at: decided once, here (brownout)."""
        admitted_at = time.monotonic()
        self.metrics.queue_time.observe(admitted_at - start)
        served = replace(plan, dial=self.brownout.serve(plan.dial, plan.floor))
        self.metrics.requests_by_quality.labels(
            requested_tier=plan.dial.label, served_tier=served.dial.label
        ).inc()
        return Admitted(self, served, requested=plan.dial, start=start, admitted_at=admitted_at)

    async def _prepare(self, admitted: Admitted, kind: str, body, request: Request) -> Prepared:
        """Tokenize off the loop, build the engine requests and start them."""
        tokenized = asyncio.get_running_loop().run_in_executor(
            self._cpu, prep_mod.tokenize, kind, body, self.engine
        )
        try:
            prompts = await until_disconnect(request, tokenized)
            prep = prep_mod.build(admitted.plan, prompts, self.engine.info, self.settings)
        except APIError as exc:
            raise self._refuse(exc) from None
        admitted.prep = prep
        admitted.tracker = Tracker(
            self.metrics, prep.dial, admitted.slots, prep.prompt_tokens, arrival=admitted.start,
            requested=admitted.requested, floor=admitted.plan.floor,
        )  # fmt: skip
        admitted.run = MultiStream(self.engine, prep.requests).start()
        self._runs.add(admitted.run)
        if self._cut:
            admitted.run.shutdown()
        return prep

    def _sse(self, admitted: Admitted, first) -> ClosingEventSourceResponse:
        prep = admitted.prep
        fmt = ChunkFormatter(
            prep.kind, prep.request_id, prep.created, prep.model, prep.include_usage,
            self.engine.info.system_fingerprint,
        )  # fmt: skip
        return ClosingEventSourceResponse(
            sse_events(admitted.run, admitted.tracker, fmt, first),
            on_close=admitted.release,
            ping=15,
            # sse-starlette ends streams once uvicorn exits; the drain has ended ours by then
            shutdown_grace_period=2,
            headers=admitted.headers(),
        )

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


@dataclass
class Admitted:
    """What an admitted request holds until its response is over: its slots, then its engine
    rows (`run`) and accounting (`tracker`). `release` gives them back, once."""

    gateway: Gateway
    plan: Plan  # as served (the brownout's quality in `dial`)
    requested: DialPoint  # the quality asked for
    start: float  # arrival (monotonic)
    admitted_at: float
    prep: Prepared | None = None
    tracker: Tracker | None = None
    run: MultiStream | None = None
    _released: bool = False

    @property
    def slots(self) -> int:
        return self.plan.choices

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.prep.request_id, **quality_headers(self.tracker.quality())}

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        gw = self.gateway
        if self.run is not None:
            await self.run.aclose()  # cancels unfinished streams: the engine frees their rows
            gw._runs.discard(self.run)
        if self.tracker is not None:
            self.tracker.close()
            if self.tracker.done:
                service_s = time.monotonic() - self.admitted_at
                tokens = sum(self.tracker.completion_tokens)
                plan = self.plan
                gw.brownout.finished(self.requested, plan.floor, plan.dial, service_s, tokens, self.slots)
        gw.admission.release(self.slots)
        if self.prep is not None and self.tracker is not None:
            gw._log(self.prep, self.tracker, self.start)


def quality_headers(quality: dict) -> dict[str, str]:
    """Tracker.quality() as response headers, for clients that do not read the `dialspec` body."""
    out = {"X-Dialspec-Tier": quality["tier"], "X-Dialspec-Requested-Tier": quality["requested_tier"]}
    if quality["quality"] is not None:
        out["X-Dialspec-Quality"] = f"{quality['quality']:g}"
        out["X-Dialspec-Requested-Quality"] = f"{quality['requested_quality']:g}"
    return out
