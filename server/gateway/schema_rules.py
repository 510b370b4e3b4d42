"""The request bodies' cross-field rules, stated in their JSON schema (`allOf` of if/then), and the
OpenAI fields dialspec does not support with the values that mean "off" (schemas.py applies both;
the OpenAPI document is the validator the fuzz test holds the server to)."""

from __future__ import annotations

from typing import Any

from verifier.dial import AUTO, POLICY_NAMES

# field -> value(s) that are the same as not sending it (accepted and ignored)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False),
    "logit_bias": (None, {}),
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


# Cross-field rules the validators enforce, stated in the JSON schema (`allOf` of if/then):
# what `_Common._unsupported` checks: stream_options needs stream true.
STREAM_RULE = {
    "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
    "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
}


# What `verifier.dial.resolve_floor` refuses, as far as JSON Schema can say it: a floor on a
# request brownout cannot lower (autoregressive, a baseline verifier, the learned head's "auto",
# also as a `:auto` model name). It cannot compare two numbers: a floor above the request's own
# quality is refused by the dial alone (400 invalid_min_quality, as the field's description says).
_NO_FLOOR = {"properties": {"min_quality": {"type": "null"}}}
FLOOR_RULES = [
    {"if": {"properties": {"mode": {"const": "autoregressive"}}, "required": ["mode"]}, "then": _NO_FLOOR},
    {
        "if": {
            "properties": {"verifier": {"enum": [p for p in POLICY_NAMES if p != "ensemble"]}},
            "required": ["verifier"],
        },
        "then": _NO_FLOOR,
    },  # fmt: skip
    {"if": {"properties": {"quality": {"const": AUTO}}, "required": ["quality"]}, "then": _NO_FLOOR},
    {
        "if": {
            "properties": {"model": {"pattern": f":{AUTO}$"}, "quality": {"type": "null"}},
            "required": ["model"],
        },
        "then": _NO_FLOOR,
    },  # fmt: skip
]


def json_equal(a, b) -> bool:
    """Equality as JSON means it: false is not 0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def add_rules(schema: dict, *rules: dict) -> None:
    """The schema's extras: cross-field rules, and the unsupported fields with their neutral values."""
    schema.setdefault("allOf", []).extend(rules)
    if "logprobs" in schema["properties"]:  # chat and completions (their own rules, one place)
        schema["allOf"].extend(logprobs_rules(chat="top_logprobs" in schema["properties"]))
    for name, neutral in UNSUPPORTED.items():
        values = [v for i, v in enumerate(neutral) if not any(json_equal(v, w) for w in neutral[:i])]
        schema["properties"][name] = {
            "enum": values,
            "description": "not supported: accepted only with a value that means 'off' (others get 400)",
        }


def choice_rules(max_choices: int) -> list[dict]:
    """n x prompts <= max_choices (prepare.plan): with k >= 2 prompts (an array of strings or of
    token-id arrays), n <= max_choices // k."""
    batch = {"type": "array", "items": {"type": ["string", "array"]}}
    return [
        {
            "if": {"properties": {"prompt": {**batch, "minItems": k}}, "required": ["prompt"]},
            "then": {"properties": {"n": {"maximum": max_choices // k}}},
        }
        for k in range(2, max_choices + 1)
    ]


def logprobs_rules(chat: bool) -> list[dict]:
    """What `ChatCompletionRequest._top_logprobs` and `protocol.logprobs_refusal` check: chat's
    top_logprobs >= 1 needs logprobs true; log-probs with a baseline verifier need the target
    alone (mode autoregressive: p has a law, a baseline's tokens follow none that is reported)."""
    on = {"const": True} if chat else {"type": "integer"}
    baseline = {"enum": [p for p in POLICY_NAMES if p != "ensemble"]}
    rules = [
        {
            "if": {
                "properties": {"verifier": baseline, "logprobs": on},
                "required": ["verifier", "logprobs"],
            },
            "then": {"properties": {"mode": {"const": "autoregressive"}}, "required": ["mode"]},
        }
    ]
    if chat:
        top = {"top_logprobs": {"type": "integer", "minimum": 1}}
        rules.append(
            {
                "if": {"properties": top, "required": ["top_logprobs"]},
                "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            }
        )
    return rules
