"""One load phase: a fixed list of requests sent with one load shape, bounded twice.

Bounds: at most `len(plan)` requests (the request count) AND no request sent after `duration`
seconds. Requests already in flight when the duration ends run to completion or to their own
timeout, so a phase lasts at most `duration + request timeout` and every sent request is counted
exactly once: sent = successes + failures.

Phase duration (the denominator of throughputs) runs from the phase start to the end of the last
request, as in `vllm bench serve`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from loadtest.client import RequestOptions, RequestRecord, RequestSpec, send
from loadtest.schedule import LoadShape, poisson_arrivals


@dataclass
class PhaseResult:
    shape: LoadShape
    records: list[RequestRecord]  # in index order
    duration: float  # seconds, start to last completion
    planned: int  # requests in the plan (the count bound)
    stopped_by: str  # "count" (all planned requests sent) or "duration"


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
    records.sort(key=lambda r: r.index)
    stopped_by = "count" if len(records) == len(plan) else "duration"
    return PhaseResult(shape, records, elapsed, len(plan), stopped_by)
