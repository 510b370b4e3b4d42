"""OpenAI request body -> the engine's GenerationRequests, in two parts so that no CPU-heavy work
runs on the event loop:

    plan(...)       on the loop, cheap: model name, dial, choice count, sampling options, and the
                    prompt-length bound below. Everything that can refuse a request without
                    tokenizing it refuses it here, before it takes an admission slot.
    tokenize(...)   blocking (the gateway runs it on a worker thread, after admission).
    build(...)      cheap: exact prompt lengths against the context window, one request per choice.

Terms:
    prompt tokens   the prompt after the chat template (chat) or as given (completions).
    context window  EngineInfo.max_context = prompt tokens + completion tokens.
    length bound    with EngineInfo.max_token_bytes = L (byte-level BPE without a normalizer), a
                    text of b UTF-8 bytes tokenizes to at least ceil(b / L) tokens (embedded.py,
                    `max_token_bytes`), so a prompt whose bound alone exceeds the context is
                    refused without tokenizing it. For chat the bound counts the messages'
                    content only; it holds for chat templates that render every message's content
                    (the pair's template, and the usual ones, do).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, replace

from server.engine.protocol import (
    Engine,
    EngineInfo,
    GenerationRequest,
    ResponseFormat,
    SamplingOptions,
    check_sampling,
    logprobs_refusal,
)
from server.gateway.errors import APIError, bad_request
from server.gateway.schemas import ChatCompletionRequest, CompletionRequest
from verifier.dial import (
    DialConfig,
    DialError,
    DialPoint,
    PolicyKind,
    resolve,
    resolve_floor,
    tier_from_model_name,
)

_SEED_MOD = 2**63  # choice j of a seeded request uses seed + j, kept in int64 range


@dataclass
class Plan:
    """Everything decided about a request before its prompts are tokenized."""

    kind: str  # "chat" or "completion"
    request_id: str
    created: int
    model: str  # echoed back as the client sent it
    dial: DialPoint  # as requested; the gateway swaps in the served point at admission (brownout)
    floor: float | None  # min_quality: the lowest quality it may be served at (None: not lowerable)
    n: int
    choices: int  # n x prompts: the admission slots it takes
    requested: int | None  # max_tokens as sent (None: the server default, capped by the context)
    max_param: str  # which field `requested` came from
    sampling: SamplingOptions  # normalised (protocol.check_sampling); max_tokens and seed set per choice
    stream: bool
    include_usage: bool
    trace: bool  # dialspec_trace: per-token provenance on every choice
    logprobs: int | None = None  # alternatives per token when log-probs are asked for
    response_format: ResponseFormat | None = None  # the output's constraint (None: free text)


@dataclass
class Prepared:
    kind: str
    request_id: str
    created: int
    model: str
    dial: DialPoint
    requests: list[GenerationRequest]  # one per choice, in choice-index order
    prompt_tokens: int  # distinct prompts, each counted once
    stream: bool
    include_usage: bool


def _model_tier(name: str, engine: Engine, config: DialConfig) -> str | None:
    try:
        return tier_from_model_name(name, engine.info.model, config, engine.info.has_head)
    except LookupError:
        raise APIError(
            404,
            f"The model '{name}' does not exist; GET /v1/models lists the served names",
            param="model",
            code="model_not_found",
        ) from None


def resolve_dial(body, engine: Engine, config: DialConfig) -> DialPoint:
    """The request's dial fields (body and model name) -> DialPoint, or a 400 naming the field.
    `num_draft` is checked against the engine's limit (EngineInfo.num_draft_limit) by the dial."""
    info = engine.info
    try:
        point = resolve(
            body.quality,
            model_tier=_model_tier(body.model, engine, config),
            policy=PolicyKind.parse(body.verifier) if body.verifier else PolicyKind.ENSEMBLE,
            mode=body.mode or "speculative",
            num_draft=body.num_draft,
            config=config,
            head_dial=info.auto_dial if info.has_head else None,
        )
        point.verification.validate(info.num_draft_limit)
    except DialError as exc:
        raise bad_request(str(exc), exc.param, code=exc.code) from None
    reason = info.unsupported(point.verification)  # the backend's capabilities (EngineInfo)
    if reason is not None:
        raise bad_request(reason, reason.split(":", 1)[0], code="unsupported_by_backend")
    return point


def _context_error(
    info: EngineInfo, tokens: int, requested: int | None, param: str, max_param: str, at_least=""
):
    if requested is None or tokens >= info.max_context:
        return bad_request(
            f"This model's maximum context length is {info.max_context} tokens; the prompt has "
            f"{at_least}{tokens} tokens. Shorten the {param}.",
            param,
            code="context_length_exceeded",
        )
    return bad_request(
        f"This model's maximum context length is {info.max_context} tokens. However, you "
        f"requested {at_least}{tokens + requested} tokens ({at_least}{tokens} in the {param}, "
        f"{requested} for the completion). Reduce the {param} or {max_param}.",
        max_param,
        code="context_length_exceeded",
    )


def _fits(info: EngineInfo, tokens: int, requested: int | None) -> bool:
    return tokens < info.max_context and (requested is None or tokens + requested <= info.max_context)


def _min_prompt_tokens(kind: str, body, info: EngineInfo) -> int:
    """The largest lower bound on any prompt's token count that needs no tokenizer (0: none)."""
    bound = 0
    if kind == "completion":
        for p in body.prompts():
            if not isinstance(p, str):
                bound = max(bound, len(p))  # token ids: exact
            elif info.max_token_bytes:
                bound = max(bound, math.ceil(len(p.encode("utf-8")) / info.max_token_bytes))
    elif info.max_token_bytes:
        size = sum(len(m.text().encode("utf-8")) for m in body.messages)
        bound = math.ceil(size / info.max_token_bytes)
    return bound


def plan(
    kind: str, body: ChatCompletionRequest | CompletionRequest, engine: Engine, settings, max_choices: int
) -> Plan:
    """The cheap checks (no tokenizer): a 4xx APIError, or the request's Plan."""
    info = engine.info
    config = settings.dial_config()
    dial = resolve_dial(body, engine, config)
    try:
        floor = resolve_floor(body.min_quality, dial, config)
    except DialError as exc:
        raise bad_request(str(exc), exc.param, code=exc.code) from None
    choices = body.prompt_count() * body.n
    if choices > max_choices:
        raise bad_request(
            f"this request asks for {choices} sequences (n x prompts); the limit is {max_choices}", "n"
        )
    requested = body.max_tokens
    if kind == "chat" and body.max_completion_tokens is not None:
        requested = body.max_completion_tokens  # the newer name wins when both are sent
    max_param = "max_completion_tokens" if kind == "chat" and body.max_completion_tokens else "max_tokens"
    prompt_param = "messages" if kind == "chat" else "prompt"

    bound = _min_prompt_tokens(kind, body, info)
    if not _fits(info, bound, requested):
        at_least = "" if kind == "completion" and not info.max_token_bytes else "at least "
        raise _context_error(info, bound, requested, prompt_param, max_param, at_least)

    sampling = SamplingOptions(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        max_tokens=requested or 1,
        stop=tuple(body.stop or ()),
        seed=body.seed,
    )
    try:
        sampling = check_sampling(sampling, info.vocab_size)
    except ValueError as exc:  # the schema's ranges make this rare; the message starts with the field
        raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from None
    if body.dialspec_trace and not info.token_provenance:  # never made up from aggregate counters
        raise bad_request(
            f"dialspec_trace is not supported: the {info.backend} backend does not report per-token "
            "provenance; remove dialspec_trace from the request",
            "dialspec_trace",
            code="trace_unsupported",
        )
    logprobs = body.logprobs_count()
    if logprobs is not None:
        _check_logprobs(logprobs, dial, info)
    response_format = _response_format(body, info)
    rid = uuid.uuid4().hex
    return Plan(
        kind=kind,
        request_id=rid,
        created=int(time.time()),
        model=body.model,
        dial=dial,
        floor=floor,
        n=body.n,
        choices=choices,
        requested=requested,
        max_param=max_param,
        sampling=sampling,
        stream=body.stream,
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        trace=body.dialspec_trace,
        logprobs=logprobs,
        response_format=response_format,
    )


def _response_format(body, info: EngineInfo) -> ResponseFormat | None:
    """The body's output constraint for the engine (None for free text); 400 where the backend
    cannot honour it (never served unconstrained)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if not info.structured_output:
        why = (
            "the grammar engine is not installed (pip install 'dialspec[structured]')"
            if info.backend == "embedded"
            else "its verifier does not mask the draft's q yet"
        )
        raise bad_request(
            f"response_format is not supported by this {info.backend} backend: {why}; remove "
            "response_format from the request",
            "response_format",
            code="response_format_unsupported",
        )
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    schema = json.dumps(fmt.json_schema.schema_, sort_keys=True, separators=(",", ":"))
    return ResponseFormat("json_schema", schema)


def _check_logprobs(count: int, dial: DialPoint, info: EngineInfo) -> None:
    """Log-probs only where the backend reports the law each token was drawn from (never made up)."""
    if not info.token_logprobs:
        raise bad_request(
            f"logprobs are not supported: the {info.backend} backend does not report the law each token "
            "was drawn from; remove logprobs from the request",
            "logprobs",
            code="logprobs_unsupported",
        )
    why = logprobs_refusal(count, dial.verification)
    if why:
        raise bad_request(why, "logprobs")


def tokenize(kind: str, body, engine: Engine) -> list[list[int]]:
    """Token ids per prompt (blocking: run it off the event loop)."""
    if kind == "chat":
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        try:
            return [list(engine.encode_chat(messages))]
        except Exception as exc:  # a template that rejects the conversation (role order, ...)
            raise bad_request(
                f"could not apply the chat template: {type(exc).__name__}", "messages"
            ) from None
    return [engine.encode_prompt(p) if isinstance(p, str) else list(p) for p in body.prompts()]


def build(p: Plan, prompts: list[list[int]], info: EngineInfo, settings) -> Prepared:
    """One GenerationRequest per choice, after the exact prompt lengths are known."""
    prompt_param = "messages" if p.kind == "chat" else "prompt"
    requests = []
    for k, ids in enumerate(prompts):
        if not ids:
            raise bad_request("the prompt is empty", prompt_param)
        if not _fits(info, len(ids), p.requested):
            raise _context_error(info, len(ids), p.requested, prompt_param, p.max_param)
        room = info.max_context - len(ids)
        max_tokens = p.requested if p.requested is not None else min(settings.default_max_tokens, room)
        for j in range(p.n):
            seed = None if p.sampling.seed is None else (p.sampling.seed + j) % _SEED_MOD
            requests.append(
                GenerationRequest(
                    request_id=f"{p.request_id}-{k}-{j}",
                    prompt_token_ids=tuple(ids),
                    sampling=replace(p.sampling, max_tokens=max_tokens, seed=seed),
                    verify=p.dial.verification,
                    trace=p.trace,
                    logprobs=p.logprobs,
                    response_format=p.response_format,
                )
            )
    return Prepared(
        kind=p.kind,
        request_id=("chatcmpl-" if p.kind == "chat" else "cmpl-") + p.request_id,
        created=p.created,
        model=p.model,
        dial=p.dial,
        requests=requests,
        prompt_tokens=sum(len(x) for x in prompts),
        stream=p.stream,
        include_usage=p.include_usage,
    )
