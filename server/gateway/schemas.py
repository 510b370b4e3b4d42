"""Request and response bodies of the OpenAI-compatible API, plus the dialspec extensions.

Unknown fields are ignored (clients send `store`, `metadata`, ...), except those in `UNSUPPORTED`:
fields whose *absence* would change what the client gets back (tools, logprobs, response_format,
...) are rejected with a 400 naming the field instead of being silently dropped.

dialspec extensions (top level; the `openai` client's `extra_body` puts them there):
    quality   number in [0, 1], a tier name, or "auto" (see verifier/dial.py)
    verifier  "ensemble" (default) | "lossy" | "cascade" | "typical": baseline policies to compare
    mode      "speculative" (default) | "autoregressive": the target-only baseline
    num_draft draft length N for this request (engine default when absent)
    dialspec_trace  true: every choice (and every streamed chunk) carries `dialspec_trace`, one
              `TraceToken` per generated token: its source and the w applied at its position
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from verifier.dial import POLICY_NAMES

# field -> value(s) that are the same as not sending it (accepted and ignored)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "web_search_options": (None,),
}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # vLLM/SGLang extension; 0 = off
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # dialspec extensions
    # Strict types (JSON true is not 1); the range and tier names are checked once, by
    # verifier.dial.resolve, which names the field in its error.
    quality: StrictFloat | StrictInt | StrictStr | None = Field(
        None,
        description="dialspec: number in [0, 1] (1 = lossless), a tier name (lite, standard, pro, exact) "
        "or 'auto' (learned head). Default: the server's default_quality (exact).",
    )
    verifier: Literal[POLICY_NAMES] | None = Field(
        None, description="dialspec: verification policy; baselines are for comparison runs"
    )
    mode: Literal["speculative", "autoregressive"] | None = Field(
        None, description="dialspec: 'autoregressive' runs the target alone (speed baseline)"
    )
    num_draft: int | None = Field(None, ge=1, le=64, description="dialspec: draft length N for this request")
    dialspec_trace: StrictBool = Field(
        False,
        description="dialspec: report each token's provenance (draft / corrected / bonus / target) and "
        "the w applied at its position, as `dialspec_trace` in every choice and streamed chunk choice. "
        "Backends that cannot report it (SGLang) answer 400.",
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None:
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in value):
                raise ValueError("stop sequences must be non-empty strings")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ValueError(f"UNSUPPORTED:{name}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Common):
    # A string, token ids, or a batch of either (each prompt gets n choices).
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], list) and any(not p for p in value):
                raise ValueError("token-id prompts must not be empty")
            if isinstance(value[0], int) and any(t < 0 for t in value):
                raise ValueError("token ids must be non-negative")
        return value

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


# ---- responses (documented in the OpenAPI schema; handlers build plain dicts of this shape) ----


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DialspecStats(BaseModel):
    """Per-request speculative decoding report (summed over choices)."""

    policy: str = Field(description="verifier policy, or 'autoregressive'")
    tier: str = Field(description="tier name, 'custom' for a numeric quality, 'auto', 'autoregressive'")
    quality: float | None
    mean_w: float | None = Field(description="mean ensemble weight applied per verified position")
    drafts: int = Field(description="verify rounds that proposed draft tokens")
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None = Field(description="accepted_tokens / draft_tokens")
    mean_accepted_length: float | None = Field(description="1 + accepted_tokens / drafts")
    verify_steps: int = Field(description="target forward passes")
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
        "the first rejection; bonus: drawn from the target after all N drafts were accepted; target: "
        "autoregressive mode"
    )
    w: float | None = Field(
        description="ensemble weight applied at this position (static, or the learned head's w_t); "
        "null for bonus and target tokens (drawn from p) and for baseline verifiers"
    )
    position: int = Field(description="index in its speculative round (0 = the round's first token)")
    num_draft: int = Field(description="draft length N of its round (0 = autoregressive)")


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    finish_reason: str | None
    logprobs: None = None
    dialspec_trace: list[TraceToken] | None = Field(None, description="with `dialspec_trace: true`")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    dialspec: DialspecStats


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None
    dialspec_trace: list[TraceToken] | None = Field(None, description="with `dialspec_trace: true`")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    dialspec: DialspecStats


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
