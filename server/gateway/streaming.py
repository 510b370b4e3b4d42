"""Server-sent events in the exact OpenAI chunk format.

Chat: `chat.completion.chunk` objects; each choice's first delta carries `role: "assistant"`, text
deltas carry `content`, and the choice ends with an empty delta and its `finish_reason`.
Completions: `text_completion` objects with `text`. The stream ends with `data: [DONE]`.

With `stream_options.include_usage`, every chunk carries `"usage": null` and one final chunk with
`"choices": []` carries usage and the `dialspec` stats; without it, `dialspec` rides on the last chunk
that has choices. The first chunk carries `dialspec` too, with the served and requested quality
alone (Tracker.quality), so a client knows what it gets before the first token is read.
An error after the stream started is sent as `data: {"error": {...}}` (the
`openai` client raises it) followed by `[DONE]`. When a shutdown's grace period ends first, each
unfinished choice gets a final chunk with `finish_reason: "abort"` (and the usage chunk, when
asked for), then the error event `server_shutting_down`, then `[DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from sse_starlette import EventSourceResponse

from server.engine.protocol import EngineError
from server.gateway.errors import APIError, from_engine_error
from server.gateway.generation import MultiStream, ServerShuttingDown, Tracker, trace_entries

log = logging.getLogger("dialspec.gateway")


def _dump(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ChunkFormatter:
    """Builds the JSON payload of each SSE event for one request."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
        system_fingerprint: str | None = None,
    ):
        self.kind = kind  # "chat" or "completion"
        self.base = {
            "id": request_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": system_fingerprint,  # on every chunk, as OpenAI's
        }
        self.include_usage = include_usage

    def choice(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        role: bool = False,
        trace: list | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            body: dict = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            body = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if trace is not None:
            body["dialspec_trace"] = trace
        payload = {**self.base, "choices": [body]}
        if self.include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(self, usage: dict, dialspec: dict) -> dict:
        return {**self.base, "choices": [], "usage": usage, "dialspec": dialspec}


async def sse_events(
    run: MultiStream, tracker: Tracker, fmt: ChunkFormatter, first: tuple | None
) -> AsyncIterator[dict]:
    """SSE events for a started MultiStream; `first` is the event already taken off it (to turn an
    engine error before any output into a proper HTTP status)."""
    started = [False] * tracker.num_choices
    announce = {"dialspec": tracker.quality()}  # merged into the stream's first chunk, then empty
    try:
        event = first
        while event is not None:
            index, chunk = event
            tracker.on_chunk(index, chunk)
            trace = trace_entries(chunk)
            lps = tracker.chunk_logprobs(fmt.kind, index, chunk)
            if fmt.kind == "chat" and not started[index]:
                started[index] = True
                payload = fmt.choice(index, chunk.text, None, role=True, trace=trace, logprobs=lps)
                yield {"data": _dump({**payload, **announce})}
                announce = {}
            elif chunk.text or trace or lps:
                payload = fmt.choice(index, chunk.text, None, trace=trace, logprobs=lps)
                yield {"data": _dump({**payload, **announce})}
                announce = {}
            if chunk.finish_reason is not None:
                payload = fmt.choice(index, None if fmt.kind == "chat" else "", chunk.finish_reason)
                if fmt.kind == "chat":
                    payload["choices"][0]["delta"] = {}
                if tracker.done and not fmt.include_usage:
                    payload["dialspec"] = tracker.dialspec()
                yield {"data": _dump({**announce, **payload})}
                announce = {}
            event = await run.next_event()
        if fmt.include_usage:
            yield {"data": _dump(fmt.usage_chunk(tracker.usage(), tracker.dialspec()))}
    except ServerShuttingDown:
        for event in _final_chunks(tracker, fmt, started):
            yield event
        yield {"data": _dump(shutting_down().body())}
    except EngineError as exc:
        yield {"data": _dump(from_engine_error(exc).body())}
    except Exception as exc:  # never leave the client hanging without [DONE]
        log.exception("stream failed: %s", type(exc).__name__)
        yield {"data": _dump(APIError(500, "internal error while streaming").body())}
    yield {"data": "[DONE]"}


def shutting_down() -> APIError:
    """503 for requests refused or cut short by a shutdown (a fresh object: it is raised)."""
    return APIError(
        503,
        "the server is shutting down; retry the request (on another replica)",
        code="server_shutting_down",
        headers={"Retry-After": "1", "Connection": "close"},
    )


def _final_chunks(tracker: Tracker, fmt: ChunkFormatter, started: list[bool]):
    """A closing chunk for every unfinished choice (finish_reason 'abort'), then usage if asked."""
    unfinished = [i for i, f in enumerate(tracker.finish) if f is None]  # Tracker.close counts them
    for k, i in enumerate(unfinished):
        payload = fmt.choice(i, None if fmt.kind == "chat" else "", "abort", role=not started[i])
        if fmt.kind == "chat" and started[i]:
            payload["choices"][0]["delta"] = {}
        if k == len(unfinished) - 1 and not fmt.include_usage:
            payload["dialspec"] = tracker.dialspec()
        yield {"data": _dump(payload)}
    if fmt.include_usage:
        yield {"data": _dump(fmt.usage_chunk(tracker.usage(), tracker.dialspec()))}


class ClosingEventSourceResponse(EventSourceResponse):
    """An EventSourceResponse that always runs `on_close` once the response is over, however it
    ends (finished, client disconnected, cancelled before the body generator ever started), so the
    admission slot and the engine rows are always given back."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
