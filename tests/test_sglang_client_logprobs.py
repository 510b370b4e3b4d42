"""Log-probs on the SGLang backend (issue 31, part 2): the client asks SGLang for them with its native
`return_logprob` / `top_logprobs_num` / `logprob_start_len` fields and turns `meta_info`'s
`output_token_logprobs` / `output_top_logprobs` into the OpenAI shapes the embedded engine's
log-probs take (`protocol.TokenLogprob`, one per token, streamed and not).

Against the loopback fake runtime (tests/fake_sglang.py, SGLang 0.5.23's shapes, values from
`fake_logprob`): what these tests prove is the wire mapping, not what the values mean. That SGLang's
values are log ν under the plugin is the plugin's own test (tests/test_sglang_logprobs.py, through
SGLang's real `compute_spec_logprobs`); none of it has run against a real runtime on a GPU.
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import openai
import pytest

from server.engine.protocol import LOGPROB_FLOOR, EngineError, GenerationRequest, SamplingOptions
from server.engine.sglang.client import SGLangEngine
from server.engine.sglang.stream import logprobs_from_meta
from server.engine.token_bytes import TokenBytes
from tests.fake_sglang import N_DRAFT, FakeRuntime, fake_logprob, fake_logprob_meta, sglang_gateway
from verifier.dial import Verification

MSG = [{"role": "user", "content": "Tom has 12 apples"}]


@pytest.fixture(scope="module")
def gateway(tiny_pair):
    with sglang_gateway(tiny_pair[0]) as (engine, srv, runtime):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        yield engine, srv.url, runtime, client


@pytest.fixture(scope="module")
def render(tiny_pair):
    from transformers import AutoTokenizer

    return TokenBytes(AutoTokenizer.from_pretrained(str(tiny_pair[0])))


def _generate(url, tiny_pair, logprobs):
    async def go():
        engine = SGLangEngine(url, str(tiny_pair[0]), num_draft=N_DRAFT)
        await engine.start()
        try:
            request = GenerationRequest(
                "lp", (1, 2, 3), SamplingOptions(max_tokens=8), Verification(weight=0.5), logprobs=logprobs
            )
            return [c async for c in engine.generate(request)]
        finally:
            await engine.stop()

    return asyncio.run(go())


def test_the_client_sends_sglangs_fields_and_reads_its_meta_info(tiny_pair, render):
    runtime = FakeRuntime().start()
    try:
        chunks = _generate(runtime.url, tiny_pair, 3)
        body = runtime.requests[-1]
        plain = _generate(runtime.url, tiny_pair, None)
        plain_body = runtime.requests[-1]
    finally:
        runtime.stop()
    assert (body["return_logprob"], body["top_logprobs_num"], body["logprob_start_len"]) == (True, 3, -1)
    assert not {"return_logprob", "top_logprobs_num", "logprob_start_len"} & set(plain_body)
    assert all(c.logprobs is None for c in plain)  # not asked: none read, none sent

    ids = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs or []]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)  # one per token, in its chunk
    assert len(entries) == len(ids) == 8
    for i, (token_id, e) in enumerate(zip(ids, entries, strict=True)):
        assert (e.token, e.token_bytes) == render(token_id) and e.logprob == fake_logprob(i)
        assert [(t.token, t.token_bytes) for t in e.top] == [render(token_id), render(4), render(5)]
        # the masked alternative: null on the wire (orjson's −inf), the floor here as on the embedded engine
        assert [t.logprob for t in e.top] == [fake_logprob(i), fake_logprob(i, 1), LOGPROB_FLOOR]


def test_a_runtime_that_reports_too_few_or_other_tokens_is_an_error(render):
    body = {"return_logprob": True, "top_logprobs_num": 1}
    meta = fake_logprob_meta(body, [100, 101, 102])
    got = logprobs_from_meta(meta, [100, 101, 102], 1, 1, render)
    assert [e.logprob for e in got] == [fake_logprob(1), fake_logprob(2)]  # ids[start:] only
    with pytest.raises(EngineError, match="log-probs for 3 of 4 output tokens") as short:
        logprobs_from_meta(meta, [100, 101, 102, 103], 0, 1, render)
    with pytest.raises(EngineError, match="is for token 101, not 7") as other:
        logprobs_from_meta(meta, [100, 7, 102], 0, 1, render)
    assert short.value.kind == other.value.kind == "internal"
    for bad in (float("nan"), float("inf"), "x"):
        meta["output_token_logprobs"][0][0] = bad
        with pytest.raises(EngineError, match="log-probability of"):
            logprobs_from_meta(meta, [100, 101, 102], 0, 1, render)
    meta["output_token_logprobs"][0][0] = float("-inf")  # Python's json writes -Infinity; read as null
    assert logprobs_from_meta(meta, [100, 101, 102], 0, 1, render)[0].logprob == LOGPROB_FLOOR


def test_chat_logprobs_parse_in_the_sdk_streamed_and_not(gateway):
    _, _, runtime, client = gateway
    kw = dict(model="gpu-pair", messages=MSG, max_tokens=7, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw, extra_body={"quality": 0.5})
    sent = runtime.requests[-1]
    assert (sent["return_logprob"], sent["top_logprobs_num"], sent["logprob_start_len"]) == (True, 2, -1)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 7
    assert [e.logprob for e in content] == [fake_logprob(i) for i in range(7)]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token and e.bytes for e in content)
    stream = client.chat.completions.create(**kw, stream=True, extra_body={"quality": 0.5})
    streamed = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

    no_top = client.chat.completions.create(model="gpu-pair", messages=MSG, max_tokens=3, logprobs=True)
    assert runtime.requests[-1]["top_logprobs_num"] == 0
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)


def test_completion_logprobs_parse_in_the_sdk_streamed_and_not(gateway):
    _, _, runtime, client = gateway
    kw = dict(model="gpu-pair", prompt="Tom has", max_tokens=6, logprobs=3)
    r = client.completions.create(**kw, extra_body={"quality": 1})
    assert runtime.requests[-1]["top_logprobs_num"] == 3
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [fake_logprob(i) for i in range(6)]
    assert all(LOGPROB_FLOOR in top.values() for top in lp.top_logprobs)  # the masked alternative
    parts = [
        ch.choices[0].logprobs
        for ch in client.completions.create(**kw, stream=True, extra_body={"quality": 1})
    ]
    parts = [p for p in parts if p is not None]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.text_offset] == lp.text_offset


def test_misuse_is_a_400_before_the_runtime_sees_it(gateway):
    engine, url, runtime, _ = gateway
    assert engine.info.token_logprobs is True
    chat = {"model": "gpu-pair", "messages": MSG, "max_tokens": 4}
    cases = [
        ("chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("completions", {"model": "gpu-pair", "prompt": "a", "max_tokens": 4, "logprobs": 21}, "logprobs"),
    ]
    sent = len(runtime.requests)
    for (path, body, param), stream in itertools.product(cases, (False, True)):
        r = httpx.post(f"{url}/v1/{path}", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert len(runtime.requests) == sent
