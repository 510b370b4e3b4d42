"""`dialspec loadtest` for brownout: the floor mix (`--floors`), goodput against a TTFT objective
(`--slo-ttft-ms`) and the served-quality report, pure and against a live gateway in overload."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loadtest.cli import plan_requests
from loadtest.client import RequestOptions, RequestRecord, build_body
from loadtest.prompts import Prompt
from loadtest.render import benchmark_block
from loadtest.runner import run_phase
from loadtest.schedule import LoadShape
from loadtest.summary import service_level, summarize_phase
from loadtest.tiers import TierMixError, assign, parse_floor_mix, parse_tier_mix
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine, live_server
from tests.test_loadtest import _run


def test_floor_mix_sends_min_quality_except_for_none():
    floors = parse_floor_mix("0:0.5,lite:0.3,none:0.2")
    assert [(f.name, f.quality) for f in floors] == [("0", 0.0), ("lite", "lite"), ("none", None)]
    assert parse_floor_mix(None) is None and parse_floor_mix("  ") is None
    with pytest.raises(TierMixError):
        parse_floor_mix("0:-1")
    prompts = [Prompt(uid="p", messages=({"role": "user", "content": "hi"},))]
    plan = plan_requests(400, prompts, parse_tier_mix("exact"), floors, seed=1)
    opts = RequestOptions(model="m")
    sent = [build_body(spec, opts).get("min_quality", "absent") for spec in plan]
    assert set(sent) == {0.0, "lite", "absent"}
    # floors come from their own stream: the same seed gives the same floors, independent of tiers
    assert [s.floor.name for s in plan] == [f.name for f in assign(floors, 400, 1, stream="floors")]
    mixed = plan_requests(400, prompts, parse_tier_mix("lite,exact"), floors, seed=1)
    assert [s.floor.name for s in mixed] == [s.floor.name for s in plan]


def _rec(ok=True, ttft=0.1, served=1.0, asked=1.0, floor=1.0, kind=None) -> RequestRecord:
    r = RequestRecord(0, "t", "p", ok=ok, ttft=ttft, error_kind=kind)
    if ok:
        r.dialspec = {"quality": served, "requested_quality": asked, "min_quality": floor}
    return r


def test_service_level_counts_goodput_refusals_and_floors():
    records = [
        _rec(ttft=0.1),
        _rec(ttft=0.9, served=0.25, floor=0.0),
        _rec(ttft=0.3, served=0.0, floor=0.25),  # a violation the report must show
        _rec(ok=False, kind="http_429"),
        _rec(ok=False, kind="timeout"),
    ]
    s = service_level(records, duration=2.0, slo_ttft_ms=500)
    assert s["met_slo"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert s["refused_429"] == 1 and s["refused_rate"] == pytest.approx(0.2)
    assert s["lowered"] == 2 and s["below_floor"] == 1
    assert s["served_quality_mean"] == pytest.approx(1.25 / 3) and s["requested_quality_mean"] == 1.0
    assert service_level(records, 2.0, None)["goodput"] is None


def test_live_overload_with_floors_reports_what_brownout_served(tmp_path, capsys):
    """Two slots, a 20 ms round: an exact request of 24 tokens takes ~22 rounds (acceptance
    1 - w * 0.9 per draft), so exact serves ~4.5 req/s; quality 0 takes 5 rounds. 8 req/s is an
    overload that lowering the 70 % of requests with a floor at 0 can absorb."""
    engine = ScriptedEngine(step_delay=0.02, max_batch=2, tv=0.9)
    settings = GatewaySettings(brownout_ttft_s=0.3, max_waiting=64)
    with live_server(create_app(engine, settings)) as srv:
        report = _run(
            srv.url, tmp_path, "--rate", "8", "--num-requests", "120", "--duration", "6",
            "--max-tokens", "24", "--tiers", "exact", "--floors", "0:0.7,none:0.3",
            "--slo-ttft-ms", "300", "--no-plots",
        )  # fmt: skip
    (phase,) = report["phases"]
    assert phase["sent"] == phase["completed"] + phase["failed"] == len(report["records"])
    assert phase["metrics_check"]["match"]  # per requested tier it cannot: one tier, many served labels
    svc = phase["service"]
    assert svc["below_floor"] == 0 and svc["lowered"] > 0
    assert svc["served_quality_mean"] < svc["requested_quality_mean"] == 1.0
    assert 0 < svc["goodput"] <= phase["request_throughput"]
    for r in report["records"]:
        if r["ok"] and r["floor"] == "none":
            assert r["dialspec"]["quality"] == 1.0  # no floor: never lowered
    assert report["config"]["floors"] == "0:0.7,none:0.3"
    shown = capsys.readouterr().out
    assert "Goodput, TTFT <= 300 ms (req/s):" in shown and "Served below the floor:" in shown


def test_the_phase_reports_how_far_the_load_generator_fell_behind(tmp_path):
    """A generator whose own event loop stalls reports it: the lag is in the phase, the warning in
    the block (its latencies would include the stall)."""
    prompts = [Prompt(uid="p", messages=({"role": "user", "content": "hi"},))]
    plan = plan_requests(6, prompts, parse_tier_mix("exact"), None, seed=0)
    opts = RequestOptions(model="scripted-pair", max_tokens=4)

    async def phase(url, stall_s):
        async with httpx.AsyncClient(base_url=url) as client:
            result = await run_phase(
                client, plan, opts, LoadShape("concurrency", 1), 30, 0, lambda rec: time.sleep(stall_s)
            )
        return summarize_phase(result)

    with live_server(create_app(ScriptedEngine(step_delay=0.01), GatewaySettings())) as srv:
        calm, stalled = asyncio.run(phase(srv.url, 0.0)), asyncio.run(phase(srv.url, 0.3))
    assert stalled["client_lag_ms"]["max"] >= 250 > calm["client_lag_ms"]["p99"]
    assert "fell behind" in benchmark_block(stalled) and "fell behind" not in benchmark_block(calm)
