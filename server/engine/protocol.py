"""The one small protocol every engine implements (embedded torch engine, SGLang client).

The gateway speaks only this module's types: no torch, no tokenizer internals. The ensemble
weight travels one path: HTTP body -> dial (quality -> `VerifyOptions`) -> `GenerationRequest`
-> the engine's per-row tensor -> `verifier.verify`.

Cancellation: closing the async iterator returned by `Engine.generate` (e.g. `aclose()`, or the
consuming task being cancelled) aborts the request and frees its batch row and cache at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

PolicyName = Literal["ensemble", "lossy", "cascade", "typical"]
ALL_POLICIES: tuple[PolicyName, ...] = ("ensemble", "lossy", "cascade", "typical")
Mode = Literal["speculative", "autoregressive"]
FinishReason = Literal["stop", "length", "abort"]


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
class VerifyOptions:
    """How drafts are verified for this request (see verifier.policies)."""

    mode: Mode = "speculative"
    policy: PolicyName = "ensemble"
    weight: float = 1.0  # ensemble w on the target; 1 = lossless
    learned: bool = False  # per-token w_t from the learned head (weight is then the dial input)
    lenience: float = 0.5  # lossy
    alpha: float = 0.5  # cascade
    num_draft: int | None = None  # N; None = engine default


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)


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


@dataclass
class GenerationChunk:
    """Incremental output. Text deltas never split a multi-byte character."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int  # cumulative
    finish_reason: FinishReason | None = None  # set on the last chunk only
    stats: SpecStats | None = None  # cumulative; always set on the last chunk


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves and what it can honour per request (its capabilities).

    The capability fields default to the embedded engine's; a backend that cannot do something
    says so here and refuses such requests with EngineError('invalid_request'), so the gateway
    can validate against them instead of an option being dropped silently.
    """

    model: str  # the pair's served name
    max_context: int  # prompt + completion tokens
    max_batch: int
    num_draft: int  # default N
    has_head: bool  # learned w_t available ("auto" quality, VerifyOptions.learned)
    backend: str  # "embedded" or "sglang"
    policies: tuple[PolicyName, ...] = ALL_POLICIES  # verification rules VerifyOptions.policy may name
    per_request_num_draft: bool = True  # VerifyOptions.num_draft honoured (else only the default N)
    max_num_draft: int = 8  # largest N a request may ask for (= num_draft when not per request)


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


@runtime_checkable
class ReadinessProbe(Protocol):
    """Optional engine method: whether the engine can serve correctly right now.

    Engines whose correctness depends on something outside the process (the SGLang engine: a
    runtime with dialspec's plugin live) implement it; the embedded engine does not need to.
    It must answer quickly (from a cached probe result), never raise, and return None when
    ready or a one-line reason when not.
    """

    async def readiness(self) -> str | None: ...


async def engine_readiness(engine: object) -> str | None:
    """`engine.readiness()` where the engine implements it; None (ready) otherwise."""
    if isinstance(engine, ReadinessProbe):
        return await engine.readiness()
    return None
