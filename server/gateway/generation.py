"""Running one HTTP request's sequences on the engine: merging choices, accounting, disconnects.

Terms:
    choice     one generated sequence; a request has n choices per prompt, indexed as OpenAI does
               (prompt k, sample j -> index k*n + j).
    arrival    monotonic time the request reached the handler (TTFT and e2e start here).
    abort      a sequence cut short because the client went away or the server is shutting down;
               closing the engine's iterator frees its batch row (protocol.py, "Cancellation").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from starlette.requests import Request

from server.engine.protocol import Engine, GenerationChunk, GenerationRequest, SpecStats, TokenLogprob
from server.gateway.metrics import GatewayMetrics
from verifier.dial import DialPoint, PolicyKind


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class ServerShuttingDown(Exception):
    """The drain's grace period ended before this request finished (MultiStream.shutdown)."""


_SHUTDOWN = object()  # queue sentinel: the server is ending this request


def trace_entries(chunk: GenerationChunk) -> list[dict] | None:
    """The chunk's `dialspec_trace` entries (schemas.TraceToken), None when it carries none."""
    if chunk.provenance is None:
        return None
    return [
        {"token_id": tok, "text": t.text, "source": t.source, "w": t.weight, "position": t.position,
         "num_draft": t.num_draft}
        for tok, t in zip(chunk.token_ids, chunk.provenance, strict=True)
    ]  # fmt: skip


def logprobs_object(kind: str, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """A choice's (or a streamed chunk's) `logprobs` in OpenAI's shape: chat
    `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`; completions the legacy
    `{tokens, token_logprobs, top_logprobs, text_offset}`, offsets counted in the tokens' own text
    from `offset` (the characters of the choice's earlier tokens)."""
    if kind == "chat":
        return {"content": [_chat_entry(e, top=True) for e in entries], "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _chat_entry(e: TokenLogprob, top: bool) -> dict:
    entry = {"token": e.token, "logprob": e.logprob, "bytes": list(e.token_bytes)}
    if top:
        entry["top_logprobs"] = [_chat_entry(t, top=False) for t in e.top]
    return entry


class MultiStream:
    """Runs one engine stream per choice concurrently and yields `(choice_index, chunk)` in arrival
    order. `aclose()` cancels every stream still running and closes its engine iterator."""

    def __init__(self, engine: Engine, requests: list[GenerationRequest]):
        self._engine = engine
        self._requests = requests
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._remaining = 0  # choices whose engine stream has not ended yet

    def start(self) -> MultiStream:
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self._requests)]
        self._remaining = len(self._tasks)
        return self

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        iterator = self._engine.generate(request)
        try:
            async for chunk in iterator:
                self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EngineError or a bug: surfaced to the consumer, not lost in a task
            self._queue.put_nowait((index, exc))
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    def shutdown(self) -> None:
        """End the request now: its consumer's `next_event` raises ServerShuttingDown."""
        self._queue.put_nowait((-1, _SHUTDOWN))

    async def next_event(self) -> tuple[int, GenerationChunk] | None:
        """The next chunk of any choice, or None once every choice has finished."""
        while self._remaining:
            index, item = await self._queue.get()
            if item is _SHUTDOWN:
                raise ServerShuttingDown()
            if item is None:
                self._remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        return None

    async def events(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        while (event := await self.next_event()) is not None:
            yield event

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class Tracker:
    """Collects one request's output and timings, and records its metrics exactly once."""

    metrics: GatewayMetrics
    dial: DialPoint  # as served (metrics are labelled with it)
    num_choices: int
    prompt_tokens: int  # usage: each distinct prompt counted once, as OpenAI does
    arrival: float = field(default_factory=time.monotonic)
    requested: DialPoint | None = None  # as asked, when brownout served it lower (None: = dial)
    floor: float | None = None  # the request's min_quality (None: not lowerable)
    texts: list[list[str]] = field(init=False)
    finish: list[str | None] = field(init=False)
    completion_tokens: list[int] = field(init=False)
    stats: list[SpecStats | None] = field(init=False)
    traces: list[list[dict] | None] = field(init=False)  # per choice, with dialspec_trace only
    logprobs: list[list[TokenLogprob] | None] = field(init=False)  # per choice, with logprobs only
    _logprob_chars: list[list[int]] = field(init=False)  # per choice: [text before the last chunk, after]
    _last: list[float | None] = field(init=False)
    failed: bool = False  # answered with an error before any output: not a finished sequence
    _first_at: float | None = None
    _closed: bool = False

    def __post_init__(self):
        n = self.num_choices
        self.texts = [[] for _ in range(n)]
        self.finish = [None] * n
        self.completion_tokens = [0] * n
        self.stats = [None] * n
        self.traces = [None] * n
        self.logprobs = [None] * n
        self._logprob_chars = [[0, 0] for _ in range(n)]
        self._last = [None] * n

    def on_chunk(self, index: int, chunk: GenerationChunk) -> None:
        now = time.monotonic()
        tier = self.dial.label
        if chunk.text or chunk.token_ids:
            if self._first_at is None:
                self._first_at = now
                self.metrics.ttft.labels(tier=tier).observe(now - self.arrival)
            last = self._last[index]
            if last is not None:
                self.metrics.itl.labels(tier=tier).observe(now - last)
            self._last[index] = now
        if chunk.text:
            self.texts[index].append(chunk.text)
        if chunk.provenance is not None:
            if self.traces[index] is None:
                self.traces[index] = []
            self.traces[index].extend(trace_entries(chunk))
        if chunk.logprobs is not None:
            if self.logprobs[index] is None:
                self.logprobs[index] = []
            self.logprobs[index].extend(chunk.logprobs)
            chars = self._logprob_chars[index]
            chars[0] = chars[1]
            chars[1] += sum(len(e.token) for e in chunk.logprobs)
        self.completion_tokens[index] = chunk.completion_tokens
        if chunk.finish_reason is not None:
            self.finish[index] = chunk.finish_reason
            self.stats[index] = chunk.stats
            self.metrics.record_sequence(tier, chunk.stats, chunk.completion_tokens, chunk.finish_reason)

    def chunk_logprobs(self, kind: str, index: int, chunk: GenerationChunk) -> dict | None:
        """The `logprobs` of a chunk just passed to `on_chunk`; None when it carries none."""
        if chunk.logprobs is None:
            return None
        return logprobs_object(kind, chunk.logprobs, self._logprob_chars[index][0])

    def choice_logprobs(self, kind: str, index: int) -> dict | None:
        entries = self.logprobs[index]
        return None if entries is None else logprobs_object(kind, entries)

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def close(self) -> None:
        """Called once at the end, however it ended: unfinished choices count as aborted."""
        if self._closed or self.failed:
            return
        self._closed = True
        for i, finish in enumerate(self.finish):
            if finish is None:
                self.metrics.success.labels(finish_reason="abort").inc()
                self.finish[i] = "abort"
        self.metrics.e2e.labels(tier=self.dial.label).observe(time.monotonic() - self.arrival)
        self.metrics.tokens_by_quality.labels(
            requested_tier=(self.requested or self.dial).label, served_tier=self.dial.label
        ).inc(sum(self.completion_tokens))
        self.metrics.prompt_tokens_total.inc(self.prompt_tokens)
        self.metrics.prompt_tokens.observe(self.prompt_tokens)

    def usage(self) -> dict:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def quality(self) -> dict:
        """What was served and what was asked (the first streamed chunk carries this alone)."""
        requested = self.requested or self.dial
        return {
            "tier": self.dial.label,
            "quality": self.dial.quality,
            "requested_tier": requested.label,
            "requested_quality": requested.quality,
            "min_quality": self.floor,
        }

    def dialspec(self) -> dict:
        """The `dialspec` response extension: speculative counters summed over choices."""
        s = SpecStats()
        for st in self.stats:
            if st is None:
                continue
            s.drafts += st.drafts
            s.draft_tokens += st.draft_tokens
            s.accepted_tokens += st.accepted_tokens
            s.weight_sum += st.weight_sum
            s.weight_count += st.weight_count
            s.verify_steps += st.verify_steps
            s.target_only_rounds += st.target_only_rounds
            s.draft_only_tokens += st.draft_only_tokens
            for pos, count in enumerate(st.accepted_per_position):
                if pos == len(s.accepted_per_position):
                    s.accepted_per_position.append(0)
                s.accepted_per_position[pos] += count
        mean_w = s.mean_weight
        verify = self.dial.verification
        if mean_w is None and s.drafts and verify.policy == PolicyKind.ENSEMBLE and not verify.learned:
            mean_w = verify.weight  # engine did not report per-position weights: the static w applies
        return {
            "policy": self.dial.policy_name,
            **self.quality(),
            "mean_w": mean_w,
            "drafts": s.drafts,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "verify_steps": s.verify_steps,
            "target_only_rounds": s.target_only_rounds,
            "draft_only_tokens": s.draft_only_tokens,
            "accepted_per_position": s.accepted_per_position,
        }


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body has been read, the server's receive() blocks until the client disconnects.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.01)  # a stray message (pipelining): don't spin


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work`, cancelling it (and so closing engine iterators) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
