"""The gateway's OpenAI-compatible API, driven by the official `openai` client against a live
uvicorn server on loopback, with the scripted engine (fast, deterministic). The same flows against
the real embedded engine live in test_gateway_embedded.py."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine, live_server
from verifier.dial import PolicyKind

MODEL = "scripted-pair"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    engine = ScriptedEngine()
    app = create_app(engine, GatewaySettings())
    with live_server(app) as srv:
        yield srv, engine, app


@pytest.fixture(scope="module")
def client(served):
    srv, _, _ = served
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_gateway_never_imports_torch():
    code = "import sys, server.gateway.app, server.gateway.serve; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_models_lists_pair_and_tiers(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL] + [f"{MODEL}:{t}" for t in ("lite", "standard", "pro", "exact")]


def test_health_ready_openapi(served):
    srv, _, _ = served
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(srv.url + "/ready").json()
    assert ready["status"] == "ready" and ready["model"] == MODEL
    doc = httpx.get(srv.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/health", "/ready"):
        assert path in doc["paths"]
    assert "DialspecStats" in doc["components"]["schemas"]


def test_chat_completion_with_dialspec_stats(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, extra_body={"quality": 0.5})
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and len(choice.message.content) == 20
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    ds = r.model_extra["dialspec"]
    assert ds["tier"] == "custom" and ds["quality"] == 0.5 and ds["mean_w"] == pytest.approx(0.5)
    assert ds["policy"] == "ensemble"
    assert ds["acceptance_rate"] == pytest.approx(ds["accepted_tokens"] / ds["draft_tokens"])
    assert ds["mean_accepted_length"] == pytest.approx(1 + ds["accepted_tokens"] / ds["drafts"])


def test_quality_tiers_by_body_and_model_name(client, served):
    _, engine, _ = served
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=5, extra_body={"quality": "lite"}
    )
    assert r.model_extra["dialspec"]["tier"] == "lite" and engine.requests[-1].verify.weight == 0.25
    r = client.chat.completions.create(model=f"{MODEL}:pro", messages=MSG, max_tokens=5)
    assert r.model == f"{MODEL}:pro" and r.model_extra["dialspec"]["tier"] == "pro"
    assert engine.requests[-1].verify.weight == 0.75
    # explicit quality beats the model-name tier
    r = client.chat.completions.create(
        model=f"{MODEL}:pro", messages=MSG, max_tokens=5, extra_body={"quality": 1}
    )
    assert engine.requests[-1].verify.weight == 1.0
    # default: lossless
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5)
    assert engine.requests[-1].verify.weight == 1.0 and r.model_extra["dialspec"]["tier"] == "custom"


def test_verifier_and_autoregressive_baselines(client, served):
    _, engine, _ = served
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, extra_body={"verifier": "lossy", "quality": "standard"}
    )
    v = engine.requests[-1].verify
    assert (
        v.policy == PolicyKind.LOSSY and v.lenience == 0.5 and r.model_extra["dialspec"]["policy"] == "lossy"
    )
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, extra_body={"mode": "autoregressive"}
    )
    ds = r.model_extra["dialspec"]
    assert engine.requests[-1].verify.mode == "autoregressive"
    assert ds["drafts"] == 0 and ds["verify_steps"] == 5 and ds["acceptance_rate"] is None


def test_completions_prompt_forms_and_n(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=7, n=2, seed=11)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert all(len(c.text) == 7 for c in r.choices)
    assert r.choices[0].text != r.choices[1].text  # choice j samples with seed + j
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 14
    again = client.completions.create(model=MODEL, prompt="abc", max_tokens=7, n=2, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    batch = client.completions.create(model=MODEL, prompt=[[97, 98], [99]], max_tokens=3)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 3
    batch = client.completions.create(model=MODEL, prompt=["ab", "c"], max_tokens=3, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_seed_reproducible_and_stop(client):
    a = client.completions.create(model=MODEL, prompt="s", max_tokens=30, seed=5)
    b = client.completions.create(model=MODEL, prompt="s", max_tokens=30, seed=5)
    assert a.choices[0].text == b.choices[0].text
    word = a.choices[0].text.split()[1]
    c = client.completions.create(model=MODEL, prompt="s", max_tokens=30, seed=5, stop=[word])
    assert c.choices[0].finish_reason == "stop" and word not in c.choices[0].text


def test_chat_stream_with_usage_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=25,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"quality": "standard"},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 25
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 25
    assert last.model_extra["dialspec"]["tier"] == "standard"
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage_puts_stats_on_last_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt="p", max_tokens=9, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks).__len__() == 9
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["dialspec"]["draft_tokens"] > 0
    # the first chunk announces the served quality (alone); the ones between carry nothing
    assert chunks[0].model_extra["dialspec"] == {
        "tier": "exact", "quality": 1.0, "requested_tier": "exact", "requested_quality": 1.0,
        "min_quality": 1.0,
    }  # fmt: skip
    assert all("dialspec" not in (c.model_extra or {}) for c in chunks[1:-1])


def test_raw_sse_wire_format(served):
    srv, _, _ = served
    body = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: ") :])
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4


def test_n_streaming_interleaves_choices(client):
    chunks = list(client.completions.create(model=MODEL, prompt="q", max_tokens=6, n=2, seed=1, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert len(texts[0]) == len(texts[1]) == 6


def test_error_types_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MSG)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, extra_body={"quality": "ultra"})
    assert e.value.param == "quality" and "lite" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, extra_body={"quality": "auto"})
    assert "head" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, logprobs=True)
    assert e.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10_000)
    assert e.value.code == "context_length_exceeded"


def test_api_keys():
    app = create_app(ScriptedEngine(), GatewaySettings(api_keys=["k1", "k2"]))
    with live_server(app) as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="k2", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key


def test_auto_quality_with_a_head():
    engine = ScriptedEngine(has_head=True)
    with live_server(create_app(engine)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert f"{MODEL}:auto" in [m.id for m in client.models.list()]
        r = client.chat.completions.create(model=f"{MODEL}:auto", messages=MSG, max_tokens=3)
        assert engine.requests[-1].verify.learned and r.model_extra["dialspec"]["tier"] == "auto"
        client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=3, extra_body={"quality": "auto"}
        )
        assert engine.requests[-1].verify.learned
