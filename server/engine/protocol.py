"""The one small protocol every engine implements (embedded torch engine, SGLang client).

The gateway speaks only this module's types: no torch, no tokenizer internals. The ensemble
weight travels one path: HTTP body -> `verifier.dial.resolve` (quality -> `Verification`) ->
`GenerationRequest` -> the engine's per-row tensor -> `verifier.verify` (docs/architecture.md).

Cancellation: closing the async iterator returned by `Engine.generate` (e.g. `aclose()`, or the
consuming task being cancelled) aborts the request and frees its batch row and cache at once.

Faults: an engine fails only the request(s) that caused a fault (EngineError kind 'internal');
one it cannot recover from is its `fault` (see `engine_fault`), after which it never generates
again and the serving process should exit non-zero so that a supervisor restarts it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, runtime_checkable

from verifier.dial import DEFAULT_AUTO_DIAL, PolicyKind, Verification

FinishReason = Literal["stop", "length", "abort"]
# Where an emitted token came from: an accepted draft, the correction drawn at the first rejection,
# the bonus drawn from ν after N accepted drafts (also at N = 0 when w < 1), or the target alone
# (p at N = 0: autoregressive requests, w = 1 rows in rounds without drafts).
TokenSource = Literal["draft", "corrected", "bonus", "target"]


ErrorKind = Literal["invalid_request", "capacity", "unavailable", "internal"]


class EngineError(Exception):
    """A request the engine cannot serve; `kind` maps to an HTTP status in the gateway
    (invalid_request 400, capacity 429, unavailable 503, internal 500: the engine faulted on this
    request and dropped it, and goes on serving the others)."""

    def __init__(self, message: str, kind: ErrorKind):
        super().__init__(message)
        self.kind = kind


# Sampling values every engine can honour (`check_sampling`).
# Below MIN_TEMPERATURE sampling is greedy (vLLM's and SGLang's convention): logits / t overflows
# float32 for tiny t (1e-50 is 0 in float32), and at t = 1e-5 a logit gap of 0.001 is already
# e^-100 apart, so the draw is the argmax anyway.
MIN_TEMPERATURE = 1e-5
# top_p below this keeps exactly the most likely token, as any top_p <= 1/V does (that token alone
# has mass >= 1/V), for vocabularies up to 10^7 tokens; flooring it keeps the value representable
# in float32 (5e-324 is 0 there, which the sampling transform refuses).
MIN_TOP_P = 1e-7
MAX_TOP_K = 2**31 - 1  # any top_k >= V keeps every token; bigger values overflow int32 kernels
# Log-probs (`GenerationRequest.logprobs`): at most this many alternatives per token (OpenAI's
# limit), and the value reported for a token the law gives no mass (JSON has no -inf; OpenAI's).
MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Same seed + same request -> same output on one embedded engine, batched or alone, under any
    # load: a seeded (or greedy) row's adaptive N is its tier's, from the start-up profile (README, "Seeds").
    seed: int | None = None
    ignore_eos: bool = False  # keep going past EOS (benchmarks); explicit stop_token_ids still stop


def _number(value, name: str, integer: bool = False):
    # bool is an int in Python, but `seed: false` is a client bug, not seed 0
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def check_sampling(s: SamplingOptions, vocab_size: int | None = None) -> SamplingOptions:
    """`s` as an engine can honour it, or ValueError naming the field. Normalises, without changing
    what is sampled: temperature below MIN_TEMPERATURE -> 0 (greedy); top_p below MIN_TOP_P ->
    MIN_TOP_P; top_k >= `vocab_size` -> 0 (off)."""
    temperature = _number(s.temperature, "temperature")
    top_p = _number(s.top_p, "top_p")
    top_k = _number(s.top_k, "top_k", integer=True)
    max_tokens = _number(s.max_tokens, "max_tokens", integer=True)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if s.seed is not None and not SEED_RANGE[0] <= _number(s.seed, "seed", integer=True) <= SEED_RANGE[1]:
        raise ValueError(f"seed must lie in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {s.seed}")
    for t in s.stop_token_ids:
        if _number(t, "stop_token_ids", integer=True) < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab_size}), got {t}")
    if top_k > MAX_TOP_K or (vocab_size is not None and top_k >= vocab_size):
        top_k = 0
    return replace(
        s,
        temperature=0.0 if temperature < MIN_TEMPERATURE else float(temperature),
        top_p=max(float(top_p), MIN_TOP_P),
        top_k=top_k,
    )


def logprobs_refusal(count, verify: Verification) -> str | None:
    """Why log-probs with `count` alternatives cannot be served for `verify`, or None. The law is
    reported for the ensemble (ν) and the target alone; a baseline policy's tokens follow neither."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TOP_LOGPROBS:
        return f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives), got {count!r}"
    if verify.policy != PolicyKind.ENSEMBLE and verify.mode != "autoregressive":
        return (
            f"logprobs are reported for the ensemble verifier only: the {verify.policy.name.lower()} "
            "baseline's tokens follow no law the server reports"
        )
    return None


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the output (OpenAI's `response_format`): `json_object` (any JSON object) or
    `json_schema` (`schema`, the JSON Schema as compact JSON text: hashable, the compile cache's key)."""

    kind: Literal["json_object", "json_schema"]
    schema: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    verify: Verification = field(default_factory=Verification)
    # Report each token's provenance (`GenerationChunk.provenance`). Only engines whose
    # `info.token_provenance` is True honour it; the gateway refuses it (400) for the others.
    trace: bool = False
    # Report each token's log-probability under the law it was drawn from, with the `logprobs`
    # most likely tokens of that law (0..MAX_TOP_LOGPROBS; None = no log-probs): ν at its position
    # (p where the token was drawn from the target's p, q in draft-only rounds). Only engines whose
    # `info.token_logprobs` is True honour it; the gateway refuses it (400) for the others.
    logprobs: int | None = None
    # Constrain the output (`info.structured_output` engines; the gateway refuses it elsewhere).
    response_format: ResponseFormat | None = None


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
    # Rounds without drafts of a w < 1 request whose token came from p, not ν: drafting did not
    # pay there and the planner fell back to plain decoding (`server.engine.embedded.row.RowMode.draws_nu`).
    target_only_rounds: int = 0
    # Tokens drawn from the draft alone: quality 0 (a static w = 0, where ν = q) never runs the
    # target (`draft_only.py`); such tokens are neither proposed nor verified.
    draft_only_tokens: int = 0

    def snapshot(self) -> SpecStats:
        """A copy for one chunk (the row goes on counting); a fifth of `copy.deepcopy`'s host time."""
        return replace(self, accepted_per_position=list(self.accepted_per_position))

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
    that rejected the draft there; for a bonus, the w of ν it was drawn from (after N accepted
    drafts, or at N = 0 for a row with w < 1), or 1 where it was drawn from p (an adaptive row's
    bonus unless `--strict-nu`: p is ν at w = 1). None where no w applies: target tokens are drawn
    from p alone, and baseline policies (lossy, cascade, typical) have no w.
    """

    source: TokenSource
    text: str  # the part of the chunk's text released with this token ("" while it is held back)
    weight: float | None
    position: int  # index in its round: drafts 0..k-1, then the correction (k < N) or bonus (N)
    num_draft: int  # N of its round (0 = autoregressive)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the law it was drawn from (requests with `logprobs`):
    its text (UTF-8, invalid bytes replaced), its own bytes (tokens may split a character), the
    log-probability (LOGPROB_FLOOR where the law gives it no mass) and, for emitted tokens, the
    law's most likely tokens (ties in no set order)."""

    token: str
    token_bytes: tuple[int, ...]
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


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
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, only for `logprobs` requests


@dataclass(frozen=True)
class EngineInfo:
    model: str  # the pair's served name
    max_context: int  # prompt + completion tokens
    max_batch: int
    num_draft: int  # default N (the largest N when it is chosen per round)
    has_head: bool  # learned w_t available ("auto" quality)
    backend: str  # "embedded" or "sglang"
    auto_dial: float = DEFAULT_AUTO_DIAL  # the loaded head's default dial point (quality "auto")
    adaptive_draft: bool = False  # N is chosen per request and round from measured costs
    # Filled when the engine starts (JSON-ready, for /ready or a debug endpoint): the dtype and
    # how it was chosen, the draft-length mode, the measured cost model (ms per stage), the
    # `system_fingerprint` and what it was made of.
    runtime: dict = field(default_factory=dict, compare=False, hash=False)
    # Optional limits a gateway publishes and checks before the engine sees a request:
    max_num_draft: int | None = None  # largest per-request N; None = num_draft (N is fixed)
    vocab_size: int | None = None  # token ids lie in [0, vocab_size); None = unknown
    # Longest token in UTF-8 bytes, set only when tokenization provably yields at least
    # ceil(bytes / max_token_bytes) tokens for any text (byte-level BPE, no normalizer): a prompt
    # whose byte length alone exceeds the context can then be refused without tokenizing it.
    max_token_bytes: int | None = None

    token_provenance: bool = False  # honours `GenerationRequest.trace` (per-token provenance)
    token_logprobs: bool = False  # honours `GenerationRequest.logprobs` (log-probs of the law drawn from)
    structured_output: bool = False  # honours `GenerationRequest.response_format` at every quality
    # What this backend can do (a request asking for more is refused, never silently served as less):
    policies: tuple[PolicyKind, ...] = tuple(PolicyKind)  # rules Verification.policy may name

    @property
    def system_fingerprint(self) -> str | None:
        """OpenAI's `system_fingerprint`, set when the engine starts (`runtime`): one id for what
        decides a seeded request's output (the embedded engine's `fingerprint.py`). None: the
        backend makes no such promise (SGLang)."""
        return self.runtime.get("system_fingerprint")

    @property
    def num_draft_limit(self) -> int:
        return self.max_num_draft if self.max_num_draft is not None else self.num_draft

    @property
    def per_request_num_draft(self) -> bool:
        """Verification.num_draft is honoured; False: only the default N (max_num_draft None)."""
        return self.max_num_draft is not None

    def unsupported(self, v: Verification) -> str | None:
        """Why this backend cannot serve `v` as asked (one line starting with the field), or None."""
        if v.mode != "speculative":
            return None  # the target alone: verification options do not apply
        if v.policy not in self.policies:
            names = ", ".join(k.wire for k in self.policies)
            return f"verifier: the {self.backend} backend serves {names} only, not {v.policy.wire}"
        if v.num_draft is not None and v.num_draft != self.num_draft and not self.per_request_num_draft:
            return (
                f"num_draft: the {self.backend} backend drafts a fixed N = {self.num_draft} (set at "
                "launch); omit num_draft"
            )
        if v.learned and not self.has_head:
            return f"quality: no learned head is loaded on the {self.backend} backend; 'auto' is not served"
        return None


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
class ReportsReadiness(Protocol):
    """What an engine says about readiness (part of the engine protocol; a separate class only so
    that an engine without it still satisfies `Engine` and counts as ready once started)."""

    async def readiness(self) -> str | None:
        """None when the engine can generate now; otherwise why not, in a short sentence (not
        started, failed, stopping, runtime unreachable). Must be cheap and must not raise."""
        ...


async def engine_readiness(engine) -> str | None:
    """`engine.readiness()`, or None (ready) for an engine without the method."""
    if isinstance(engine, ReportsReadiness):
        return await engine.readiness()
    return None


def engine_fault(engine) -> BaseException | None:
    """The unrecoverable fault of an engine that reports one (optional attribute `fault`)."""
    return getattr(engine, "fault", None)
