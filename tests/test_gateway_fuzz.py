"""Property test over the server's own OpenAPI document (schemathesis) against a live embedded
server (tiny pair): valid and invalid requests for every operation, the model pinned to served
names by the document itself (its `model` enum), so valid requests reach the engine.

Every response must be a documented status with the documented content type and schema, and none
may be a 5xx; afterwards the server still generates. The budget (examples per operation) keeps
the run well under 90 s on a 2-core machine."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import live_server

NAME = "tiny-pair"
EXAMPLES = 50  # per operation and generation mode (~20 s in all on 2 cores)


@pytest.fixture(scope="module")
def server(tiny_pair):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(target, draft, num_draft=4, max_batch=4, max_context=128, served_name=NAME)
    )
    # short completions by default: the fuzzer should spend its time on inputs, not decoding
    with live_server(create_app(engine, GatewaySettings(default_max_tokens=16, max_waiting=64))) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.output.sanitization.update(enabled=False)  # "max_tokens" is not a secret
    return schema


def _not_schema_stateable(response) -> bool:
    """400s for rules no JSON schema can state: a prompt that does not fit beside max_tokens in
    the context window (it depends on the tokenized prompt), and a `min_quality` above the
    request's quality (a comparison of two fields' numbers; schema_rules.FLOOR_RULES states the rest)."""
    if response.status_code != 400:
        return False
    error = response.json()["error"]
    return error["code"] == "context_length_exceeded" or (
        error["code"] == "invalid_min_quality" and "above the requested quality" in error["message"]
    )


OPERATIONS = [
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/{model_id}", "GET"),
    ("/v1/dial", "GET"),
    ("/v1/engine/runtime", "GET"),
    ("/health", "GET"),
    ("/ready", "GET"),
    ("/metrics", "GET"),
]


def test_every_operation_is_fuzzed(api_schema):
    listed = {(r.ok().path, r.ok().method.upper()) for r in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


# Invalid requests exist only where there is an input to break (a body; any path id is valid).
CASES = [(p, m, GenerationMode.POSITIVE) for p, m in OPERATIONS] + [
    (p, m, GenerationMode.NEGATIVE) for p, m in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{m} {p} {g.value}" for p, m, g in CASES])
def test_no_request_breaks_the_api(api_schema, path, method, mode):
    """Schemathesis' checks (status codes, content types, response schemas, no 5xx; for invalid
    requests, that they are refused with a 4xx) on generated requests. Fixed seed: reproducible."""

    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    def check(case):
        response = case.call()
        skip = [positive_data_acceptance] if _not_schema_stateable(response) else []
        case.validate_response(response, excluded_checks=skip)

    check()


def test_server_still_generates_after_fuzzing(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/ready").status_code == 200
    assert 'request_errors_total{status="500"}' not in httpx.get(server.url + "/metrics").text
