"""Reliability: client disconnects cancel generation and free capacity, admission control answers
429 + Retry-After fast while admitted requests keep going, engine errors map to statuses, and a
shutdown drains in-flight requests (scripted engine with per-round delays)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from server.engine.protocol import EngineError
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import LiveServer, ScriptedEngine, live_server

MODEL = "scripted-pair"


def wait_until(cond, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket (so the test can hang up mid-request)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def make(step_delay=0.05, **settings):
    engine = ScriptedEngine(step_delay=step_delay, script_words=400, max_context=4096)
    app = create_app(engine, GatewaySettings(**settings))
    return engine, app, app.state.gateway


def test_disconnect_non_streaming_cancels_generation():
    engine, app, gw = make()
    with live_server(app) as srv:
        sock = raw_post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2000})
        wait_until(lambda: engine.active, what="generation to start")
        sock.close()
        wait_until(lambda: not engine.active and engine.cancelled, what="engine stream closed")
        wait_until(lambda: gw.admission.running == 0, what="slot released")
        assert 'request_success_total{finish_reason="abort"} 1.0' in httpx.get(srv.url + "/metrics").text


def test_disconnect_streaming_cancels_generation():
    engine, app, gw = make()
    with live_server(app) as srv:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2000,
            "stream": True,
        }
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
        wait_until(lambda: not engine.active and engine.cancelled, what="engine stream closed")
        wait_until(lambda: gw.admission.running == 0, what="slot released")
        # capacity really is free again: a new request is served at once
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 3})
        assert r.status_code == 200


def test_disconnect_while_queued_leaves_the_queue():
    engine, app, gw = make(max_running=1, max_waiting=4)
    with live_server(app) as srv:
        first = raw_post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2000})
        wait_until(lambda: gw.admission.running == 1)
        queued = raw_post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "b", "max_tokens": 5})
        wait_until(lambda: gw.admission.waiting_requests == 1)
        queued.close()
        wait_until(lambda: gw.admission.waiting_requests == 0, what="queue entry removed")
        assert len(engine.requests) == 1  # the queued request never reached the engine
        first.close()
        wait_until(lambda: gw.admission.running == 0)


def test_overload_fast_429_with_retry_after_while_admitted_complete():
    engine, app, gw = make(step_delay=0.03, max_running=2, max_waiting=1, retry_after_s=2)
    with live_server(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        t0 = time.monotonic()
        client.completions.create(model=MODEL, prompt="z", max_tokens=30, seed=1)
        alone = time.monotonic() - t0

        results, latencies = [], []

        def call(i):
            t = time.monotonic()
            results.append(client.completions.create(model=MODEL, prompt="z", max_tokens=30, seed=1))
            latencies.append((i, time.monotonic() - t))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        wait_until(lambda: gw.admission.running_requests == 2 and gw.admission.waiting_requests == 1)
        t = time.monotonic()
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model=MODEL, prompt="z", max_tokens=30)
        # refused at once, not queued: a queued request would wait for a slot, then run (> alone)
        assert time.monotonic() - t < max(0.5, alone / 2)
        assert exc.value.response.headers["retry-after"] == "2"
        assert exc.value.code == "server_overloaded"
        for t in threads:
            t.join(30)
        assert len(results) == 3 and all(r.choices[0].finish_reason == "length" for r in results)
        # the two admitted at once kept single-request latency (the third waited for a slot)
        admitted = sorted(lat for i, lat in latencies if i < 2)
        assert admitted[-1] < alone * 1.5 + 0.3, (admitted, alone)
        text = httpx.get(srv.url + "/metrics").text
        assert 'dialspec:request_errors_total{status="429"} 1.0' in text
        assert "dialspec:num_requests_running 0.0" in text


@pytest.mark.parametrize(
    "kind,status,exc_type",
    [
        ("invalid_request", 400, openai.BadRequestError),
        ("capacity", 429, openai.RateLimitError),
        ("unavailable", 503, openai.InternalServerError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_map_to_status(kind, status, exc_type, stream):
    engine, app, gw = make(step_delay=0)
    with live_server(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        engine.fail_next = EngineError("engine says no", kind)
        with pytest.raises(exc_type) as exc:
            out = client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=stream)
            list(out)
        assert exc.value.status_code == status and "engine says no" in exc.value.message
        assert gw.admission.running == 0
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).choices  # healthy


def test_not_ready_is_503():
    engine, app, gw = make(step_delay=0)
    with live_server(app) as srv:
        gw.ready = False
        assert httpx.get(srv.url + "/ready").status_code == 503
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        gw.ready = True


def test_shutdown_drains_in_flight_stream():
    engine, app, gw = make(step_delay=0.03)
    srv = LiveServer(app)
    lines: list[str] = []

    def consume():
        body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))

    t = threading.Thread(target=consume)
    t.start()
    wait_until(lambda: engine.active, what="stream started")
    srv.stop()  # uvicorn stops accepting, waits for the stream, then the lifespan stops the engine
    t.join(10)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    assert engine.stopped and not engine.cancelled


def test_shutdown_refuses_new_requests_then_ends_what_outlives_the_grace_period():
    """SIGTERM semantics (LiveServer.stop drains as the signal does): new and queued requests get
    503 over HTTP while the listener is open; at the end of the grace period a stream gets a final
    chunk with finish_reason, the shutting-down error event and [DONE]; a non-stream request a 503
    error object; the server then exits 0."""
    engine, app, gw = make(step_delay=0.05, max_running=2, max_waiting=4, drain_timeout_s=1.5)
    srv = LiveServer(app)
    lines: list[str] = []
    plain: list[httpx.Response] = []

    def stream():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))

    def non_stream(max_tokens):
        body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens}
        plain.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=30))

    threads = [threading.Thread(target=stream), threading.Thread(target=non_stream, args=(2000,))]
    for t in threads:
        t.start()
    wait_until(lambda: gw.admission.running == 2, what="two requests running")
    queued = threading.Thread(target=non_stream, args=(5,))
    queued.start()
    wait_until(lambda: gw.admission.waiting_requests == 1, what="one request queued")
    t0 = time.monotonic()
    srv.begin_stop()
    queued.join(5)
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutting_down"
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert r.headers["connection"] == "close"
    ready = httpx.get(srv.url + "/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "server_draining"
    assert httpx.get(srv.url + "/health").status_code == 200  # alive while draining

    for t in threads:
        t.join(30)
    srv.thread.join(30)
    assert 1.5 <= time.monotonic() - t0 < 10
    assert not srv.thread.is_alive() and srv.server.exit_code == 0
    cut = plain[1]
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "server_shutting_down"
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    usage = json.loads(lines[-3][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    final = json.loads(lines[-4][6:])
    assert final["choices"][0]["finish_reason"] == "abort" and final["choices"][0]["delta"] == {}
    assert sorted(engine.cancelled) == sorted(r.request_id for r in engine.requests)  # rows freed
    assert engine.stopped


def test_engine_fault_makes_the_server_exit_nonzero():
    engine, app, gw = make(step_delay=0.05, drain_timeout_s=5)
    srv = LiveServer(app)
    done: list[list[str]] = []

    def stream():
        body = {"model": MODEL, "prompt": "x", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            done.append([ln for ln in r.iter_lines() if ln.startswith("data: ")])

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: engine.active, what="stream started")
    engine.fault = RuntimeError("device lost")
    wait_until(lambda: gw.failed is not None, what="the gateway to notice")
    r = httpx.get(srv.url + "/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    assert "RuntimeError" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    t.join(30)
    srv.thread.join(30)
    assert not srv.thread.is_alive() and srv.server.exit_code == 1
    assert done[0][-1] == "data: [DONE]"
