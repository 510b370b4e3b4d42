"""Input validation: a table of bad requests -> the right 4xx with an OpenAI error object, and a
server that is still healthy afterwards; plus the dial mapping and settings sources as units."""

from __future__ import annotations

import json

import httpx
import pytest

from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings, load_settings
from tests.scripted_engine import ScriptedEngine, live_server

MODEL = "scripted-pair"
MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def chat(**kw):
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}


# (name, path, json body or raw bytes, status, param or None)
BAD = [
    ("not json", CHAT, b"{nope", 400, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None),
    ("missing model", CHAT, {"messages": MSG}, 400, "model"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("bad role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("tool role", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.role"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, None),
    ("unknown model", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("unknown tier in model", CHAT, chat(model=f"{MODEL}:ultra"), 404, "model"),
    ("temperature type", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature range", CHAT, chat(temperature=3), 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=2.5), 400, "max_tokens"),
    ("max_tokens over context", CHAT, chat(max_tokens=10_000), 400, "max_tokens"),
    (
        "max_completion_tokens over context",
        CHAT,
        chat(max_completion_tokens=10_000),
        400,
        "max_completion_tokens",
    ),
    ("prompt over context", COMP, {"model": MODEL, "prompt": "x" * 600}, 400, "prompt"),
    ("n too large", CHAT, chat(n=5), 400, "n"),
    ("n zero", CHAT, chat(n=0), 400, "n"),
    ("five stops", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("empty stop", CHAT, chat(stop=[""]), 400, "stop.0"),
    ("empty stop string", CHAT, chat(stop=""), 400, "stop"),
    ("stream not bool", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, None),
    ("quality above 1", CHAT, chat(quality=1.5), 400, "quality"),
    ("quality negative", CHAT, chat(quality=-0.1), 400, "quality"),
    ("quality bool", CHAT, chat(quality=True), 400, "quality"),
    ("quality unknown tier", CHAT, chat(quality="ultra"), 400, "quality"),
    ("quality auto without head", CHAT, chat(quality="auto"), 400, "quality"),
    ("unknown verifier", CHAT, chat(verifier="magic"), 400, "verifier"),
    ("unknown mode", CHAT, chat(mode="turbo"), 400, "mode"),
    ("num_draft over the engine's limit", CHAT, chat(num_draft=9), 400, "num_draft"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("logprobs", CHAT, chat(logprobs=True), 400, "logprobs"),
    ("response_format json", CHAT, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("presence_penalty", CHAT, chat(presence_penalty=0.5), 400, "presence_penalty"),
    ("logit_bias", CHAT, chat(logit_bias={"1": 5}), 400, "logit_bias"),
    ("echo", COMP, {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ("suffix", COMP, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("empty prompt list", COMP, {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("negative token id", COMP, {"model": MODEL, "prompt": [1, -2]}, 400, "prompt.1"),
    ("token id beyond vocabulary", COMP, {"model": MODEL, "prompt": [1, 256]}, 400, "prompt.1"),
    ("boolean token id", COMP, {"model": MODEL, "prompt": [[False]]}, 400, "prompt.0.0"),
    ("empty token list in batch", COMP, {"model": MODEL, "prompt": [[1], []]}, 400, "prompt.1"),
    ("more prompts than max_n", COMP, {"model": MODEL, "prompt": ["a"] * 5}, 400, "prompt"),
    ("n x prompts over max_n", COMP, {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2}, 400, "n"),
    ("seed bool", CHAT, chat(seed=False), 400, "seed"),
    ("seed float", CHAT, chat(seed=1.5), 400, "seed"),
    ("seed past JSON's safe integers", CHAT, chat(seed=2**53), 400, "seed"),
    ("n bool", CHAT, chat(n=True), 400, "n"),
    ("max_tokens bool", CHAT, chat(max_tokens=True), 400, "max_tokens"),
    ("temperature bool", CHAT, chat(temperature=True), 400, "temperature"),
    ("temperature string", CHAT, chat(temperature="0.5"), 400, "temperature"),
    ("top_p bool", CHAT, chat(top_p=True), 400, "top_p"),
    ("top_k over int32", CHAT, chat(top_k=2**31), 400, "top_k"),
    ("top_k over int64", CHAT, chat(top_k=2**63), 400, "top_k"),
    ("top_k bool", CHAT, chat(top_k=True), 400, "top_k"),
    ("num_draft bool", CHAT, chat(num_draft=True), 400, "num_draft"),
    ("num_draft zero", CHAT, chat(num_draft=0), 400, "num_draft"),
    ("stream_options not an object", CHAT, chat(stream=True, stream_options=1), 400, "stream_options"),
    ("user too long", CHAT, chat(user="u" * 300), 400, "user"),
]


@pytest.fixture(scope="module")
def server():
    app = create_app(ScriptedEngine(max_context=512), GatewaySettings(max_body_bytes=64 * 1024))
    with live_server(app) as srv:
        yield srv


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_allowed_neutral_values_are_accepted(server):
    body = chat(logprobs=False, presence_penalty=0, tools=[], response_format={"type": "text"}, store=False)
    assert httpx.post(server.url + CHAT, json=body).status_code == 200


def test_body_too_large_413(server):
    big = {"model": MODEL, "prompt": "x" * 70_000}
    r = httpx.post(server.url + COMP, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # chunked upload, no Content-Length: counted while reading
        yield b'{"model": "scripted-pair", "prompt": "'
        for _ in range(80):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(server.url + COMP, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_server_healthy_after_bad_inputs(server):
    # runs after the table (file order): the server still serves normal requests
    assert httpx.get(server.url + "/ready").status_code == 200
    r = httpx.post(server.url + CHAT, json=chat())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'dialspec:request_errors_total{status="400"}' in metrics


# ---- the dial as a unit -----------------------------------------------------------------------

# ---- settings sources --------------------------------------------------------------------------


def test_settings_env_file_and_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "gw.json"
    cfg.write_text(
        json.dumps({"tiers": {"eco": 0.1, "exact": 1.0}, "max_waiting": 3, "default_quality": "eco"})
    )
    monkeypatch.setenv("DIALSPEC_MAX_WAITING", "7")
    monkeypatch.setenv("DIALSPEC_API_KEYS", "a, b")
    s = load_settings(cfg)
    assert s.tiers == {"eco": 0.1, "exact": 1.0} and s.default_quality == "eco"
    assert s.max_waiting == 7  # env beats file
    assert s.api_keys == ["a", "b"]
    assert load_settings(cfg, max_waiting=9).max_waiting == 9  # CLI beats env
    toml = tmp_path / "gw.toml"
    toml.write_text('max_n = 2\ndefault_quality = "fast"\n[tiers]\nfast = 0.3\n')
    assert load_settings(toml).tiers == {"fast": 0.3}
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(ValueError):
        GatewaySettings(tiers={"bad": 2.0})
    with pytest.raises(ValueError, match="not a tier"):  # a default no request could resolve
        GatewaySettings(tiers={"fast": 0.3})
