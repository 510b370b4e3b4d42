"""One streamed request against an OpenAI-compatible endpoint, timed from the client side.

Every request ends as exactly one `RequestRecord`: a success, or a failure of one kind:
    http_<status>     the server answered with a non-200 status (e.g. http_429 when overloaded)
    timeout           no complete response within `--request-timeout` (connect, read or overall)
    connection        could not connect, or the connection broke mid-response
    malformed_stream  not an SSE stream, a chunk that is not OpenAI JSON, or no `[DONE]`
    stream_error      the server sent an `{"error": ...}` event after the stream had started
Times are `time.perf_counter()` seconds; `start` is relative to the phase start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import httpx

from loadtest.prompts import Prompt
from loadtest.sse import MalformedStream, SSEDecoder, parse_event
from loadtest.tiers import Tier

FAILURE_KINDS = ("http", "timeout", "connection", "malformed_stream", "stream_error")


@dataclass
class RequestSpec:
    """What to send: fixed before the run starts (so a seed fixes the whole workload)."""

    index: int
    prompt: Prompt
    tier: Tier
    seed: int | None
    floor: Tier | None = None  # sent as `min_quality` (dialspec brownout) unless None / no quality


@dataclass
class RequestRecord:
    index: int
    tier: str  # the requested tier (mix name)
    prompt_uid: str
    floor: str | None = None  # the floor mix name, when the run sends floors
    start: float = 0.0  # send time, seconds since the phase started
    ok: bool = False
    error_kind: str | None = None  # see module docstring
    error: str | None = None  # short detail, for the JSON
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried output text
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # from usage; None when the server sent no usage
    finish_reason: str | None = None
    dialspec: dict | None = None

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None for single-token or failed responses."""
        if not self.ok or self.ttft is None or self.e2e is None or not self.output_tokens:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        out = asdict(self)
        out["tpot"] = self.tpot
        return out


@dataclass(frozen=True)
class RequestOptions:
    """Request fields shared by every request of a run."""

    model: str
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    max_tokens: int = 128
    temperature: float = 1.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    timeout: float = 120.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def build_body(spec: RequestSpec, opts: RequestOptions) -> dict:
    body: dict = {
        "model": opts.model,
        "max_tokens": spec.prompt.max_tokens or opts.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.endpoint == "chat":
        body["messages"] = [dict(m) for m in spec.prompt.messages]
    else:
        body["prompt"] = spec.prompt.text
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.tier.quality is not None:
        body["quality"] = spec.tier.quality
    if spec.floor is not None and spec.floor.quality is not None:
        body["min_quality"] = spec.floor.quality
    if opts.ignore_eos:
        body["ignore_eos"] = True
    body.update(opts.extra_body)
    return body


async def _stream(
    client: httpx.AsyncClient, spec: RequestSpec, opts: RequestOptions, rec: RequestRecord
) -> None:
    t0 = time.perf_counter()
    last: float | None = None
    done = False
    decoder = SSEDecoder()
    async with client.stream("POST", opts.path, json=build_body(spec, opts)) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            body = (await resp.aread())[:300].decode("utf-8", "replace")
            rec.error_kind, rec.error = f"http_{resp.status_code}", body
            return
        ctype = resp.headers.get("content-type", "")
        if "text/event-stream" not in ctype:
            raise MalformedStream(f"content-type is {ctype!r}, not text/event-stream")

        async def events():
            async for line in resp.aiter_lines():
                data = decoder.feed(line)
                if data is not None:
                    yield data
            data = decoder.flush()
            if data is not None:
                yield data

        async for data in events():
            now = time.perf_counter()
            if done:
                raise MalformedStream("data after [DONE]")
            chunk = parse_event(data)
            if chunk.done:
                done = True
                continue
            if chunk.error is not None:
                rec.error_kind = "stream_error"
                rec.error = str(chunk.error.get("message", chunk.error))[:300]
                return
            if chunk.text:
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                rec.chunks += 1
            if chunk.finish_reason:
                rec.finish_reason = chunk.finish_reason
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.get("prompt_tokens")
                rec.output_tokens = chunk.usage.get("completion_tokens")
            if chunk.dialspec is not None:
                rec.dialspec = chunk.dialspec
    if not done:
        raise MalformedStream("stream ended without data: [DONE]")
    rec.e2e = time.perf_counter() - t0
    if rec.ttft is None:
        rec.ttft = rec.e2e  # an empty completion: the first (and only) answer is the end
    rec.ok = True


async def send(
    client: httpx.AsyncClient, spec: RequestSpec, opts: RequestOptions, phase_start: float
) -> RequestRecord:
    """Send one request and classify how it ended; never raises (except on cancellation)."""
    rec = RequestRecord(
        spec.index,
        spec.tier.name,
        spec.prompt.uid,
        floor=None if spec.floor is None else spec.floor.name,
        start=time.perf_counter() - phase_start,
    )
    try:
        await asyncio.wait_for(_stream(client, spec, opts, rec), opts.timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.error_kind, rec.error = "timeout", f"no complete response within {opts.timeout:g} s"
    except MalformedStream as exc:
        rec.error_kind, rec.error = "malformed_stream", str(exc)[:300]
    except (httpx.TransportError, OSError) as exc:  # connect refused, reset, incomplete body
        rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:300]
    if rec.error_kind is not None:
        rec.ok = False
    return rec
