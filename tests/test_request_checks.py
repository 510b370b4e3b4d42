"""The embedded engine's refusals before a row exists (`request_checks.checked_sampling`): each
unservable request gets EngineError 'invalid_request' naming what is wrong, and a servable one its
normalised sampling options. No model needed: the checks read only the request and the limits."""

from __future__ import annotations

import pytest

from server.engine.embedded.request_checks import checked_sampling
from server.engine.protocol import EngineError, GenerationRequest, ResponseFormat, SamplingOptions
from verifier.dial import Verification

LIMITS = dict(
    vocab_size=100, max_context=16, max_num_draft=4, has_head=False, structured_output=True, forced_tv=None
)


def refusal(request: GenerationRequest, **limits) -> str:
    with pytest.raises(EngineError) as err:
        checked_sampling(request, **{**LIMITS, **limits})
    assert err.value.kind == "invalid_request"
    return str(err.value)


def request(prompt=(1, 2), **fields) -> GenerationRequest:
    fields.setdefault("sampling", SamplingOptions(max_tokens=8))
    return GenerationRequest("r", tuple(prompt), **fields)


def test_a_servable_request_gets_its_normalised_sampling():
    s = checked_sampling(request(sampling=SamplingOptions(temperature=1e-9, max_tokens=14)), **LIMITS)
    assert s.temperature == 0 and s.max_tokens == 14  # below MIN_TEMPERATURE: greedy


@pytest.mark.parametrize(
    ("req", "limits", "says"),
    [
        (request(sampling=SamplingOptions(top_p=0)), {}, "top_p"),
        (request(prompt=()), {}, "prompt is empty"),
        (request(prompt=(1, 100)), {}, "integers in [0, 100)"),
        (request(prompt=(1, True)), {}, "integers in [0, 100)"),
        (request(sampling=SamplingOptions(max_tokens=15)), {}, "exceeds this engine's max_context of 16"),
        (request(verify=Verification(dial=0.5)), {}, "no weight head loaded"),
        (request(logprobs=21), {}, "logprobs must be an integer in [0, 20]"),
        (request(logprobs=2), {"forced_tv": 0.2}, "forces acceptance for timing"),
        (request(response_format=ResponseFormat("json_object")), {"structured_output": False}, "xgrammar"),
        (request(verify=Verification(weight=1.5)), {}, "weight"),
        (request(verify=Verification(num_draft=5)), {}, "num_draft"),
    ],
)
def test_each_unservable_request_is_refused_with_its_reason(req, limits, says):
    assert says in refusal(req, **limits)


def test_an_out_of_range_verification_is_reported_over_a_prompt_problem():
    assert "weight" in refusal(request(prompt=(), verify=Verification(weight=-1)))
