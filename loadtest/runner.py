"""One load phase: a fixed list of requests sent with one load shape, bounded twice.

Bounds: at most `len(plan)` requests (the request count) AND no request sent after `duration`
seconds. Requests already in flight when the duration ends run to completion or to their own
timeout, so a phase lasts at most `duration + request timeout` and every sent request is counted
exactly once: sent = successes + failures.

Phase duration (the denominator of throughputs) runs from the phase start to the end of the last
request, as in `vllm bench serve`.

Client lag: a task sleeps 50 ms at a time through the phase and records how late it wakes. The
generator times requests on its own event loop, so when that loop falls behind (too many streams
for its core) every latency it reports includes its own delay; a large lag says the numbers
measure the load generator, not the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from loadtest.client import RequestOptions, RequestRecord, RequestSpec, send
from loadtest.schedule import LoadShape, poisson_arrivals

_LAG_TICK_S = 0.05


@dataclass
class PhaseResult:
    shape: LoadShape
    records: list[RequestRecord]  # in index order
    duration: float  # seconds, start to last completion
    planned: int  # requests in the plan (the count bound)
    stopped_by: str  # "count" (all planned requests sent) or "duration"
    client_lag: list[float] = field(default_factory=list)  # seconds late, per 50 ms wake-up


async def run_phase(
    client: httpx.AsyncClient,
    plan: list[RequestSpec],
    opts: RequestOptions,
    shape: LoadShape,
    duration: float,
    seed: int,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseResult:
    """Run `plan` with `shape` until every planned request is sent or `duration` s have passed."""
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + duration
    lags: list[float] = []

    async def watch_lag() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(_LAG_TICK_S)
            lags.append(time.perf_counter() - t - _LAG_TICK_S)

    watcher = asyncio.create_task(watch_lag())

    async def one(spec: RequestSpec) -> None:
        rec = await send(client, spec, opts, start)
        records.append(rec)
        if on_done is not None:
            on_done(rec)

    if shape.kind == "concurrency":
        queue = iter(plan)

        async def worker() -> None:
            for spec in queue:  # a shared iterator: each spec goes to exactly one worker
                if time.perf_counter() >= deadline:
                    return
                await one(spec)

        await asyncio.gather(*(worker() for _ in range(int(shape.value))))
    else:
        arrivals = poisson_arrivals(shape.value, len(plan), seed)
        cap = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
        tasks: list[asyncio.Task] = []

        async def capped(spec: RequestSpec) -> None:
            async with cap:
                if time.perf_counter() < deadline:
                    await one(spec)

        for spec, at in zip(plan, arrivals, strict=False):
            send_at = start + at
            if send_at >= deadline:
                break
            delay = send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(capped(spec) if cap else one(spec)))
        await asyncio.gather(*tasks)

    elapsed = time.perf_counter() - start
    watcher.cancel()
    records.sort(key=lambda r: r.index)
    stopped_by = "count" if len(records) == len(plan) else "duration"
    return PhaseResult(shape, records, elapsed, len(plan), stopped_by, lags)
