"""The gateway on the real EmbeddedEngine (tiny random-init pair): the `openai` client against a
live server, the metrics page moving as the dial says it should, disconnects freeing engine rows,
and `dialspec serve` as a user runs it."""

from __future__ import annotations

import math
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import live_server

NAME = "tiny-pair"
# what the `dialspec` console script runs (`python -m server.cli` would make a second CLIError class)
DIALSPEC = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"]
MSG = [{"role": "user", "content": "Tom has 12 apples"}]


@pytest.fixture(scope="module")
def served(tiny_pair):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(target, draft, num_draft=4, max_batch=4, max_context=256, served_name=NAME)
    )
    app = create_app(engine, GatewaySettings())
    with live_server(app) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_chat_and_completion(client):
    r = client.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=12, seed=3, extra_body={"quality": "lite"}
    )
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 12
    ds = r.model_extra["dialspec"]
    assert ds["tier"] == "lite" and ds["mean_w"] == pytest.approx(0.25)
    assert ds["verify_steps"] >= 1 and ds["draft_tokens"] == 4 * ds["drafts"]
    c = client.completions.create(model=f"{NAME}:exact", prompt="The quick brown", max_tokens=8, seed=1, n=2)
    assert len(c.choices) == 2 and c.model_extra["dialspec"]["mean_w"] == pytest.approx(1.0)


def test_engine_runtime_shows_dtype_and_the_live_cost_model(served):
    srv, engine = served
    body = httpx.get(srv.url + "/v1/engine/runtime", timeout=10).json()
    rt = body["runtime"]
    assert body["backend"] == "embedded" and rt["dtype"] == "float32" and rt["draft_length"] == 4
    cost = rt["cost_model"]  # ms per stage at batch 1 and max_batch, JSON keys are strings
    assert set(cost["target_ms"]) == {"1", str(engine.config.max_batch)}
    assert len(cost["target_ms"]["1"]) == engine.config.max_num_draft + 1
    assert all(v > 0 for v in cost["target_ms"]["1"]) and cost["draft_step_ms"]["1"] > 0


def test_stream_equals_non_stream_for_a_seed(client):
    kw = dict(model=NAME, messages=MSG, max_tokens=16, seed=7, temperature=1.0, extra_body={"quality": 0.5})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[-1].model_extra["dialspec"] == whole.model_extra["dialspec"]


def test_quality_zero_with_a_pinned_n_accepts_every_draft(served, client):
    """An engine-wide num_draft pins N, so quality 0 stays speculative there (w = 0: all accepted)."""
    rt = httpx.get(served[0].url + "/v1/engine/runtime", timeout=10).json()["runtime"]
    assert rt["quality_zero"] == "speculative"
    r = client.completions.create(
        model=NAME, prompt="def add", max_tokens=20, seed=2, extra_body={"quality": 0}
    )
    ds = r.model_extra["dialspec"]
    assert ds["draft_tokens"] > 0 and ds["acceptance_rate"] == 1.0 and ds["draft_only_tokens"] == 0


def test_quality_zero_is_served_by_the_draft_alone(tiny_pair):
    """The adaptive engine (the default): ν = q at quality 0, so no target forward runs for it. The
    response says so (draft-only tokens, nothing proposed or verified, mean w 0), the trace labels
    every token a draft with w = 0, the metrics count them; a per-request num_draft still pins the
    speculative path."""
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    engine = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=2, max_context=128, served_name=NAME))
    with live_server(create_app(engine, GatewaySettings())) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        rt = httpx.get(srv.url + "/v1/engine/runtime", timeout=10).json()["runtime"]
        assert rt["quality_zero"] == "draft only"
        before = _scrape(srv.url)
        kw = dict(model=NAME, prompt="def add", max_tokens=20, seed=2)
        r = client.completions.create(**kw, extra_body={"quality": 0, "dialspec_trace": True})
        ds = r.model_extra["dialspec"]
        assert ds["draft_only_tokens"] == 20 and ds["verify_steps"] == ds["draft_tokens"] == 0
        assert ds["acceptance_rate"] is None and ds["mean_w"] == 0.0
        trace = r.choices[0].model_extra["dialspec_trace"]
        assert len(trace) == 20 and {(t["source"], t["w"]) for t in trace} == {("draft", 0.0)}
        delta = _scrape(srv.url).get('dialspec:draft_only_tokens_total{tier="custom"}', 0.0)
        assert delta - before.get('dialspec:draft_only_tokens_total{tier="custom"}', 0.0) == 20
        pinned = client.completions.create(**kw, extra_body={"quality": 0, "num_draft": 2})
        ds = pinned.model_extra["dialspec"]
        assert ds["draft_only_tokens"] == 0 and ds["draft_tokens"] > 0 and ds["acceptance_rate"] == 1.0


def _scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_metrics_lower_quality_raises_acceptance(served, client):
    """A fixed-seed batch per tier; the metrics deltas must equal the responses' own counters, and
    lite (w = 0.25) must accept a larger share of drafts than exact (w = 1).

    Why the test is sound: per draft position acceptance is 1 - w*TV(p, q) (docs/algorithm.md),
    so for any pair with TV > 0 the expected rate is strictly decreasing in w. Each request's rate is
    a mean of bounded indicators; with K = 8 requests per arm (at least 6 reach a drafting round;
    one that ends on its first token has no rate) the difference of means over its
    standard error (Welch) is approximately normal, and we require z > 3 (one-sided false-alarm
    rate ~0.1% if the engine ignored w). Seeds are fixed, so the outcome is also reproducible."""
    srv, _ = served
    before = _scrape(srv.url)
    rates: dict[str, list[float]] = {"lite": [], "exact": []}
    mean_ws: list[float] = []
    sums = {tier: {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0} for tier in rates}
    for tier in rates:
        for seed in range(8):
            r = client.completions.create(
                model=f"{NAME}:{tier}", prompt=f"Question {seed}:", max_tokens=24, seed=seed, temperature=1.0
            )
            ds = r.model_extra["dialspec"]
            if ds["acceptance_rate"] is not None:  # None: it ended (EOS) before its first round
                rates[tier].append(ds["acceptance_rate"])
                mean_ws.append(ds["mean_w"])
            for key in sums[tier]:
                sums[tier][key] += ds[key]
    after = _scrape(srv.url)

    def delta(name, **labels):
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else name
        return after.get(key, 0.0) - before.get(key, 0.0)

    for tier in rates:
        assert delta("dialspec:spec_decode_num_drafts_total", tier=tier) == sums[tier]["drafts"]
        assert delta("dialspec:spec_decode_num_draft_tokens_total", tier=tier) == sums[tier]["draft_tokens"]
        assert (
            delta("dialspec:spec_decode_num_accepted_tokens_total", tier=tier)
            == sums[tier]["accepted_tokens"]
        )
        assert delta("dialspec:e2e_request_latency_seconds_count", tier=tier) == 8
        assert delta("dialspec:time_to_first_token_seconds_count", tier=tier) == 8
    assert all(len(r) >= 6 for r in rates.values())
    assert delta("dialspec:ensemble_weight_count") == len(mean_ws)
    assert delta("dialspec:ensemble_weight_sum") == pytest.approx(sum(mean_ws))
    per_pos = sum(
        delta("dialspec:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(4)
    )
    assert per_pos == sums["lite"]["accepted_tokens"] + sums["exact"]["accepted_tokens"]

    def mean_var(xs):
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    (ml, vl), (me, ve) = mean_var(rates["lite"]), mean_var(rates["exact"])
    z = (ml - me) / math.sqrt(vl / 8 + ve / 8 + 1e-12)
    assert z > 3, (rates, z)
    pooled = {t: sums[t]["accepted_tokens"] / sums[t]["draft_tokens"] for t in sums}
    assert pooled["lite"] > pooled["exact"]


def test_disconnect_frees_engine_rows(served):
    srv, engine = served
    body = {"model": NAME, "prompt": "x", "max_tokens": 200, "stream": True, "quality": 1.0}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
    deadline = time.monotonic() + 10
    while engine.load()["running"] or srv.server.config.app.state.gateway.admission.running:
        assert time.monotonic() < deadline, engine.load()
        time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_end_to_end(tiny_pair):
    target, draft = tiny_pair
    cmd = [*DIALSPEC, "serve", "--target", str(target), "--draft", str(draft)]
    cmd += [
        "--port",
        str(_free_port()),
        "--max-context",
        "256",
        "--served-name",
        NAME,
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server listens
        match = re.search(r"(http://\S+/v1)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        cli = openai.OpenAI(base_url=match.group(1), api_key="x", max_retries=0, timeout=60)
        assert NAME in [m.id for m in cli.models.list()]
        r = cli.chat.completions.create(model=f"{NAME}:standard", messages=MSG, max_tokens=5)
        assert r.model_extra["dialspec"]["tier"] == "standard"
        assert "dialspec:spec_decode_num_drafts_total" in httpx.get(match.group(1)[:-3] + "/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: graceful shutdown, then the conventional 130
        assert proc.wait(60) in (0, 130)
        assert "Traceback" not in proc.stderr.read()


def test_cli_port_in_use_is_one_line(tiny_pair):
    target, draft = tiny_pair
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [*DIALSPEC, "serve", "--target", str(target), "--draft", str(draft)]
        out = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "already in use" in out.stderr and "--port" in out.stderr
