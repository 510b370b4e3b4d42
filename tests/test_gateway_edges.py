"""Edges a new user hits first: lone surrogates in the text (400 naming the field, connection kept),
slow clients (cut after the head / body deadline, while others are served; a connection cap),
/ready answering 503 `starting` from the moment the port is bound, and num_draft's own error code."""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.fake_sglang import free_port
from tests.scripted_engine import ScriptedEngine, live_server

MODEL = "scripted-pair"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server():
    settings = GatewaySettings(header_timeout_s=1.0, body_timeout_s=1.0)
    with live_server(create_app(ScriptedEngine(), settings)) as srv:
        yield srv


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _post_raw(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    # json.dumps escapes a lone surrogate as \udXXX (valid JSON); httpx would fail to encode it.
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


# ------------------------------------------------------------------------------------- surrogates
SURROGATE_CASES = [
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "\udfff"}]},
            ]
        },  # noqa: E501
        "messages.1.content.0.text",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "\udc00"}]}, "messages.0.name"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud83d"]}, "stop.0"),
    (COMP, {"prompt": "x\ud800"}, "prompt"),
    (COMP, {"prompt": ["fine", "\udbff"]}, "prompt.1"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("path", "fields", "param"), SURROGATE_CASES, ids=[c[2] for c in SURROGATE_CASES])
def test_lone_surrogate_is_a_400_naming_the_field_and_keeps_the_connection(
    server, path, fields, param, stream
):
    conn = http.client.HTTPConnection(*_host_port(server.url), timeout=30)
    try:
        status, body = _post_raw(conn, path, {"model": MODEL, "max_tokens": 3, "stream": stream, **fields})
        assert status == 400, body
        assert body["error"]["param"] == param and body["error"]["code"] == "invalid_unicode", body
        assert param in body["error"]["message"]
        sock = conn.sock
        assert sock is not None, "the server closed the keep-alive connection"
        ok = {"model": MODEL, "max_tokens": 3}
        ok |= {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
        status, body = _post_raw(conn, path, ok)
        assert status == 200, body
        assert conn.sock is sock, "the second request needed a new connection"
    finally:
        conn.close()


def _with_surrogate(text: str, surrogate: str, at: int) -> str:
    at = at % (len(text) + 1)
    return text[:at] + surrogate + text[at:]


lone_surrogates = st.integers(0xD800, 0xDFFF).map(chr)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)


@st.composite
def requests_with_a_lone_surrogate(draw):
    """A chat (string or list-form content, any message) or completion body (string or batch
    prompt), streamed or not, with one lone surrogate somewhere in one of its strings."""
    broken = _with_surrogate(draw(texts), draw(lone_surrogates), draw(st.integers(0, 12)))
    stream = draw(st.booleans())
    if draw(st.booleans()):
        n = draw(st.integers(1, 3))
        messages = [{"role": "user", "content": draw(texts) or "x"} for _ in range(n)]
        i = draw(st.integers(0, n - 1))
        if draw(st.booleans()):
            messages[i]["content"] = [{"type": "text", "text": "a"}, {"type": "text", "text": broken}]
            param = f"messages.{i}.content.1.text"
        else:
            messages[i]["content"] = broken
            param = f"messages.{i}.content"
        return CHAT, {"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 2}, param
    if draw(st.booleans()):
        return COMP, {"model": MODEL, "prompt": broken, "stream": stream, "max_tokens": 2}, "prompt"
    return COMP, {"model": MODEL, "prompt": ["ok", broken], "stream": stream, "max_tokens": 2}, "prompt.1"


def test_generated_lone_surrogates_are_always_refused_by_field(server):
    conn = http.client.HTTPConnection(*_host_port(server.url), timeout=30)

    @given(requests_with_a_lone_surrogate())
    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def check(case):
        path, body, param = case
        status, answer = _post_raw(conn, path, body)
        assert status == 400 and answer["error"]["param"] == param, answer
        assert answer["error"]["code"] == "invalid_unicode"

    try:
        check()
        assert httpx.get(server.url + "/metrics").text.count('request_errors_total{status="500"}') == 0
    finally:
        conn.close()


# ------------------------------------------------------------------------------------- num_draft
def test_num_draft_errors_have_their_own_code(server):
    for n in (0, 99):
        r = httpx.post(
            server.url + CHAT,
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "num_draft": n},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft"
        assert r.json()["error"]["code"] == "invalid_num_draft"


# ------------------------------------------------------------------------------------- slow clients
def _dribble(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    """Send `data` one byte every 0.2 s (a slowloris client) until the server answers or closes,
    or `stop`. (Sending on after the server closed would draw a TCP reset, which can discard the
    answer from our receive buffer before the test reads it.)"""
    for byte in data:
        if stop.wait(0.2) or select.select([sock], [], [], 0)[0]:
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    sock.settimeout(limit_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:  # closed with a reset: as closed, for a client
        pass
    return received


def test_slow_clients_are_cut_after_the_deadlines_while_others_are_served(server):
    """header_timeout_s = body_timeout_s = 1 (the fixture). A head dribbled byte by byte and a body
    that never completes are both cut (the body with 408) however long the client keeps sending,
    while ordinary requests on other connections are answered meanwhile."""
    host, port = _host_port(server.url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 20
    body_start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    body_start += b"Content-Length: 1000\r\n\r\n{"
    stop = threading.Event()
    slow = []
    for kind in ("head", "body"):
        s = socket.create_connection((host, port))
        if kind == "body":
            s.sendall(body_start)
        threading.Thread(
            target=_dribble, args=(s, head if kind == "head" else b" " * 200, stop), daemon=True
        ).start()
        slow.append((kind, s, time.monotonic()))
    try:
        served = 0
        for _ in range(3):  # while the slow ones hold their connections
            r = httpx.post(
                server.url + CHAT,
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                timeout=30,
            )
            served += r.status_code == 200
        assert served == 3
        for kind, s, opened in slow:
            received = _read_until_closed(s, limit_s=30)
            elapsed = time.monotonic() - opened
            assert elapsed >= 0.9, f"{kind}: cut before its deadline ({elapsed:.2f} s)"
            if kind == "head":
                assert received == b"", received  # nothing to answer: no request was parsed
            else:
                assert received.startswith(b"HTTP/1.1 408 "), received
                assert b'"request_timeout"' in received and b"connection: close" in received.lower()
    finally:
        stop.set()
        for _, s, _ in slow:
            s.close()


def test_connections_beyond_the_cap_get_503_until_the_slow_ones_are_cut():
    """max_connections = 4: with 4 connections holding unfinished heads, a request gets 503; once
    the head deadline (3 s) has cut them, requests are served again."""
    settings = GatewaySettings(header_timeout_s=3.0, max_connections=4)
    with live_server(create_app(ScriptedEngine(), settings)) as srv:
        host, port = _host_port(srv.url)
        held = [socket.create_connection((host, port)) for _ in range(4)]
        try:
            for s in held:
                s.sendall(b"GET /health HTTP/1.1\r\n")  # an unfinished head holds the connection
            time.sleep(0.2)  # let the server accept them
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
            for s in held:
                assert _read_until_closed(s, limit_s=30) == b""
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        finally:
            for s in held:
                s.close()


# ------------------------------------------------------------------------------------- /ready
# The engine takes 3 s to build and 3 s to start: long enough to be seen answering meanwhile.
SLOW_LOAD = (
    "import time\n"
    "import server.gateway.engines as engines\n"
    "from server.engine.embedded.engine import EmbeddedEngine\n"
    "build = engines.embedded_engine\n"
    "engines.embedded_engine = lambda *a: (time.sleep(3), build(*a))[1]\n"
    "start = EmbeddedEngine.start_sync\n"
    "EmbeddedEngine.start_sync = lambda self: (time.sleep(3), start(self))[1]\n"
)
MAIN = "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"


def test_ready_answers_503_starting_from_the_bind_until_the_engine_is_up(tiny_pair):
    """Polled from the moment the process starts: refused only until the port is bound (before
    any model loads); from then on every answer is 503 `starting` (/health 200) until /ready is
    200, with no refused connection in between."""
    target, draft = tiny_pair
    port = free_port()
    cmd = [sys.executable, "-c", SLOW_LOAD + MAIN, "serve", "--target", str(target), "--draft", str(draft)]
    cmd += ["--port", str(port), "--log-level", "warning", "--max-context", "128", "--num-draft", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    seen: list[object] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(url + "/ready", timeout=10)
            except httpx.TransportError as exc:
                seen.append(type(exc).__name__)
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json().get("error", {}).get("code") or r.json().get("status")))
            if r.status_code == 200:
                break
            if seen[-1] == (503, "starting"):
                assert httpx.get(url + "/health", timeout=10).status_code == 200
            time.sleep(0.1)
        answers = [s for s in seen if isinstance(s, tuple)]
        assert answers and answers[-1] == (200, "ready"), (seen, proc.poll() is None or proc.stderr.read())
        first = next(i for i, s in enumerate(seen) if isinstance(s, tuple))
        assert all(isinstance(s, tuple) for s in seen[first:]), f"refused after the bind: {seen}"
        assert set(answers[:-1]) == {(503, "starting")}, seen
        # ~6 s of loading at one poll per ~0.1 s: many answers before ready, never fewer than a few
        assert len(answers) >= 5, seen
        proc.kill()  # its stdout, whole: under load an access-log line can precede the banner
        assert re.search(r"serving '.*' at http://127\.0\.0\.1", proc.communicate(timeout=30)[0])
    finally:
        proc.kill()
        proc.wait(30)
