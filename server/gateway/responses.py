"""Response bodies of the OpenAI-compatible API and the dialspec extensions, as documented in the
OpenAPI schema (the handlers build plain dicts of these shapes), and the error object."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DialspecQuality(BaseModel):
    """The quality a request was served at and the one it asked for (they differ only when the
    server ran brownout and the request allowed it with `min_quality`). A stream's first chunk
    carries this alone; the final report repeats it."""

    tier: str = Field(
        description="served: tier name, 'custom' for a numeric quality, 'auto', 'autoregressive'"
    )
    quality: float | None = Field(description="served quality (what the output was generated at)")
    requested_tier: str = Field(description="the tier asked for (same vocabulary as `tier`)")
    requested_quality: float | None = Field(description="the quality asked for")
    min_quality: float | None = Field(
        description="the lowest quality the request allowed (its `min_quality`, or its own quality); "
        "never above `quality`"
    )


class DialspecStats(DialspecQuality):
    """Per-request speculative decoding report (summed over choices)."""

    policy: str = Field(description="verifier policy, or 'autoregressive'")
    mean_w: float | None = Field(
        description="mean ensemble weight applied per verified position (and per draft-only token, w = 0)"
    )
    drafts: int = Field(description="verify rounds that proposed draft tokens")
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None = Field(description="accepted_tokens / draft_tokens")
    mean_accepted_length: float | None = Field(description="1 + accepted_tokens / drafts")
    verify_steps: int = Field(description="target forward passes")
    target_only_rounds: int = Field(
        0,
        description="rounds without drafts whose token came from the target's p, not ν: where drafting "
        "cannot pay, a w < 1 request falls back to plain decoding (never slower than quality 1)",
    )
    draft_only_tokens: int = Field(
        0,
        description="tokens drawn from the draft alone: at quality 0 (w = 0) ν is the draft's own "
        "distribution, so the target does not run (no proposals, no verification)",
    )
    accepted_per_position: list[int] = Field(
        description="index i: rounds whose draft at position i was accepted (divide by drafts for the "
        "acceptance by position); empty when the backend does not report it"
    )


class TraceToken(BaseModel):
    """One generated token's provenance (requests with `dialspec_trace: true`)."""

    token_id: int
    text: str = Field(description="the part of the choice's text released with this token (may be '')")
    source: Literal["draft", "corrected", "bonus", "target"] = Field(
        description="draft: a draft token the verifier accepted; corrected: drawn from the residual at "
        "the first rejection; bonus: drawn from ν after all N drafts were accepted; target: "
        "drawn from p in a round without drafts (autoregressive mode, w = 1, or a w < 1 request's "
        "fallback where drafting cannot pay)"
    )
    w: float | None = Field(
        description="ensemble weight applied at this position (static, or the learned head's w_t); "
        "null for target tokens and for baseline verifiers"
    )
    position: int = Field(description="index in its speculative round (0 = the round's first token)")
    num_draft: int = Field(description="draft length N of its round (0 = autoregressive)")


_LOGPROB_DOC = (
    "log-probability of the token under the law it was drawn from (ν at its position; p where the "
    "target alone drew it; q in draft-only rounds), after the sampling transform; -9999.0 where that "
    "law gives it no mass. SGLang backend: before top-k/top-p, and p at a round's bonus (the request's "
    "`logprobs` field says more)"
)


_FINGERPRINT_DOC = (
    "what decides a seeded request's output on this deployment (engine, model pair and head, dtype, "
    "device, CPU threads, torch, dialspec's code, the draft-length schedule): the same seed and the "
    "same system_fingerprint give the same output, in float32 whatever the load and batch; in "
    'bfloat16 the batch can change it (README, "Seeds"). null on the SGLang backend (no promise)'
)


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text (U+FFFD where it ends inside a character)")
    logprob: float = Field(description=_LOGPROB_DOC)
    bytes: list[int] | None = Field(description="the token's own UTF-8 bytes")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the law's most likely tokens (top_logprobs of them)")


class ChatLogprobs(BaseModel):
    """`logprobs` of a chat choice or chunk (requests with `logprobs: true`)."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """`logprobs` of a text-completion choice or chunk, in the legacy shape (requests with
    `logprobs: k`)."""

    tokens: list[str]
    token_logprobs: list[float] = Field(description=_LOGPROB_DOC)
    top_logprobs: list[dict[str, float]] = Field(description="per token, the law's k most likely tokens")
    text_offset: list[int] = Field(description="each token's offset, counted in the tokens' own text")


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: ChatLogprobs | None = Field(None, description="with `logprobs: true`")
    dialspec_trace: list[TraceToken] | None = Field(None, description="with `dialspec_trace: true`")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=_FINGERPRINT_DOC)
    choices: list[ChatChoice]
    usage: Usage
    dialspec: DialspecStats


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = Field(None, description="with `logprobs: k`")
    dialspec_trace: list[TraceToken] | None = Field(None, description="with `dialspec_trace: true`")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=_FINGERPRINT_DOC)
    choices: list[CompletionChoice]
    usage: Usage
    dialspec: DialspecStats


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = Field(description="set on a choice's last chunk: stop, length or abort")
    logprobs: ChatLogprobs | None = Field(None, description="with `logprobs: true`")
    dialspec_trace: list[TraceToken] | None = Field(None, description="with `dialspec_trace: true`")


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = Field(None, description="with `logprobs: k`")
    dialspec_trace: list[TraceToken] | None = Field(None, description="with `dialspec_trace: true`")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a chat stream (`choices` is empty on the final usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=_FINGERPRINT_DOC)
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    dialspec: DialspecStats | DialspecQuality | None = Field(
        None, description="the served quality on the first chunk; the full report on the last"
    )


class CompletionChunk(BaseModel):
    """One `data:` event of a text-completion stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = Field(None, description=_FINGERPRINT_DOC)
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    dialspec: DialspecStats | DialspecQuality | None = Field(
        None, description="the served quality on the first chunk; the full report on the last"
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dialspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TierMark(BaseModel):
    name: str
    quality: float


class DialInfo(BaseModel):
    """`GET /v1/dial`: the served pair and its dial, for clients that draw one (the playground)."""

    model: str = Field(description="the pair's served name")
    backend: str
    num_draft: int = Field(description="default draft length N")
    max_context: int
    tiers: list[TierMark] = Field(description="named qualities, ascending")
    default_quality: str | float
    has_head: bool = Field(description="a learned head is loaded: quality 'auto' is served")
    token_provenance: bool = Field(description="`dialspec_trace` is supported")


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    backend: str
    max_context: int
    num_draft: int = Field(description="the default N, or the largest N when adaptive_draft")
    adaptive_draft: bool = Field(description="N is chosen per request and round from measured costs")
    has_head: bool
    load: dict[str, int] = Field(description="running: sequences decoding; waiting: queued in the engine")


class EngineRuntime(BaseModel):
    backend: str
    runtime: dict[str, Any] = Field(
        description="dtype and how it was chosen, draft-length mode, live cost model (ms per stage), "
        "system_fingerprint and what it digests (fingerprint_of); {} from engines that report nothing"
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
