"""Server-sent events (SSE) parsing for OpenAI-style streaming responses.

Wire format (WHATWG SSE): an event is a block of `field: value` lines ended by a blank line; the
`data` lines of one event are joined with "\\n"; lines starting with `:` are comments (keep-alive
pings); `event`, `id` and `retry` fields carry nothing we need.

OpenAI streams send one JSON chunk per event and end with `data: [DONE]`. A chunk is
    chat        {"object": "chat.completion.chunk", "choices": [{"delta": {"content": ...}}]}
    completion  {"object": "text_completion", "choices": [{"text": ...}]}
    usage       {"choices": [], "usage": {...}} when `stream_options.include_usage` is set
    error       {"error": {"message": ...}} sent after the stream started (a failed request)
dialspec adds `"dialspec": {...}` (per-request speculative stats) to the usage chunk, or to the
last chunk with choices when usage was not requested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE = "[DONE]"


class MalformedStream(ValueError):
    """The response is not a well-formed OpenAI SSE stream."""


class SSEDecoder:
    """Incremental line-based decoder: feed lines (without their newline), get event data back."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line in; the data of a completed event out (on the blank line that ends it)."""
        line = line.rstrip("\r")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # comment / ping
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        return None  # event/id/retry and unknown fields are ignored, as the spec says

    def flush(self) -> str | None:
        """End of body: an unterminated last event still counts (servers often omit the blank line)."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclass
class Chunk:
    """What one SSE event means to the load generator."""

    done: bool = False  # the `[DONE]` sentinel
    text: str = ""  # output text carried by this chunk (all choices joined)
    has_choices: bool = False
    finish_reason: str | None = None
    usage: dict | None = None
    dialspec: dict | None = None
    error: dict | None = None  # an in-stream error object


def parse_event(data: str) -> Chunk:
    """Interpret one event's data; raises MalformedStream when it is not an OpenAI chunk."""
    if data.strip() == DONE:
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        raise MalformedStream(f"event data is not JSON ({exc.msg}): {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise MalformedStream(f"event data is not a JSON object: {data[:80]!r}")
    if "error" in obj:
        err = obj["error"]
        return Chunk(error=err if isinstance(err, dict) else {"message": str(err)})
    choices = obj.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise MalformedStream("'choices' is not a list")
    parts: list[str] = []
    finish = None
    for choice in choices:
        if not isinstance(choice, dict):
            raise MalformedStream("a choice is not an object")
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if content is not None and not isinstance(content, str):
            raise MalformedStream("choice content is not a string")
        if content:
            parts.append(content)
        finish = choice.get("finish_reason") or finish
    usage = obj.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise MalformedStream("'usage' is not an object")
    ext = obj.get("dialspec")
    return Chunk(
        text="".join(parts),
        has_choices=bool(choices),
        finish_reason=finish,
        usage=usage,
        dialspec=ext if isinstance(ext, dict) else None,
    )
