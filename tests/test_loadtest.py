"""`dialspec loadtest`: pure units (percentiles, tier mix, Poisson schedule, SSE, Prometheus parsing)
and live runs on loopback: a fake OpenAI SSE server for the failure kinds, then the gateway over
the scripted engine (as the gateway's own tests start it) and over the embedded engine with the
tiny pair. Live checks: sent = successes + failures, token counts equal usage and the server's
counters, acceptance equals the /metrics delta."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtest.cli import UsageError, base_url
from loadtest.client import RequestOptions, RequestSpec, send
from loadtest.prompts import Prompt, PromptError, load_jsonl, load_prompts
from loadtest.schedule import LoadShape, parse_sweep, poisson_arrivals
from loadtest.scrape import delta, parse_spec_counters
from loadtest.sse import MalformedStream, SSEDecoder, parse_event
from loadtest.stats import percentile, summarize
from loadtest.tiers import DEFAULT_GROUP, TierMixError, assign, parse_tier_mix
from server.cli import main
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import ScriptedEngine, live_server

# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 4.0, 11.0, 0.5, 6.0, 8.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_scales_and_handles_empty():
    s = summarize([0.001, 0.002, 0.003, 0.004], scale=1000.0)
    assert s["count"] == 4 and s["mean"] == pytest.approx(2.5) and s["median"] == pytest.approx(2.5)
    assert s["p99"] == pytest.approx(np.percentile([1, 2, 3, 4], 99))
    empty = summarize([])
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99"] is None


# ---------------------------------------------------------------- tier mix


def test_tier_mix_parses_and_normalises():
    mix = parse_tier_mix("lite:0.3,standard:0.4,pro:0.3")
    assert [(t.name, t.quality) for t in mix] == [("lite", "lite"), ("standard", "standard"), ("pro", "pro")]
    assert [t.share for t in mix] == pytest.approx([0.3, 0.4, 0.3])
    mix = parse_tier_mix("lite:1, pro:3")
    assert [t.share for t in mix] == pytest.approx([0.25, 0.75])
    mix = parse_tier_mix("lite,exact")
    assert [t.share for t in mix] == pytest.approx([0.5, 0.5])
    numeric = parse_tier_mix("0.6:2,1:1")
    assert [t.quality for t in numeric] == [0.6, 1.0] and numeric[0].name == "0.6"
    (default,) = parse_tier_mix(None)
    assert default.name == DEFAULT_GROUP and default.quality is None and default.share == 1.0


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("lite:0.3,,pro:0.7", "empty item"),
        ("lite:abc", "bad weight"),
        ("lite:-1", "positive"),
        ("lite:0", "positive"),
        ("lite:nan", "positive"),
        ("lite:1,lite:2", "twice"),
        ("1.5:1", "[0, 1]"),
        (":0.3", "bad tier name"),
        ("li te:0.3", "bad tier name"),
    ],
)
def test_tier_mix_errors_say_how_to_fix(text, fragment):
    with pytest.raises(TierMixError, match=None) as info:
        parse_tier_mix(text)
    assert fragment in str(info.value)


def test_tier_assignment_seeded_and_proportional():
    mix = parse_tier_mix("lite:0.3,standard:0.4,pro:0.3")
    a = [t.name for t in assign(mix, 3000, seed=7)]
    assert a == [t.name for t in assign(mix, 3000, seed=7)]
    assert a != [t.name for t in assign(mix, 3000, seed=8)]
    # each share within 5 binomial standard deviations
    for tier in mix:
        sd = math.sqrt(tier.share * (1 - tier.share) / len(a))
        assert abs(a.count(tier.name) / len(a) - tier.share) < 5 * sd


# ---------------------------------------------------------------- schedules


def test_poisson_schedule_is_deterministic_and_has_the_right_rate():
    a = poisson_arrivals(4.0, 4000, seed=1)
    assert a == poisson_arrivals(4.0, 4000, seed=1)
    assert a != poisson_arrivals(4.0, 4000, seed=2)
    gaps = [y - x for x, y in zip([0.0, *a], a, strict=False)]
    assert all(g > 0 for g in gaps)
    # exponential gaps: mean 1/rate, sd 1/rate; mean of n gaps within 5 sd / sqrt(n)
    assert abs(statistics.fmean(gaps) - 0.25) < 5 * 0.25 / math.sqrt(len(gaps))
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, seed=0)


def test_sweep_parsing():
    assert parse_sweep("1,4,8", "concurrency") == [1, 4, 8]
    assert parse_sweep("0.5, 2, inf", "rate") == [0.5, 2, math.inf]
    for bad, kind in (("1,x", "concurrency"), ("0", "concurrency"), ("1.5", "concurrency"), ("-1", "rate")):
        with pytest.raises(ValueError):
            parse_sweep(bad, kind)
    assert LoadShape("rate", math.inf).label == "rate=inf"


# ---------------------------------------------------------------- SSE parsing


def test_sse_decoder_events_comments_multiline_crlf_and_flush():
    dec = SSEDecoder()
    lines = [": ping", "event: message", 'data: {"a":', "data: 1}", "", "data:[DONE]\r", "\r"]
    out = [d for d in (dec.feed(line) for line in lines) if d is not None]
    assert out == ['{"a":\n1}', "[DONE]"]
    dec.feed("data: tail")
    assert dec.flush() == "tail" and dec.flush() is None


def test_parse_chat_completion_usage_error_and_done_chunks():
    chat = parse_event(
        '{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},'
        '"finish_reason":null}],"usage":null}'
    )
    assert chat.text == "Hi" and chat.has_choices and chat.usage is None
    finish = parse_event('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}')
    assert finish.text == "" and finish.finish_reason == "length"
    comp = parse_event(
        '{"object":"text_completion","choices":[{"index":0,"text":" there","finish_reason":null}]}'
    )
    assert comp.text == " there"
    usage = parse_event(
        '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9,"total_tokens":14},'
        '"dialspec":{"tier":"lite","drafts":3,"draft_tokens":12,"accepted_tokens":6}}'
    )
    assert not usage.has_choices and usage.usage["completion_tokens"] == 9 and usage.dialspec["drafts"] == 3
    assert parse_event("[DONE]").done
    err = parse_event('{"error":{"message":"boom","type":"server_error"}}')
    assert err.error["message"] == "boom"
    for bad in ("not json", "[1,2]", '{"choices": 3}', '{"choices":[{"delta":{"content":5}}]}'):
        with pytest.raises(MalformedStream):
            parse_event(bad)


# ---------------------------------------------------------------- prompts, URL, Prometheus


def test_prompts_from_suite_and_jsonl(tmp_path):
    suite = load_prompts("suite", 2, seed=0)
    assert len(suite) == 6 and suite == load_prompts("suite", 2, seed=0)
    assert [p.uid.split("-")[0] for p in suite[:3]] == ["code", "math", "summary"]
    assert len(load_prompts("suite:math", 3, seed=0)) == 3
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hi", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n'
    )
    prompts = load_jsonl(path)
    assert prompts[0].max_tokens == 5 and prompts[1].messages[0]["content"] == "yo"
    path.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2"):
        load_jsonl(path)
    with pytest.raises(PromptError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(PromptError, match="unknown suite task"):
        load_prompts("suite:poetry", 1, seed=0)


def test_base_url_validation():
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert base_url("http://localhost:9") == "http://localhost:9"
    for bad in ("127.0.0.1:8000", "ftp://x", "http://", "http://h:99999"):
        with pytest.raises(UsageError):
            base_url(bad)


PROM = """# HELP dialspec:spec_decode_num_drafts_total Speculative proposal rounds.
# TYPE dialspec:spec_decode_num_drafts_total counter
dialspec:spec_decode_num_drafts_total{tier="lite"} 10.0
dialspec:spec_decode_num_drafts_total{tier="pro"} 4.0
dialspec:spec_decode_num_draft_tokens_total{tier="lite"} 40.0
dialspec:spec_decode_num_accepted_tokens_total{tier="lite"} 30.0
dialspec:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0
dialspec:generation_tokens_total{tier="lite"} 77.0
"""


def test_prometheus_parse_and_delta():
    before = parse_spec_counters(PROM)
    assert before["lite"] == {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 30.0}
    assert before["pro"]["drafts"] == 4.0
    after = parse_spec_counters(
        PROM.replace("} 10.0", "} 13.0") + 'x:spec_decode_num_drafts_total{tier="std"} 2\n'
    )
    assert delta(before, after) == {
        "lite": {"drafts": 3.0, "draft_tokens": 0.0, "accepted_tokens": 0.0},
        "std": {"drafts": 2.0, "draft_tokens": 0.0, "accepted_tokens": 0.0},
    }
    assert parse_spec_counters("vllm:spec_decode_num_drafts_total 5\n") == {
        "all": {"drafts": 5.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    }


# ---------------------------------------------------------------- failure kinds (fake SSE server)


def _sse(*events: str, done: bool = True) -> str:
    body = "".join(f"data: {e}\n\n" for e in events)
    return body + ("data: [DONE]\n\n" if done else "")


GOOD = _sse(
    '{"choices":[{"index":0,"delta":{"role":"assistant","content":"a"},"finish_reason":null}],"usage":null}',
    '{"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":null}],"usage":null}',
    '{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}',
    '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},'
    '"dialspec":{"tier":"lite","drafts":1,"draft_tokens":4,"accepted_tokens":1}}',
)


async def _fake(request):
    body = await request.json()
    mode = body["model"]
    if mode == "good":
        return Response(GOOD, media_type="text/event-stream")
    if mode == "bad_json":
        return Response(_sse("{oops"), media_type="text/event-stream")
    if mode == "no_done":
        return Response(GOOD.replace("data: [DONE]\n\n", ""), media_type="text/event-stream")
    if mode == "not_sse":
        return JSONResponse({"choices": []})
    if mode == "in_stream_error":
        return Response(_sse('{"error":{"message":"engine died"}}'), media_type="text/event-stream")
    if mode == "overloaded":
        return JSONResponse({"error": {"message": "busy"}}, status_code=429)
    if mode == "slow":

        async def slow():
            yield "data: " + GOOD.split("data: ")[1]
            await asyncio.sleep(5)

        return StreamingResponse(slow(), media_type="text/event-stream")
    raise AssertionError(mode)


@pytest.fixture(scope="module")
def fake_server():
    app = Starlette(routes=[Route("/v1/chat/completions", _fake, methods=["POST"])])
    with live_server(app) as srv:
        yield srv.url


def _send(url: str, model: str, timeout: float = 5.0):
    spec = RequestSpec(0, Prompt("p0", ({"role": "user", "content": "hi"},)), parse_tier_mix("lite")[0], 1)
    opts = RequestOptions(model=model, timeout=timeout)

    async def go():
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            return await send(client, spec, opts, phase_start=0.0)

    return asyncio.run(go())


def test_client_parses_a_good_stream(fake_server):
    rec = _send(fake_server, "good")
    assert rec.ok and rec.error_kind is None and rec.status == 200
    assert rec.output_tokens == 2 and rec.prompt_tokens == 3 and rec.chunks == 2 and len(rec.itl) == 1
    assert rec.dialspec["accepted_tokens"] == 1 and rec.finish_reason == "stop"
    assert 0 < rec.ttft <= rec.e2e and rec.tpot == pytest.approx(rec.e2e - rec.ttft)


@pytest.mark.parametrize(
    "model, kind",
    [
        ("bad_json", "malformed_stream"),
        ("no_done", "malformed_stream"),
        ("not_sse", "malformed_stream"),
        ("in_stream_error", "stream_error"),
        ("overloaded", "http_429"),
    ],
)
def test_client_classifies_failures(fake_server, model, kind):
    rec = _send(fake_server, model)
    assert not rec.ok and rec.error_kind == kind and rec.error


def test_client_timeout_and_connection_failures(fake_server):
    rec = _send(fake_server, "slow", timeout=0.5)
    assert not rec.ok and rec.error_kind == "timeout"
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = _send(f"http://127.0.0.1:{port}", "good")
    assert not rec.ok and rec.error_kind == "connection"


# ---------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--url", "localhost:8000"], "not an http(s) URL"),
        (["--tiers", "lite:0.3,,pro"], "--tiers: empty item"),
        (["--concurrency", "0"], "whole numbers >= 1"),
        (["--rate", "fast"], "comma-separated numbers"),
        (["--num-requests", "0"], "--num-requests"),
        (["--prompts", "/nonexistent.jsonl"], "does not exist"),
        (["--extra-body", "{bad"], "--extra-body"),
    ],
)
def test_cli_user_mistakes_are_one_line(capsys, argv, fragment):
    assert main(["loadtest", "--no-plots", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dialspec: error:") and fragment in err and "\n" not in err


def test_cli_unreachable_server_says_how_to_fix(capsys, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["loadtest", "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot connect" in err and "dialspec serve" in err


# ---------------------------------------------------------------- live gateway runs


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _run(url: str, tmp_path, *argv: str) -> dict:
    rc = main(["loadtest", "--url", url, "--out", str(tmp_path), "--quiet", *argv])
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    report["dir"] = run_dir
    report["records"] = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    return report


def _check_consistency(phase: dict, records: list[dict]) -> None:
    """Invariants of any phase: every sent request is counted once; totals equal usage sums;
    acceptance from the responses equals the /metrics delta, tier by tier."""
    assert phase["sent"] == phase["completed"] + phase["failed"] == len(records)
    assert phase["failed"] == sum(phase["failures"].values())
    ok = [r for r in records if r["ok"]]
    assert phase["total_output_tokens"] == sum(r["output_tokens"] for r in ok)
    assert phase["total_input_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert phase["usage_missing"] == 0
    check = phase["metrics_check"]
    assert check["available"] and check["match"], check
    for tier in phase["tiers"].values():
        spec = tier["spec"]
        if spec["acceptance_rate"] is not None:
            assert tier["metrics_acceptance_rate"] == pytest.approx(spec["acceptance_rate"])
            assert tier["metrics_mean_accepted_length"] == pytest.approx(spec["mean_accepted_length"])


def test_live_gateway_tier_mix_sweep(tmp_path, capsys):
    engine = ScriptedEngine(step_delay=0.002, max_batch=4)
    app = create_app(engine, GatewaySettings())
    with live_server(app) as srv:
        before = httpx.get(srv.url + "/metrics").text
        report = _run(
            srv.url, tmp_path, "--concurrency", "1,4", "--num-requests", "18", "--max-tokens", "24",
            "--tiers", "lite:0.3,standard:0.4,pro:0.3", "--seed", "3",
        )  # fmt: skip
        after = httpx.get(srv.url + "/metrics").text
    phases = report["phases"]
    assert [p["label"] for p in phases] == ["concurrency=1", "concurrency=4"]
    shown = capsys.readouterr().out
    for line in (
        "Serving Benchmark Result (concurrency=4)",
        "Successful requests:",
        "P99 TTFT (ms):",
        "Acceptance length:",
        "/metrics delta vs responses:                 match",
        "Sweep",
    ):
        assert line in shown
    for phase in phases:
        recs = [r for r in report["records"] if r["phase"] == phase["label"]]
        _check_consistency(phase, recs)
        assert phase["completed"] == 18 and phase["stopped_by"] == "count"
        assert list(phase["tiers"]) == [t for t in ("lite", "standard", "pro") if t in phase["tiers"]]
        for r in recs:  # the server applied the tier we asked for
            assert r["dialspec"]["tier"] == r["tier"]
            assert 1 <= r["output_tokens"] <= 24 and r["ttft"] <= r["e2e"]
    # output tokens equal the server's own generation counter over the whole run
    generated = _metric(after, "dialspec:generation_tokens_total") - _metric(
        before, "dialspec:generation_tokens_total"
    )
    assert generated == sum(p["total_output_tokens"] for p in phases)
    # same seed, same workload: both phases drew the same tiers and got the same outputs
    assert (
        phases[0]["tiers"]["lite"]["total_output_tokens"] == phases[1]["tiers"]["lite"]["total_output_tokens"]
    )
    # lower quality accepts more drafts (scripted engine: acceptance 1 - w * TV per position)
    rates = [phases[0]["tiers"][t]["spec"]["acceptance_rate"] for t in ("lite", "standard", "pro")]
    assert rates[0] > rates[1] > rates[2]
    for stem in ("throughput", "latency_by_tier", "acceptance_by_tier"):
        for ext in ("png", "svg"):
            assert (report["dir"] / f"{stem}.{ext}").stat().st_size > 1000


def test_live_gateway_overload_and_duration_bound(tmp_path):
    """A server with one slot and no queue answers 429 under load: failures are counted by kind,
    and a rate run stops issuing at the duration bound, long before its request bound."""
    engine = ScriptedEngine(step_delay=0.01, max_batch=1)
    app = create_app(engine, GatewaySettings(max_waiting=0))
    with live_server(app) as srv:
        report = _run(
            srv.url, tmp_path, "--rate", "40", "--num-requests", "1000", "--duration", "1.5",
            "--max-tokens", "16", "--no-plots",
        )  # fmt: skip
    (phase,) = report["phases"]
    assert phase["stopped_by"] == "duration" and 10 < phase["sent"] < 1000
    assert phase["failures"].get("http_429", 0) > 0 and phase["completed"] > 0
    _check_consistency(phase, report["records"])
    assert phase["duration_s"] < 1.5 + 5


def test_live_embedded_gateway(tiny_pair, tmp_path):
    """The real embedded engine (tiny random pair) behind the gateway."""
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    engine = EmbeddedEngine(EmbeddedEngineConfig(target, draft, num_draft=3, max_batch=4, max_context=256))
    with live_server(create_app(engine, GatewaySettings())) as srv:
        report = _run(
            srv.url, tmp_path, "--concurrency", "4", "--num-requests", "8", "--max-tokens", "12",
            "--tiers", "lite,exact", "--endpoint", "completions", "--no-plots",
        )  # fmt: skip
    (phase,) = report["phases"]
    assert phase["completed"] == 8
    _check_consistency(phase, report["records"])
    assert phase["spec"]["drafts"] > 0
