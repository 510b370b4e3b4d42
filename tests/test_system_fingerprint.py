"""`system_fingerprint` (issue 31, seeds and dtype): one id for what decides a seeded request's
output on the embedded engine (`server/engine/embedded/fingerprint.py`), served as OpenAI's field
on every response and stream chunk.

Checked here: the same config restarted gives the same fingerprint and the same seeded output
(pinned N: the start-up profile does not enter); another dtype, another N schedule or another
start-up profile under the adaptive N give another fingerprint; the gateway serves the engine's on
responses and every chunk, and null for the SGLang backend, which makes no such promise. Whether
the same fingerprint also means the same output whatever the batch is tests/test_engine_seeds.py
(float32); in bfloat16 it does not hold (README, "Seeds").
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.embedded.fingerprint import system_fingerprint
from server.engine.protocol import GenerationRequest, SamplingOptions
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.fake_sglang import sglang_gateway
from tests.scripted_engine import live_server
from tests.tiny_pair import drafting_costs
from verifier.dial import Verification

MSG = [{"role": "user", "content": "Tom has 12 apples"}]


def _config(tiny_pair, **kw) -> EmbeddedEngineConfig:
    return EmbeddedEngineConfig(*tiny_pair, max_batch=2, max_context=128, profile_budget_s=0.2, **kw)


def _seeded_output(engine) -> list[int]:
    ids = tuple(engine.encode_chat(MSG))
    request = GenerationRequest(
        "s", ids, SamplingOptions(max_tokens=24, seed=5, ignore_eos=True), Verification(weight=0.5)
    )

    async def go():
        return [t async for c in engine.generate(request) for t in c.token_ids]

    return asyncio.run(go())


def _started(config: EmbeddedEngineConfig, generate: bool = False):
    engine = EmbeddedEngine(config)
    engine.start_sync()
    try:
        out = _seeded_output(engine) if generate else None
        return engine.info.system_fingerprint, engine.info.runtime["fingerprint_of"], out
    finally:
        asyncio.run(engine.stop())


def test_a_restart_of_the_same_config_keeps_it_and_another_dtype_changes_it(tiny_pair):
    first, parts, out = _started(_config(tiny_pair, num_draft=3), generate=True)
    again, _, out_again = _started(_config(tiny_pair, num_draft=3), generate=True)
    assert first.startswith("fp_") and len(first) == 15
    assert again == first and out_again == out  # restarted: same fingerprint, same seeded tokens
    assert parts["dtype"] == "torch.float32" and parts["draft_length"] == 3 and parts["profile"] is None
    bf16, bf16_parts, _ = _started(_config(tiny_pair, num_draft=3, dtype="bfloat16"))
    assert bf16_parts["dtype"] == "torch.bfloat16" and bf16 != first
    other_n, _, _ = _started(_config(tiny_pair, num_draft=2))
    assert other_n not in (first, bf16)


def test_under_the_adaptive_n_the_start_up_profile_is_part_of_it(tiny_pair):
    """Seeded rows plan from the start-up profile, which a restart measures again: its digest is in
    the fingerprint, so a different profile reads as a different fingerprint (and one pinned N
    ignores it). Computed on one loaded pair with two given profiles: no timing enters the test."""
    engine = EmbeddedEngine(_config(tiny_pair))
    engine.start_sync()
    try:
        models, config = engine.scheduler.models, engine.config
        base = drafting_costs(2, config.max_num_draft)
        slower = drafting_costs(2, config.max_num_draft)
        slower.set("draft", 1, 1, 3e-3)
        a = system_fingerprint(models, config, base)
        assert a == system_fingerprint(models, config, drafting_costs(2, config.max_num_draft))
        assert a["system_fingerprint"] != system_fingerprint(models, config, slower)["system_fingerprint"]
        assert a["fingerprint_of"]["draft_length"] == "adaptive" and a["fingerprint_of"]["profile"]
        pinned = EmbeddedEngineConfig(**{**vars(config), "num_draft": 3})
        assert system_fingerprint(models, pinned, base) == system_fingerprint(models, pinned, slower)
    finally:
        asyncio.run(engine.stop())


def test_under_the_adaptive_n_a_cached_profile_keeps_it_across_restarts(tiny_pair, tmp_path):
    """With a cost cache (`make serve` keeps one), a restart loads the cached start-up shape as it
    was measured (the live factors, not the shape, follow the host): the same fingerprint and the
    same seeded tokens, under the adaptive N; without one, a restart profiles again."""
    first, parts, out = _started(_config(tiny_pair, cache_dir=tmp_path), generate=True)
    again, _, out_again = _started(_config(tiny_pair, cache_dir=tmp_path), generate=True)
    assert parts["draft_length"] == "adaptive" and parts["profile"]
    assert again == first and out_again == out


@pytest.fixture(scope="module")
def embedded_client(tiny_pair):
    engine = EmbeddedEngine(_config(tiny_pair, num_draft=3, served_name="tiny"))
    with live_server(create_app(engine, GatewaySettings())) as srv:
        yield engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_every_response_and_chunk_carries_the_engines_fingerprint(embedded_client):
    engine, client = embedded_client
    fp = engine.info.system_fingerprint
    assert fp and fp.startswith("fp_")
    chat = dict(model="tiny", messages=MSG, max_tokens=6, seed=1)
    assert client.chat.completions.create(**chat).system_fingerprint == fp
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 2 and all(c.system_fingerprint == fp for c in chunks)
    text = dict(model="tiny", prompt="Tom has", max_tokens=6, seed=1)
    assert client.completions.create(**text).system_fingerprint == fp
    assert all(c.system_fingerprint == fp for c in client.completions.create(**text, stream=True))


def test_the_sglang_backend_promises_nothing(tiny_pair):
    with sglang_gateway(tiny_pair[0]) as (engine, srv, _):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="gpu-pair", messages=MSG, max_tokens=3, seed=1)
        assert engine.info.system_fingerprint is None and r.system_fingerprint is None
        assert "system_fingerprint" in r.model_fields_set  # sent, as null
