"""OpenAI request body -> the engine's GenerationRequests, with every check that needs the engine
(model name, tokenized prompt length against the context window, max_tokens, choice count).

Terms:
    prompt tokens   the prompt after the chat template (chat) or as given (completions).
    context window  EngineInfo.max_context = prompt tokens + completion tokens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from server.engine.protocol import Engine, GenerationRequest, SamplingOptions
from server.gateway.errors import APIError, bad_request
from server.gateway.schemas import ChatCompletionRequest, CompletionRequest
from verifier.dial import DialConfig, DialError, DialPoint, PolicyKind, resolve, tier_from_model_name

_SEED_MOD = 2**63  # choice j of a seeded request uses seed + j, kept in int64 range


@dataclass
class Prepared:
    kind: str  # "chat" or "completion"
    request_id: str
    created: int
    model: str  # echoed back as the client sent it
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


def _encode(kind: str, body, engine: Engine) -> tuple[list[list[int]], str]:
    """Token ids per prompt, and the request field they came from (for error `param`)."""
    if kind == "chat":
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        try:
            return [list(engine.encode_chat(messages))], "messages"
        except Exception as exc:  # a template that rejects the conversation (role order, ...)
            raise bad_request(
                f"could not apply the chat template: {type(exc).__name__}", "messages"
            ) from None
    ids = [engine.encode_prompt(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    return [list(x) for x in ids], "prompt"


def resolve_dial(body, engine: Engine, config: DialConfig) -> DialPoint:
    """The request's dial fields (body and model name) -> DialPoint, or a 400 naming the field."""
    info = engine.info
    try:
        return resolve(
            body.quality,
            model_tier=_model_tier(body.model, engine, config),
            policy=PolicyKind.parse(body.verifier) if body.verifier else PolicyKind.ENSEMBLE,
            mode=body.mode or "speculative",
            num_draft=body.num_draft,
            config=config,
            head_dial=info.auto_dial if info.has_head else None,
        )
    except DialError as exc:
        raise bad_request(str(exc), exc.param, code=exc.code) from None


def prepare(kind: str, body: ChatCompletionRequest | CompletionRequest, engine: Engine, settings) -> Prepared:
    info = engine.info
    if body.num_draft is not None and body.num_draft > settings.max_num_draft:
        raise bad_request(f"num_draft must be at most {settings.max_num_draft}", "num_draft")
    dial = resolve_dial(body, engine, settings.dial_config())

    prompts, prompt_param = _encode(kind, body, engine)
    choices = len(prompts) * body.n
    if choices > settings.max_n:
        raise bad_request(
            f"this request asks for {choices} sequences (n x prompts); the limit is {settings.max_n}", "n"
        )

    requested = body.max_tokens
    if kind == "chat" and body.max_completion_tokens is not None:
        requested = body.max_completion_tokens  # the newer name wins when both are sent
    max_param = "max_completion_tokens" if kind == "chat" and body.max_completion_tokens else "max_tokens"

    temperature = 1.0 if body.temperature is None else body.temperature
    requests, rid = [], uuid.uuid4().hex
    for k, ids in enumerate(prompts):
        if not ids:
            raise bad_request("the prompt is empty", prompt_param)
        room = info.max_context - len(ids)
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {info.max_context} tokens; the prompt has "
                f"{len(ids)} tokens. Shorten the {prompt_param}.",
                prompt_param,
                code="context_length_exceeded",
            )
        if requested is not None and requested > room:
            raise bad_request(
                f"This model's maximum context length is {info.max_context} tokens. However, you "
                f"requested {len(ids) + requested} tokens ({len(ids)} in the {prompt_param}, "
                f"{requested} for the completion). Reduce the {prompt_param} or {max_param}.",
                max_param,
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else min(settings.default_max_tokens, room)
        for j in range(body.n):
            seed = None if body.seed is None else (body.seed + j) % _SEED_MOD
            sampling = SamplingOptions(
                temperature=temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                max_tokens=max_tokens,
                stop=tuple(body.stop or ()),
                seed=seed,
            )
            requests.append(
                GenerationRequest(
                    request_id=f"{rid}-{k}-{j}",
                    prompt_token_ids=tuple(ids),
                    sampling=sampling,
                    verify=dial.verification,
                )
            )
    return Prepared(
        kind=kind,
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + rid,
        created=int(time.time()),
        model=body.model,
        dial=dial,
        requests=requests,
        prompt_tokens=sum(len(p) for p in prompts),
        stream=body.stream,
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
    )
