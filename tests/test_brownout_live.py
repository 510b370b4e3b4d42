"""Brownout through the API: `min_quality` at the edge, the served quality reported in every form,
and a small open-loop overload against the real embedded engine (the controller's direction, not
its numbers: the quality served drops under overload, never below a floor, and recovers)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine, live_server

MODEL = "scripted-pair"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    app = create_app(ScriptedEngine(), GatewaySettings(brownout_ttft_s=5.0))
    with live_server(app) as srv:
        yield srv, app.state.gateway


def chat(srv, **body):
    return httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": MSG, "max_tokens": 8, **body},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"quality": "lite", "min_quality": "pro"}, "above the requested quality"),
        ({"min_quality": 1.5}, "[0, 1]"),
        ({"min_quality": "platinum"}, "unknown min_quality tier"),
        ({"mode": "autoregressive", "min_quality": 0}, "remove min_quality"),
        ({"verifier": "lossy", "min_quality": 0}, "remove min_quality"),
    ],
)
def test_a_floor_brownout_cannot_honour_is_a_400_naming_it(served, body, says):
    r = chat(served[0], **body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_quality" and says in err["message"]
    assert err["code"] == "invalid_min_quality"


def test_min_quality_is_strictly_typed_and_documented(served):
    r = chat(served[0], min_quality=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_quality"
    doc = httpx.get(served[0].url + "/openapi.json").json()
    prop = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["min_quality"]
    assert {"type": "string", "enum": ["lite", "standard", "pro", "exact"]} in prop["anyOf"]


def test_the_schema_states_where_a_floor_is_refused(served):
    """What the dial refuses that JSON Schema can state is in the OpenAPI document (the fuzz test
    holds the server to it); a body the rules reject is what the server answers 400."""
    import jsonschema

    doc = httpx.get(served[0].url + "/openapi.json").json()
    rules = {"allOf": doc["components"]["schemas"]["ChatCompletionRequest"]["allOf"]}
    for body in ({"mode": "autoregressive"}, {"verifier": "typical"}, {"quality": "auto"}):
        jsonschema.validate(body, rules)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**body, "min_quality": 0}, rules)
    jsonschema.validate({"quality": "pro", "min_quality": 0}, rules)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": "pair:auto", "min_quality": "lite"}, rules)


def test_served_and_requested_quality_are_reported_in_body_headers_and_first_chunk(served):
    srv, gw = served
    assert gw.brownout.level == 0
    r = chat(srv, quality="pro", min_quality=0)
    ds = r.json()["dialspec"]
    assert (ds["tier"], ds["quality"], ds["requested_tier"], ds["min_quality"]) == ("pro", 0.75, "pro", 0.0)
    assert r.headers["x-dialspec-tier"] == "pro" and r.headers["x-dialspec-requested-quality"] == "0.75"
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=8, stream=True, extra_body={"quality": "lite"}
    )
    assert raw.headers["x-dialspec-tier"] == "lite"
    chunks = list(raw.parse())
    assert chunks[0].model_extra["dialspec"] == {
        "tier": "lite", "quality": 0.25, "requested_tier": "lite", "requested_quality": 0.25,
        "min_quality": 0.25,
    }  # fmt: skip


def test_at_a_brownout_level_only_requests_with_room_are_lowered(served):
    srv, gw = served
    gw.brownout.level = gw.brownout.max_level  # as the controller would under a heavy overload
    gw.brownout.tick = lambda: gw.brownout.level  # hold it there for this test
    try:
        lowered = chat(srv, quality="exact", min_quality="lite")
        kept = chat(srv, quality="exact")
        stream = httpx.post(
            srv.url + "/v1/completions",
            json={"model": MODEL, "prompt": "p", "max_tokens": 8, "stream": True, "min_quality": 0},
            timeout=30,
        )
    finally:
        del gw.brownout.tick
        gw.brownout.level = 0
    ds = lowered.json()["dialspec"]
    got = (ds["tier"], ds["requested_tier"], ds["min_quality"], ds["mean_w"])
    assert got == ("lite", "exact", 0.25, 0.25)
    assert lowered.headers["x-dialspec-quality"] == "0.25"
    assert kept.json()["dialspec"]["tier"] == "exact"
    first = json.loads(stream.text.split("\r\n\r\n")[0].removeprefix("data: "))
    assert first["dialspec"]["quality"] == 0.0 and first["dialspec"]["requested_quality"] == 1.0
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'dialspec:requests_by_quality_total{requested_tier="exact",served_tier="lite"} 1.0' in metrics
    assert 'dialspec:requests_by_quality_total{requested_tier="exact",served_tier="custom"} 1.0' in metrics
    assert "dialspec:brownout_level 0.0" in metrics


# -- a small overload on the embedded engine -----------------------------------------------------
FLOORS = [None, "lite", 0.0, 0.0]  # a quarter never lowered, a quarter down to lite, half to 0
QUALITY = {None: 1.0, "lite": 0.25, 0.0: 0.0}


async def _one(client: httpx.AsyncClient, floor, seed: int) -> dict:
    body = {"model": "tiny-pair", "prompt": "The quick brown", "max_tokens": 200, "seed": seed,
            "temperature": 1.0}  # fmt: skip
    if floor is not None:
        body["min_quality"] = floor
    r = await client.post("/v1/completions", json=body)
    out = {"status": r.status_code, "floor": QUALITY[floor]}
    if r.status_code == 200:
        out["served"] = r.json()["dialspec"]["quality"]
    return out


async def _open_loop(url: str, rate: float, seconds: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks, t = [], 0.0
        start = time.monotonic()
        while t < seconds:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, FLOORS[len(tasks) % 4], len(tasks))))
        return await asyncio.gather(*tasks)


async def _capacity(url: str, concurrency: int, n: int) -> float:
    """Requests per second of exact requests, `concurrency` always in flight (a closed loop)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        left = list(range(n))

        async def worker():
            while left:
                assert (await _one(client, None, left.pop()))["status"] == 200

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.monotonic() - start)


def _level(url: str) -> int:
    return httpx.get(url + "/v1/engine/runtime", timeout=10).json()["runtime"]["brownout"]["level"]


@pytest.mark.slow
def test_overload_on_the_embedded_engine_lowers_quality_within_floors_and_recovers(tiny_pair):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            target, draft, num_draft=4, max_batch=2, max_context=256, served_name="tiny-pair"
        )
    )
    app = create_app(engine, GatewaySettings(brownout_ttft_s=1.0, max_waiting=256))
    with live_server(app) as srv:
        capacity = asyncio.run(_capacity(srv.url, 2, 8))  # requests/s at exact, the batch kept full
        calm = asyncio.run(_open_loop(srv.url, 0.3 * capacity, 4.0, 1))
        assert all(r["status"] == 200 and r["served"] == 1.0 for r in calm), "lowered below capacity"
        peak = []

        async def overload():
            watch = asyncio.create_task(asyncio.to_thread(_poll_levels, srv.url, 10.0, peak))
            results = await _open_loop(srv.url, 3.0 * capacity, 6.0, 2)
            await watch
            return results

        hot = asyncio.run(overload())
        ok = [r for r in hot if r["status"] == 200]
        assert len(ok) >= 0.9 * len(hot)
        assert all(r["served"] >= r["floor"] for r in ok), "served below a floor"
        assert all(r["served"] == 1.0 for r in ok if r["floor"] == 1.0), "lowered a request without a floor"
        assert max(peak) >= 1 and any(r["served"] < 1.0 for r in ok), "overload did not lower quality"
        deadline = time.monotonic() + 30
        while _level(srv.url) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _level(srv.url) == 0, "did not recover after the overload"


def _poll_levels(url: str, seconds: float, out: list) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(_level(url))
        time.sleep(0.2)


def test_serve_takes_the_objective_from_the_command_line_and_refuses_a_bad_one():
    import subprocess
    import sys

    from server.gateway.serve import _settings, register

    parser = __import__("argparse").ArgumentParser()
    register(parser.add_subparsers())
    assert _settings(parser.parse_args(["serve", "--brownout-ttft", "1.5"])).brownout_ttft_s == 1.5
    assert _settings(parser.parse_args(["serve"])).brownout_ttft_s == 0  # off unless asked
    cmd = "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", cmd, "serve", "--brownout-ttft", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "brownout_ttft_s" in out.stderr
