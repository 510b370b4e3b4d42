"""The gateway's SGLang engine against a fake runtime on loopback (tests/fake_sglang.py)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import pytest

from server.engine.protocol import (
    Engine,
    EngineError,
    GenerationRequest,
    ReportsReadiness,
    SamplingOptions,
    Verification,
    engine_readiness,
)
from server.engine.sglang.client import SGLangEngine, sampling_params_for, stats_from_meta
from server.engine.sglang.readiness import ProbeConfig, judge_probe
from tests.fake_sglang import N_DRAFT, FakeRuntime, free_port
from verifier.dial import WIRE_DIAL, PolicyKind

FULL_TEXT = "Hello world 日本! more text here"


@pytest.fixture(scope="module")
def runtime():
    fake = FakeRuntime().start()
    yield fake
    fake.stop()


@pytest.fixture
def fake(runtime):
    runtime.behavior = "ok"
    runtime.requests.clear()
    return runtime


def _engine(url, tiny_pair, **kw) -> SGLangEngine:
    target, _ = tiny_pair
    return SGLangEngine(url, str(target), num_draft=N_DRAFT, **kw)


def _request(max_tokens=64, weight=0.4, **kw) -> GenerationRequest:
    return GenerationRequest(
        request_id="req-1",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingOptions(max_tokens=max_tokens, temperature=0.7, top_k=0, seed=11, stop=("\n\n",)),
        verify=Verification(weight=weight, **kw),
    )


async def _collect(engine, request):
    return [c async for c in engine.generate(request)]


def run(coro):
    return asyncio.run(coro)


def test_engine_satisfies_the_protocol_without_importing_torch():
    code = "import sys, server.engine.sglang.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert isinstance(SGLangEngine("http://x", "/nowhere"), Engine)


def test_streaming_generation_deltas_stats_and_request_body(fake, tiny_pair):
    async def go():
        engine = _engine(fake.url, tiny_pair)
        await engine.start()
        try:
            return await _collect(engine, _request())
        finally:
            await engine.stop()

    chunks = run(go())
    assert "".join(c.text for c in chunks) == FULL_TEXT
    assert all("\ufffd" not in c.text for c in chunks)  # the split character is held back
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == list(range(100, 110))
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    last = chunks[-1]
    assert last.finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])
    assert last.prompt_tokens == 3 and last.completion_tokens == 10
    s = last.stats
    assert (s.verify_steps, s.drafts, s.draft_tokens) == (4, 4, 4 * N_DRAFT)
    assert s.accepted_tokens == 6 and s.acceptance_rate == pytest.approx(6 / 16)
    assert s.mean_weight == pytest.approx(0.4)
    body = fake.requests[-1]
    assert body["input_ids"] == [1, 2, 3] and body["stream"] is True and body["rid"] == "req-1"
    sp = body["sampling_params"]
    assert sp["custom_params"] == {
        "dialspec_w": 0.4,
        "dialspec_mode": "speculative",
    }
    assert sp["top_k"] == -1 and sp["max_new_tokens"] == 64 and sp["sampling_seed"] == 11
    assert sp["stop"] == ["\n\n"] and sp["temperature"] == 0.7


def test_length_finish_and_autoregressive_mode(fake, tiny_pair):
    async def go():
        engine = _engine(fake.url, tiny_pair)
        await engine.start()
        try:
            return await _collect(engine, _request(max_tokens=3, mode="autoregressive"))
        finally:
            await engine.stop()

    chunks = run(go())
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 3
    assert "".join(c.text for c in chunks) == "Hello world"
    assert fake.requests[-1]["sampling_params"]["custom_params"]["dialspec_mode"] == "autoregressive"
    assert chunks[-1].stats.mean_weight == 1.0  # served losslessly


@pytest.mark.parametrize(
    "behavior, kind, match",
    [
        ("http500", "unavailable", "HTTP 500: boom"),
        ("http400", "invalid_request", "bad sampling params"),
        ("abort", "invalid_request", "prompt too long"),
    ],
)
def test_runtime_errors_map_to_engine_error_kinds(fake, tiny_pair, behavior, kind, match):
    async def go():
        engine = _engine(fake.url, tiny_pair)
        await engine.start()
        fake.behavior = behavior
        try:
            await _collect(engine, _request())
        finally:
            await engine.stop()

    with pytest.raises(EngineError, match=match) as info:
        run(go())
    assert info.value.kind == kind


@pytest.mark.parametrize("behavior", ["stream_error", "cut"])
def test_failure_after_output_ends_the_stream_with_abort(fake, tiny_pair, behavior):
    async def go():
        engine = _engine(fake.url, tiny_pair)
        await engine.start()
        fake.behavior = behavior
        try:
            return await _collect(engine, _request())
        finally:
            await engine.stop()

    chunks = run(go())
    assert chunks[-1].finish_reason == "abort" and chunks[-1].stats is not None
    assert "".join(c.text for c in chunks) == "Hello wor"  # the two chunks sent before the failure


def test_timeout_is_unavailable(fake, tiny_pair):
    async def go():
        engine = _engine(fake.url, tiny_pair, read_timeout=0.3)
        await engine.start()
        fake.behavior, fake.stall_s = "stall", 3.0
        try:
            await _collect(engine, _request())
        finally:
            await engine.stop()

    with pytest.raises(EngineError, match="timed out") as info:
        run(go())
    assert info.value.kind == "unavailable"


def test_connection_refused_at_start_and_mid_life(fake, tiny_pair):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match="unreachable") as info:
        run(_engine(dead, tiny_pair).start())
    assert info.value.kind == "unavailable"

    async def go():  # started fine, then the runtime goes away
        engine = _engine(fake.url, tiny_pair)
        await engine.start()
        engine._client.base_url = httpx.URL(dead)
        try:
            await _collect(engine, _request())
        finally:
            await engine.stop()

    with pytest.raises(EngineError, match="request failed") as info:
        run(go())
    assert info.value.kind == "unavailable"


def test_unhealthy_runtime_refused_at_start(fake, tiny_pair):
    fake.behavior = "unhealthy"
    with pytest.raises(EngineError, match="unhealthy"):
        run(_engine(fake.url, tiny_pair).start())


def test_cancel_mid_stream_releases_the_request(fake, tiny_pair):
    async def go():
        engine = _engine(fake.url, tiny_pair)
        await engine.start()
        try:
            stream = engine.generate(_request())
            first = await stream.__anext__()
            assert engine.load()["running"] == 1
            await stream.aclose()
            return first, engine.load()
        finally:
            await engine.stop()

    first, load = run(go())
    assert first.text == "Hello" and load == {"running": 0, "waiting": 0}


def test_router_url_with_path_prefix_works_the_same(fake, tiny_pair):
    """An SGLang router forwards `/generate` unchanged; a base URL with a path must be kept."""

    async def proxy(request: httpx.Request) -> httpx.Response:
        assert request.url.path.startswith("/router/")
        url = fake.url + request.url.path[len("/router") :]
        async with httpx.AsyncClient() as client:
            upstream = await client.request(
                request.method, url, content=request.content, headers=request.headers
            )
            return httpx.Response(upstream.status_code, content=upstream.content, headers=upstream.headers)

    routed = httpx.MockTransport(proxy)

    async def go():
        engine = _engine("http://router.local/router", tiny_pair, transport=routed)
        await engine.start()
        try:
            return await _collect(engine, _request())
        finally:
            await engine.stop()

    assert "".join(c.text for c in run(go())) == FULL_TEXT


def test_non_streaming_protocol_of_the_fake_matches_sglang(fake):
    resp = httpx.post(
        fake.url + "/generate",
        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "stream": False},
    )
    data = resp.json()
    assert data["text"] == "Hello wor" and data["output_ids"] == [100, 101]
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_tokenization_uses_the_pair_tokenizer_and_chat_template(tiny_pair):
    engine = SGLangEngine("http://x", str(tiny_pair[0]))
    ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|user|>") and text.endswith("<|assistant|>\n")
    assert engine.tokenizer.decode(engine.encode_prompt("12 + 7 = 19")).endswith("12 + 7 = 19")


def test_helpers():
    req = _request(weight=0.25, dial=0.25)
    assert sampling_params_for(req)["custom_params"]["dialspec_dial"] == 0.25
    assert stats_from_meta({}, 0.5).acceptance_rate is None


# ---------------------------------------------------------------------------- readiness probe


async def _started(url, tiny_pair, **kw):
    engine = _engine(url, tiny_pair, **kw)
    await engine.start()
    return engine


def test_probe_proves_the_plugin_live_with_a_w0_request(fake, tiny_pair):
    async def go():
        engine = await _started(fake.url, tiny_pair)
        try:
            return await engine.readiness()
        finally:
            await engine.stop()

    assert run(go()) is None
    body = fake.requests[-1]
    sp = body["sampling_params"]
    assert body["stream"] is False and body["rid"].startswith("dialspec-probe-")
    assert sp["custom_params"]["dialspec_w"] == 0.0 and sp["temperature"] == 1.0
    assert sp["top_k"] == -1 and sp["top_p"] == 1.0 and sp["ignore_eos"] is True
    assert sp["max_new_tokens"] == ProbeConfig().tokens


@pytest.mark.parametrize(
    "behavior, match",
    [
        ("stock", r"plugin is not live on the SGLang runtime: at w = 0 it accepted \d+ of \d+ drafts"),
        ("plain", "no speculative counters"),
        ("http500", "probe failed: SGLang /generate HTTP 500"),
    ],
)
def test_probe_reports_a_runtime_without_the_plugin(fake, tiny_pair, behavior, match):
    async def go():
        fake.behavior = behavior
        engine = await _started(fake.url, tiny_pair)  # start itself succeeds: /health is fine
        try:
            return await engine.readiness()
        finally:
            await engine.stop()

    reason = run(go())
    assert reason is not None and re.search(match, reason), reason
    assert "\n" not in reason


def test_probe_is_repeated_and_follows_the_runtime(fake, tiny_pair):
    """Periodic re-checks: ready -> hooks gone (stock) -> unreachable -> back."""

    async def wait_for(engine, predicate):
        for _ in range(200):
            reason = await engine.readiness()
            if predicate(reason):
                return reason
            await asyncio.sleep(0.02)
        raise AssertionError(f"readiness stuck at {reason!r}")

    async def go():
        engine = await _started(fake.url, tiny_pair, probe=ProbeConfig(interval=0.05))
        try:
            assert await engine.readiness() is None
            fake.behavior = "stock"
            stock = await wait_for(engine, lambda r: r is not None)
            fake.behavior = "ok"
            fake.set_reachable(False)
            gone = await wait_for(engine, lambda r: r is not None and "unreachable" in r)
            fake.set_reachable(True)
            back = await wait_for(engine, lambda r: r is None)
            return stock, gone, back
        finally:
            fake.set_reachable(True)
            await engine.stop()

    stock, gone, back = run(go())
    assert "not live" in stock and "unreachable" in gone and back is None


def test_readiness_before_start_and_the_protocol_helper(tiny_pair):
    engine = _engine("http://x", tiny_pair)
    assert run(engine.readiness()) == "the SGLang engine is not started"
    assert isinstance(engine, ReportsReadiness)
    assert run(engine_readiness(engine)) == "the SGLang engine is not started"
    assert run(engine_readiness(object())) is None  # engines without a probe are ready


@pytest.mark.parametrize(
    "meta, expected",
    [
        ({"spec_num_proposed_drafts": 40, "spec_num_correct_drafts": 40}, None),
        ({"spec_num_proposed_drafts": 40, "spec_num_correct_drafts": 39}, "accepted 39 of 40"),
        ({"spec_num_proposed_drafts": 8, "spec_num_correct_drafts": 8}, "inconclusive"),
        ({}, "no speculative counters"),
    ],
)
def test_judge_probe(meta, expected):
    got = judge_probe(meta, min_drafts=32)
    assert got is None if expected is None else expected in got


# ---------------------------------------------------------------------------- capabilities


def test_capabilities_are_declared_honestly(tiny_pair):
    info = _engine("http://x", tiny_pair).info
    assert info.policies == (PolicyKind.ENSEMBLE,) and info.per_request_num_draft is False
    assert info.num_draft_limit == info.num_draft == N_DRAFT and info.has_head is False


@pytest.mark.parametrize(
    "verify, match",
    [
        (dict(policy=PolicyKind.LOSSY), "serves ensemble only, not lossy"),
        (dict(policy=PolicyKind.CASCADE), "serves ensemble only, not cascade"),
        (dict(policy=PolicyKind.TYPICAL), "serves ensemble only, not typical"),
        (dict(num_draft=N_DRAFT + 1), f"fixed N = {N_DRAFT}"),
        (dict(num_draft=N_DRAFT - 1), f"fixed N = {N_DRAFT}"),
        (dict(dial=0.5), "no learned head is loaded"),
    ],
)
def test_requests_it_cannot_serve_are_refused_not_dropped(fake, tiny_pair, verify, match):
    async def go():
        engine = await _started(fake.url, tiny_pair)
        sent = len(fake.requests)
        try:
            with pytest.raises(EngineError, match=match) as info:
                await _collect(engine, _request(**verify))
            return info.value.kind, len(fake.requests) - sent
        finally:
            await engine.stop()

    kind, sent = run(go())
    assert kind == "invalid_request" and sent == 0  # refused before anything reached the runtime


def test_the_runtime_n_and_autoregressive_mode_pass(fake, tiny_pair):
    async def go():
        engine = await _started(fake.url, tiny_pair)
        try:
            a = await _collect(engine, _request(num_draft=N_DRAFT))
            b = await _collect(engine, _request(mode="autoregressive", policy=PolicyKind.LOSSY))
            return a[-1].finish_reason, b[-1].finish_reason
        finally:
            await engine.stop()

    assert run(go()) == ("stop", "stop")


def test_head_setting_is_checked_against_the_runtime(fake, tiny_pair):
    with pytest.raises(EngineError, match="runs CUDA graphs") as info:
        run(_engine(fake.url, tiny_pair, has_head=True).start())
    assert info.value.kind == "unavailable"

    async def go():
        engine = await _started(fake.url, tiny_pair, has_head=True)
        try:
            return await _collect(engine, _request(dial=0.5))
        finally:
            await engine.stop()

    graphs = fake.server_info["cuda_graph_config"]
    fake.server_info["cuda_graph_config"] = {p: {"backend": "disabled"} for p in graphs}
    try:
        chunks = run(go())
    finally:
        fake.server_info["cuda_graph_config"] = graphs
    assert chunks[-1].finish_reason == "stop"
    assert fake.requests[-1]["sampling_params"]["custom_params"][WIRE_DIAL] == 0.5


def test_ignore_eos_is_forwarded():
    req = GenerationRequest("r", (1,), sampling=SamplingOptions(ignore_eos=True))
    assert sampling_params_for(req)["ignore_eos"] is True
    assert "ignore_eos" not in sampling_params_for(GenerationRequest("r", (1,)))


def test_embedded_engine_declares_its_capabilities(tiny_pair):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    engine = EmbeddedEngine(EmbeddedEngineConfig(target, draft, num_draft=3, max_num_draft=6))
    info = engine.info
    assert info.policies == tuple(PolicyKind) and info.per_request_num_draft is True
    assert info.max_num_draft == 6 and info.has_head is False
    assert "not started" in run(engine_readiness(engine))  # ready only once its models are loaded
