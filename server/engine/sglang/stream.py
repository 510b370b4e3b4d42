"""Decoding SGLang 0.5.23's `/generate` stream into dialspec chunks (used by `sglang_client`).

A streamed chunk carries the cumulative `text` and `output_ids` so far plus `meta_info`
(`prompt_tokens`, `completion_tokens`, `finish_reason` as `{"type": "stop"|"length"|"abort", ...}`
or null, and on speculative servers the `spec_*` counters); `StreamState` turns them into
deltas. Requests sent with `return_logprob` also get, cumulative like the ids,
`output_token_logprobs` (one `[logprob, token_id, text]` per output token; `text` is null unless
`return_text_in_logprobs`, and a −inf log-prob arrives as null: SGLang writes JSON with orjson) and,
with `top_logprobs_num` k > 0, `output_top_logprobs` (per output token, its k most likely
`[logprob, token_id, text]`, or null). No torch import.
"""

from __future__ import annotations

import json
import math
from typing import Any

from server.engine.protocol import LOGPROB_FLOOR, EngineError, GenerationChunk, SpecStats, TokenLogprob
from server.engine.token_bytes import TokenBytes

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# U+FFFD at the end of cumulative text is an incomplete multi-byte character being decoded;
# holding it back keeps the promise that a text delta never splits a character.
_REPLACEMENT = "\ufffd"


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


def _logprob_value(value) -> float:
    """SGLang's log-prob as dialspec reports it: null (orjson's −inf) and anything below the floor
    read LOGPROB_FLOOR, as on the embedded engine (JSON has no −inf)."""
    if value is None or value == -math.inf:
        return LOGPROB_FLOOR
    if not isinstance(value, int | float) or math.isnan(value) or value == math.inf:
        raise EngineError(f"SGLang reported a log-probability of {value!r}", "internal")
    return max(float(value), LOGPROB_FLOOR)


def logprobs_from_meta(
    meta: dict[str, Any], ids: list[int], start: int, top_k: int, token_bytes: TokenBytes
) -> list[TokenLogprob]:
    """`TokenLogprob`s of output tokens `ids[start:]` from SGLang's cumulative `meta_info` lists
    (module doc), each with its law's `top_k` most likely tokens; texts and bytes from the pair's
    tokenizer. A runtime that reports fewer entries than tokens, or another token, is an error:
    never a log-prob silently attached to the wrong token."""
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    if len(chosen) < len(ids) or (top_k and len(tops) < len(ids)):
        raise EngineError(
            f"SGLang returned log-probs for {len(chosen)} of {len(ids)} output tokens "
            f"({len(tops)} top-k lists)",
            "internal",
        )
    out = []
    for i in range(start, len(ids)):
        value, token_id = chosen[i][0], chosen[i][1]
        if token_id != ids[i]:
            raise EngineError(f"SGLang's log-prob {i} is for token {token_id}, not {ids[i]}", "internal")
        top = tuple(
            TokenLogprob(*token_bytes(alt[1]), _logprob_value(alt[0])) for alt in (tops[i] or [])[:top_k]
        ) if top_k else ()  # fmt: skip
        out.append(TokenLogprob(*token_bytes(token_id), _logprob_value(value), top))
    return out


def error_message(body: bytes | str) -> str:
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


def kind_for_status(status: int) -> str:
    if status in (400, 404, 413, 422):
        return "invalid_request"
    if status == 429:
        return "capacity"
    return "unavailable"


class StreamState:
    """Turns SGLang's cumulative chunks into dialspec's incremental ones."""

    def __init__(
        self,
        prompt_tokens: int,
        weight: float,
        logprobs: int | None = None,
        token_bytes: TokenBytes | None = None,
    ):
        """`logprobs`: the request's alternatives per token (None: no log-probs asked);
        `token_bytes` renders their tokens (needed with `logprobs`)."""
        self.prompt_tokens = prompt_tokens
        self.weight = weight
        self.logprobs = logprobs
        self.token_bytes = token_bytes
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
            kind = kind_for_status(code) if isinstance(code, int) else "invalid_request"
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
            raise EngineError(f"SGLang aborted the request: {message}", kind_for_status(status or 400))
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
        logprobs = None
        if self.logprobs is not None:
            logprobs = logprobs_from_meta(meta, ids, self.ids_sent, self.logprobs, self.token_bytes)
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
            logprobs=logprobs,
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
