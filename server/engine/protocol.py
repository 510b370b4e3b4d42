"""The one small protocol every engine implements (embedded torch engine, SGLang client).

The gateway speaks only this module's types: no torch, no tokenizer internals. The ensemble
weight travels one path: HTTP body -> `verifier.dial.resolve` (quality -> `VerifyOptions`) ->
`GenerationRequest` -> the engine's per-row tensor -> `verifier.verify` (docs/architecture.md).

Cancellation: closing the async iterator returned by `Engine.generate` (e.g. `aclose()`, or the
consuming task being cancelled) aborts the request and frees its batch row and cache at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from verifier.dial import DEFAULT_AUTO_DIAL, Verification

# How a request's drafts are verified: owned by the dial (policy, static w, learned dial, N).
VerifyOptions = Verification
FinishReason = Literal["stop", "length", "abort"]
# Where an emitted token came from: an accepted draft, the correction drawn at the first rejection,
# the bonus drawn after N accepted drafts, or the target alone (autoregressive, N = 0).
TokenSource = Literal["draft", "corrected", "bonus", "target"]


class EngineError(Exception):
    """A request the engine cannot serve; `kind` maps to an HTTP status in the gateway."""

    def __init__(self, message: str, kind: Literal["invalid_request", "capacity", "unavailable"]):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # same seed + same request -> same output, batched or alone
    ignore_eos: bool = False  # keep going past EOS (benchmarks); explicit stop_token_ids still stop


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    # Report each token's provenance (`GenerationChunk.provenance`). Only engines whose
    # `info.token_provenance` is True honour it; the gateway refuses it (400) for the others.
    trace: bool = False


@dataclass
class SpecStats:
    """Per-request speculative counters (vLLM naming: a 'draft' is one proposal round)."""

    drafts: int = 0  # verify rounds that proposed at least one token
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # proposed tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # index i: accepted at position i
    weight_sum: float = 0.0  # sum of the w applied per verified position (for mean w)
    weight_count: int = 0
    verify_steps: int = 0  # target forwards (rounds) for this request

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted per round: tokens emitted per target forward."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def mean_weight(self) -> float | None:
        return self.weight_sum / self.weight_count if self.weight_count else None


@dataclass(frozen=True)
class TokenTrace:
    """The provenance of one emitted token (requests with `trace`).

    `weight` is the ensemble w applied at the token's position (the static w, or the learned
    head's w_t): for a draft, the w its acceptance test used; for a correction, the w of the test
    that rejected the draft there. None where no w applies: bonus and target tokens are drawn from
    p, and baseline policies (lossy, cascade, typical) have no w.
    """

    source: TokenSource
    text: str  # the part of the chunk's text released with this token ("" while it is held back)
    weight: float | None
    position: int  # index in its round: drafts 0..k-1, then the correction (k < N) or bonus (N)
    num_draft: int  # N of its round (0 = autoregressive)


@dataclass
class GenerationChunk:
    """Incremental output. Text deltas never split a multi-byte character."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int  # cumulative
    finish_reason: FinishReason | None = None  # set on the last chunk only
    stats: SpecStats | None = None  # cumulative; always set on the last chunk
    provenance: list[TokenTrace] | None = None  # one per token_ids entry, only for `trace` requests


@dataclass(frozen=True)
class EngineInfo:
    model: str  # the pair's served name
    max_context: int  # prompt + completion tokens
    max_batch: int
    num_draft: int  # default N
    has_head: bool  # learned w_t available ("auto" quality)
    backend: str  # "embedded" or "sglang"
    auto_dial: float = DEFAULT_AUTO_DIAL  # the loaded head's default dial point (quality "auto")
    token_provenance: bool = False  # honours `GenerationRequest.trace` (per-token provenance)


@runtime_checkable
class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Finish (drain) or abort in-flight work and release resources."""
        ...

    def encode_prompt(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Apply the pair's chat template (generation prompt appended) and tokenize."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks; raises EngineError (before the first chunk) if it cannot be served."""
        ...

    def load(self) -> dict[str, int]:
        """{'running': rows decoding now, 'waiting': admitted but not yet in the batch}."""
        ...
