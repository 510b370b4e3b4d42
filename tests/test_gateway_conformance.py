"""The API as documented is the API as served: GET /v1/models/{id}, an OpenAPI document whose
limits are the validators' (n, num_draft, max_tokens, token ids, model names) with no phantom 422,
SSE and error schemas; which endpoints need a key; /ready telling the truth (scripted engine)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server.engine.protocol import engine_readiness
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine, live_server

MODEL = "scripted-pair"


@pytest.fixture(scope="module")
def served():
    engine = ScriptedEngine(num_draft=3, max_batch=3)
    with live_server(create_app(engine, GatewaySettings(max_n=8))) as srv:
        yield srv, engine


def test_retrieve_every_listed_model(served):
    srv, _ = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    ids = [m.id for m in client.models.list()]
    assert len(ids) == 5
    for name in ids:
        m = client.models.retrieve(name)
        assert m.id == name and m.object == "model" and m.owned_by == "dialspec"
    for missing in ("gpt-4o", f"{MODEL}:ultra", "org/some-model"):
        with pytest.raises(openai.NotFoundError) as exc:
            client.models.retrieve(missing)
        assert exc.value.code == "model_not_found" and exc.value.param == "model"
        assert set(exc.value.body) == {"message", "type", "param", "code"}


def test_openapi_publishes_the_real_limits(served):
    srv, engine = served
    doc = httpx.get(srv.url + "/openapi.json").json()
    assert "422" not in str(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    schemas = doc["components"]["schemas"]
    chat, comp = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]

    def bound(prop, key="maximum"):
        return next(s[key] for s in prop.get("anyOf", [prop]) if key in s)

    # n: the smaller of max_n (8) and the running slots (the engine's max_batch, 3)
    assert chat["n"]["maximum"] == comp["n"]["maximum"] == 3
    assert bound(chat["num_draft"]) == engine.info.num_draft_limit == 6  # one limit: the engine's
    assert bound(chat["max_tokens"]) == bound(chat["max_completion_tokens"]) == engine.info.max_context - 1
    assert set(chat["model"]["enum"]) == {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
    ids = next(s for s in comp["prompt"]["anyOf"] if s.get("items", {}).get("type") == "integer")
    assert ids["items"]["maximum"] == engine.info.vocab_size - 1
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"]
        assert "application/json" in responses["200"]["content"]
        for status in ("400", "404", "413", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    assert "404" in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "503" in doc["paths"]["/ready"]["get"]["responses"]
    assert "securitySchemes" not in doc["components"]  # no keys configured


def test_documented_limits_are_enforced(served):
    srv, engine = served
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    limit = engine.info.num_draft_limit
    assert httpx.post(srv.url + "/v1/chat/completions", json={**base, "num_draft": limit}).status_code == 200
    r = httpx.post(srv.url + "/v1/chat/completions", json={**base, "num_draft": limit + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft"
    assert httpx.post(srv.url + "/v1/chat/completions", json={**base, "n": 3}).status_code == 200
    assert httpx.post(srv.url + "/v1/chat/completions", json={**base, "n": 4}).status_code == 400
    r = httpx.post(srv.url + "/v1/chat/completions", json={**base, "max_tokens": engine.info.max_context})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "settings,open_paths,keyed_paths",
    [
        ({}, ["/health", "/ready", "/metrics", "/docs", "/openapi.json"], ["/v1/models"]),
        (
            {"metrics_need_key": True, "docs_need_key": True},
            ["/health", "/ready"],
            ["/v1/models", "/v1/models/scripted-pair", "/metrics", "/docs", "/redoc", "/openapi.json"],
        ),
    ],
)
def test_which_endpoints_need_a_key(settings, open_paths, keyed_paths):
    app = create_app(ScriptedEngine(), GatewaySettings(api_keys=["sekret"], **settings))
    with live_server(app) as srv:
        for path in open_paths:
            assert httpx.get(srv.url + path).status_code == 200, path
        for path in keyed_paths:
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        doc = httpx.get(srv.url + "/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert "401" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert "security" not in doc["paths"]["/health"]["get"]


def test_ready_reports_the_engines_reason():
    engine = ScriptedEngine()
    with live_server(create_app(engine, GatewaySettings())) as srv:
        assert httpx.get(srv.url + "/ready").status_code == 200
        engine.not_ready = "SGLang runtime at http://gpu-0:30000 unreachable"
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["message"] == engine.not_ready
        assert r.json()["error"]["code"] == "engine_not_ready"
        engine.not_ready = None
        assert httpx.get(srv.url + "/ready").status_code == 200


def test_an_engine_without_readiness_is_ready_once_started():
    """Engines predating the readiness method (protocol.ReportsReadiness) count as ready."""
    members = {k: v for k, v in vars(ScriptedEngine).items() if k not in ("readiness", "__dict__")}
    engine = type("Bare", (), members)()
    assert not hasattr(engine, "readiness") and asyncio.run(engine_readiness(engine)) is None
    with live_server(create_app(engine, GatewaySettings())) as srv:
        assert httpx.get(srv.url + "/ready").status_code == 200
