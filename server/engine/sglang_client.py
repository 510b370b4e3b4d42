"""The gateway's SGLang engine: `server.engine.protocol.Engine` over HTTP to an SGLang runtime.

Terms
    runtime   an SGLang server (`python -m sglang.launch_server`, see `dialspec runtime`) with the
              dialspec plugin on, or an SGLang router in front of several; both serve the
              native `POST /generate` and `GET /health`, so this client does not care which.
    chunk     one streamed `data: {...}` line of `/generate`: SGLang 0.5.23 sends the cumulative
              `text` and `output_ids` so far plus `meta_info` (`prompt_tokens`,
              `completion_tokens`, `finish_reason` as `{"type": "stop"|"length"|"abort", ...}`
              or null, and on speculative servers `spec_verify_ct`, `spec_num_correct_drafts`,
              `spec_num_proposed_drafts`, `spec_accept_rate`, `spec_accept_length`); the stream
              ends with `data: [DONE]`; errors inside a stream arrive as `{"error": {...}}`.

The dial travels as `sampling_params.custom_params` (`server.sglang_plugin.params`), which the
plugin reads per row inside the verify step. Prompts are tokenized here with the pair's local
tokenizer (the same chat template as the embedded engine) and sent as `input_ids`, so the
runtime and the gateway agree on prompt token counts.

No torch import: transformers' tokenizer is imported lazily, on first use.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from server.engine.protocol import (
    EngineError,
    EngineInfo,
    GenerationChunk,
    GenerationRequest,
    SpecStats,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# U+FFFD at the end of cumulative text is an incomplete multi-byte character being decoded;
# holding it back keeps the promise that a text delta never splits a character.
_REPLACEMENT = "\ufffd"


def sampling_params_for(request: GenerationRequest) -> dict[str, Any]:
    """SGLang `sampling_params` for a dialspec request (SGLang names; -1 top_k = off)."""
    s, v = request.sampling, request.verify
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "max_new_tokens": s.max_tokens,
        "custom_params": v.validate().to_custom_params(),  # the plugin reads these keys
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    return out


def stats_from_meta(meta: dict[str, Any], weight: float) -> SpecStats:
    """Per-request speculative counters from SGLang's `meta_info` (zeros when it sent none).

    SGLang counts proposals as verify rounds × N, so `drafts` = `spec_verify_ct`. It reports no
    per-position acceptance, so `accepted_per_position` stays empty. The mean weight is the
    request's static w (a learned head's per-token w is not reported back by the runtime).
    """
    rounds = int(meta.get("spec_verify_ct") or 0)
    proposed = int(meta.get("spec_num_proposed_drafts") or 0)
    return SpecStats(
        drafts=rounds,
        draft_tokens=proposed,
        accepted_tokens=int(meta.get("spec_num_correct_drafts") or 0),
        weight_sum=weight * proposed,
        weight_count=proposed,
        verify_steps=rounds,
    )


def _error_message(body: bytes | str) -> str:
    """SGLang error bodies: `{"error": {"message": ...}}`, `{"message": ...}` or plain text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "no detail"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return text[:500]


def _kind_for_status(status: int) -> str:
    if status in (400, 404, 413, 422):
        return "invalid_request"
    if status == 429:
        return "capacity"
    return "unavailable"


class SGLangEngine:
    """`Engine` backed by an SGLang runtime or router at `base_url` (e.g. http://gpu-0:30000)."""

    def __init__(
        self,
        base_url: str,
        tokenizer_dir: str,
        *,
        model: str = "dialspec-pair",
        num_draft: int = 5,
        max_context: int = 4096,
        max_batch: int = 48,
        has_head: bool = False,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.tokenizer_dir = tokenizer_dir
        self.info = EngineInfo(
            model=model,
            max_context=max_context,
            max_batch=max_batch,
            num_draft=num_draft,
            has_head=has_head,
            backend="sglang",
        )
        # read_timeout bounds the gap between two chunks (and the wait for the first one).
        self._timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._tokenizer = None
        self._running = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the connection pool and check `/health`; EngineError('unavailable') if down."""
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=self._timeout, headers=self._headers, transport=self._transport
        )
        try:
            resp = await self._client.get("/health")
        except httpx.HTTPError as exc:
            await self.stop()
            raise EngineError(
                f"SGLang runtime at {self.base_url} unreachable: {exc!r}", "unavailable"
            ) from exc
        if resp.status_code != 200:
            await self.stop()
            raise EngineError(
                f"SGLang runtime at {self.base_url} unhealthy: HTTP {resp.status_code}", "unavailable"
            )

    async def stop(self) -> None:
        """Close the pool; open streams are cut, which makes SGLang abort those requests."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def load(self) -> dict[str, int]:
        """Requests this gateway has in flight; the runtime's own queue is not visible here."""
        return {"running": self._running, "waiting": 0}

    # -- tokenization ------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # lazy: keeps the gateway import light

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return self._tokenizer

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    # -- generation --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._client is None:
            raise EngineError("SGLang engine not started", "unavailable")
        body = {
            "input_ids": list(request.prompt_token_ids),
            "sampling_params": sampling_params_for(request),
            "stream": True,
            "rid": request.request_id,
        }
        weight = 1.0 if request.verify.mode == "autoregressive" else request.verify.weight
        state = _StreamState(prompt_tokens=len(request.prompt_token_ids), weight=weight)
        self._running += 1
        try:
            async with self._client.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    detail = _error_message(await resp.aread())
                    raise EngineError(
                        f"SGLang /generate HTTP {resp.status_code}: {detail}",
                        _kind_for_status(resp.status_code),
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = state.feed(json.loads(payload))
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
            # Stream ended without a finish_reason: the runtime dropped the request.
            if state.emitted_any:
                yield state.abort_chunk()
            else:
                raise EngineError("SGLang stream ended before any output", "unavailable")
        except httpx.TimeoutException as exc:
            raise EngineError(f"SGLang runtime timed out ({type(exc).__name__})", "unavailable") from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang runtime request failed: {exc!r}", "unavailable") from exc
        finally:
            self._running -= 1


class _StreamState:
    """Turns SGLang's cumulative chunks into dialspec's incremental ones."""

    def __init__(self, prompt_tokens: int, weight: float):
        self.prompt_tokens = prompt_tokens
        self.weight = weight
        self.text_sent = ""
        self.ids_sent = 0
        self.completion_tokens = 0
        self.meta: dict[str, Any] = {}
        self.emitted_any = False

    def feed(self, data: dict[str, Any]) -> GenerationChunk | None:
        if "error" in data:
            err = data["error"]
            message = err.get("message") if isinstance(err, dict) else str(err)
            code = err.get("code") if isinstance(err, dict) else None
            kind = _kind_for_status(code) if isinstance(code, int) else "invalid_request"
            if self.emitted_any:
                return self.abort_chunk()
            raise EngineError(f"SGLang: {message}", kind)
        meta = data.get("meta_info") or {}
        self.meta = meta
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        if finish_type == "abort" and not self.emitted_any and meta.get("completion_tokens", 0) == 0:
            status = finish.get("status_code") if isinstance(finish, dict) else None
            message = finish.get("message") if isinstance(finish, dict) else "aborted"
            raise EngineError(f"SGLang aborted the request: {message}", _kind_for_status(status or 400))
        text = data.get("text") or ""
        ids = list(data.get("output_ids") or [])
        self.prompt_tokens = int(meta.get("prompt_tokens", self.prompt_tokens))
        self.completion_tokens = int(meta.get("completion_tokens", len(ids)))
        visible = text if finish_type else text.rstrip(_REPLACEMENT)
        # If the detokenizer ever revises earlier text (rare), only what lies past the old length
        # is sent: a client cannot take back text it has already shown.
        delta_text = visible[len(self.text_sent) :]
        if len(visible) > len(self.text_sent):
            self.text_sent = visible
        delta_ids = ids[self.ids_sent :]
        self.ids_sent = max(self.ids_sent, len(ids))
        if not delta_text and not delta_ids and finish_type is None:
            return None
        self.emitted_any = True
        return GenerationChunk(
            text=delta_text,
            token_ids=delta_ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason=_FINISH.get(finish_type) if finish_type else None,
            stats=stats_from_meta(meta, self.weight) if finish_type else None,
        )

    def abort_chunk(self) -> GenerationChunk:
        return GenerationChunk(
            text="",
            token_ids=[],
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason="abort",
            stats=stats_from_meta(self.meta, self.weight),
        )
