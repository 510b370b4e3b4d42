"""Request bodies of the OpenAI-compatible API, plus the dialspec extensions (responses: responses.py).

Unknown fields are ignored (clients send `store`, `metadata`, ...), except those in `UNSUPPORTED`:
fields whose *absence* would change what the client gets back (tools, logit_bias, penalties,
...) are rejected with a 400 naming the field instead of being silently dropped. Every string of a
body, at any depth, must be Unicode text: a lone surrogate (JSON `\\ud800`) is a 400
`invalid_unicode` naming its field (`_Common._valid_unicode`).

dialspec extensions (top level; the `openai` client's `extra_body` puts them there):
    quality   number in [0, 1], a tier name, or "auto" (see verifier/dial.py)
    verifier  "ensemble" (default) | "lossy" | "cascade" | "typical": baseline policies to compare
    mode      "speculative" (default) | "autoregressive": the target-only baseline
    num_draft draft length N for this request (engine default when absent)
    min_quality  the lowest quality the client accepts under overload (brownout; default: `quality`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from server.engine.protocol import MAX_TOP_K, MAX_TOP_LOGPROBS, MIN_TOP_P
from server.gateway.schema_rules import (
    FLOOR_RULES,
    STREAM_RULE,
    UNSUPPORTED,
    add_rules,
    choice_rules,
    json_equal,
)
from verifier.dial import AUTO, POLICY_NAMES


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate_path(value, path: str) -> str | None:
    """The path (`messages.0.content`) of the first string in a decoded JSON value that holds a
    lone surrogate, else None. JSON's `\\ud800` escape decodes to one; it is not Unicode text:
    it cannot be encoded to UTF-8, so no tokenizer (or error message) can carry it. A bad *key*
    is reported by its parent's path (the key itself cannot be quoted)."""
    if isinstance(value, str):
        return None if _is_text(value) else (path or "body")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and not _is_text(key):
            return path or "body"
        if isinstance(item, (str, dict, list)):  # token ids and numbers: nothing to check
            found = _lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    return None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


def _integer_only(value):
    # JSON Schema's "integer" admits 59.0 (the lax int below does too, and refuses 59.5), but
    # true is not 1 and "59" is not 59.
    if isinstance(value, (bool, str)):
        kind = {"kind": type(value).__name__}
        raise PydanticCustomError("int_type", "Input should be an integer, not {kind}", kind)
    return value


def json_int(ge: int | None = None, le: int | None = None):
    """An integer field type in [ge, le] (the bounds sit inside, before the validator, so that
    the JSON schema says minimum/maximum)."""
    bounds = [b for b in (None if ge is None else Ge(ge), None if le is None else Le(le)) if b is not None]
    return Annotated[(int, *bounds, BeforeValidator(_integer_only))]


NonEmptyStr = Annotated[str, Field(min_length=1)]
# JSON's interoperable integers (RFC 8259, section 6): past them, clients and validators that read
# numbers as doubles round, and would see 2^63 + 192 as an allowed 2^63.
JSON_SAFE_INT = 2**53 - 1


class JsonSchemaFormat(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="a JSON Schema (draft 2020-12 or older)"
    )
    strict: StrictBool | None = Field(
        None, description="accepted for compatibility: the output always follows the schema"
    )

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value):
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for

        try:
            validator_for(value).check_schema(value)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return value


_FORMAT_RULE = {  # what `ResponseFormat._schema_with_its_type` checks
    "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
    "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
    "else": {"properties": {"json_schema": {"type": "null"}}},
}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(json_schema_extra={"allOf": [_FORMAT_RULE]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema (only)")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


RESPONSE_FORMAT_DOC = (
    "constrain the output: json_object (a JSON object) or json_schema (following the schema), at every "
    "quality: both models are masked to what the grammar allows before ν is formed, so quality 1 samples "
    "the constrained target exactly and quality 0 the constrained draft. JSON is compact (no free "
    "whitespace) and ends with the model's end-of-sequence token. Backends that cannot honour it at the "
    "requested quality answer 400."
)


class _Common(BaseModel):
    """Fields shared by chat and text completions. Numbers are strict (JSON true is not 1 and
    "2" is not 2); `request_models` narrows the limits that depend on the engine and settings."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra=lambda schema, _cls: add_rules(schema, STREAM_RULE, *FLOOR_RULES)
    )

    model: str = Field(min_length=1, max_length=256)
    max_tokens: json_int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)
    top_p: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        strict=True,
        allow_inf_nan=False,
        description=f"values below {MIN_TOP_P} keep only the most likely token, as {MIN_TOP_P} does",
    )
    top_k: json_int(ge=0, le=MAX_TOP_K) | None = Field(
        None, description="vLLM/SGLang extension; 0 = off, >= vocabulary size = off"
    )
    n: json_int(ge=1) = 1
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=4)] | None = None
    seed: json_int(-JSON_SAFE_INT, JSON_SAFE_INT) | None = Field(
        None,
        description="the same request with the same seed gives the same output on one running embedded "
        "server, whatever its load and batching (choice j uses seed + j; README, 'Seeds')",
    )
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
    min_quality: StrictFloat | StrictInt | StrictStr | None = Field(
        None,
        description="dialspec: the lowest quality (number in [0, 1] or tier name, at most the request's "
        "quality: a floor above it is refused) this request may be served at when the server is overloaded "
        "and runs brownout; only for a numeric or tier quality on the ensemble verifier; default: the "
        "requested quality, so the request is never lowered. The response's `dialspec.quality` / `tier` "
        "say what was served, `requested_quality` / `requested_tier` what was asked (also X-Dialspec-* "
        "headers).",
    )
    verifier: Literal[POLICY_NAMES] | None = Field(
        None, description="dialspec: verification policy; baselines are for comparison runs"
    )
    mode: Literal["speculative", "autoregressive"] | None = Field(
        None, description="dialspec: 'autoregressive' runs the target alone (speed baseline)"
    )
    # The range is the engine's (EngineInfo.num_draft_limit), checked by verifier.dial.
    num_draft: json_int() | None = Field(None, description="dialspec: draft length N for this request")
    response_format: ResponseFormat | None = Field(None, description=RESPONSE_FORMAT_DOC)
    dialspec_trace: StrictBool = Field(
        False,
        description="dialspec: report each token's provenance (draft / corrected / bonus / target) and "
        "the w applied at its position, as `dialspec_trace` in every choice and streamed chunk choice. "
        "Backends that cannot report it (SGLang) answer 400.",
    )

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """Every string of the body, at any depth, must be encodable text: checked once here, at
        the edge, so nothing downstream (tokenizer, logs, JSON responses) meets a lone surrogate."""
        where = _lone_surrogate_path(data, "")
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "{param}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                "which is not valid Unicode text",
                {"param": where},
            )
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(json_equal(value, v) for v in UNSUPPORTED[name]):
                raise ValueError(f"UNSUPPORTED:{name}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


LOGPROBS_DOC = (
    "log-probabilities of the law each token was drawn from: ν = w·p + (1−w)·q at its position "
    "(so the target's p at quality 1, the draft's q at quality 0), or p where the token came from the "
    "target alone (rounds without drafts; autoregressive mode). After temperature, top-k and top-p "
    "(tokens they exclude read -9999.0); at temperature 0, the law whose most likely token was taken. "
    "Not for baseline verifiers. SGLang backend: SGLang's own log-probs as the dialspec plugin writes "
    "them, log ν at drafted positions (accepted drafts, corrections) and log p at the others (the "
    "bonus, the first token), with temperature but before top-k and top-p (SGLang's convention: with "
    "top_k or top_p set they are not those of the law sampled)."
)


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
    max_completion_tokens: json_int(ge=1) | None = None
    logprobs: StrictBool | None = Field(None, description=f"dialspec: {LOGPROBS_DOC}")
    top_logprobs: json_int(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description="the most likely tokens of that law per position (needs logprobs: true)"
    )

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):  # logprobs is validated first (declared first)
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def logprobs_count(self) -> int | None:
        """Alternatives per token when log-probs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_count(self) -> int:
        return 1


TokenId = json_int(ge=0)


class CompletionRequest(_Common):
    # A string, token ids, or a batch of either (each prompt gets n choices).
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )

    logprobs: json_int(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description=f"dialspec: this many most likely tokens per position, with the {LOGPROBS_DOC}"
    )

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def prompt_count(self) -> int:
        return 1 if isinstance(self.prompt, str) or isinstance(self.prompt[0], int) else len(self.prompt)


_ChatBase, _CompletionBase = ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Limits:
    """What this server accepts, published in its OpenAPI document and enforced by the same
    models (`request_models`)."""

    max_n: int = 4  # choices per request: n x prompts
    max_num_draft: int = 8  # the engine's largest per-request N
    max_tokens: int | None = None  # the context window minus one prompt token
    vocab_size: int | None = None  # token ids lie in [0, vocab_size)
    models: tuple[str, ...] = ()  # served model names
    tiers: tuple[str, ...] = ()  # quality tier names (and 'auto' with a head)


def request_models(lim: Limits) -> tuple[type[ChatCompletionRequest], type[CompletionRequest]]:
    """Chat and completion request models narrowed to `lim`: what the schema says is what they
    validate. The dial's own fields keep their checks in verifier.dial; their documented ranges
    here (quality, num_draft) are the same numbers."""
    max_id = None if lim.vocab_size is None else lim.vocab_size - 1
    ids = json_int(ge=0, le=max_id)
    models = {"enum": list(lim.models)} if lim.models else {}
    quality_doc = {
        "anyOf": [
            {"type": "number", "minimum": 0, "maximum": 1},
            {"type": "string", "enum": list(lim.tiers)} if lim.tiers else {"type": "string"},
            {"type": "null"},
        ]
    }
    tier_names = [t for t in lim.tiers if t != AUTO]
    floor_doc = {
        "anyOf": [
            {"type": "number", "minimum": 0, "maximum": 1},
            {"type": "string", "enum": tier_names} if tier_names else {"type": "string"},
            {"type": "null"},
        ]
    }
    num_draft_doc = {
        "anyOf": [{"type": "integer", "minimum": 1, "maximum": lim.max_num_draft}, {"type": "null"}]
    }

    class _Limited(_Common):
        model: str = Field(
            min_length=1,
            max_length=256,
            json_schema_extra=models,
            description="a served name (GET /v1/models); others are answered 404 model_not_found",
        )
        max_tokens: json_int(ge=1, le=lim.max_tokens) | None = None
        n: json_int(ge=1, le=lim.max_n) = Field(1, description=f"choices x prompts must be <= {lim.max_n}")
        quality: StrictFloat | StrictInt | StrictStr | None = Field(
            None,
            description=_Common.model_fields["quality"].description,
            json_schema_extra=_replace_schema(quality_doc),
        )
        num_draft: json_int() | None = Field(
            None,
            description="dialspec: draft length N for this request",
            json_schema_extra=_replace_schema(num_draft_doc),
        )
        min_quality: StrictFloat | StrictInt | StrictStr | None = Field(
            None,
            description=_Common.model_fields["min_quality"].description,
            json_schema_extra=_replace_schema(floor_doc),
        )

    class ChatCompletionRequest(_Limited, _ChatBase):
        max_completion_tokens: json_int(ge=1, le=lim.max_tokens) | None = None

    class CompletionRequest(_Limited, _CompletionBase):
        model_config = ConfigDict(
            json_schema_extra=lambda schema, _cls: add_rules(
                schema, STREAM_RULE, *FLOOR_RULES, *choice_rules(lim.max_n)
            )
        )
        prompt: (
            NonEmptyStr
            | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=lim.max_n)]
            | Annotated[list[ids], Field(min_length=1)]
            | Annotated[
                list[Annotated[list[ids], Field(min_length=1)]], Field(min_length=1, max_length=lim.max_n)
            ]
        )

    return ChatCompletionRequest, CompletionRequest


def _replace_schema(doc: dict):
    """A json_schema_extra that swaps the generated type for `doc`, keeping title and description."""

    def update(schema: dict) -> None:
        for key in ("anyOf", "type", "enum", "minimum", "maximum"):
            schema.pop(key, None)
        schema.update(doc)

    return update
