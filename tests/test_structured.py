"""Structured outputs (`response_format`, issue 31 part 1) on the embedded engine (tiny pair).

Every output of a bounded schema parses and validates (jsonschema) at quality 0, 0.25, 0.5 and 1,
with a fixed and the adaptive N, greedy and sampled; the law of the first free token equals the
masked reference ν̃ = w·p̃ + (1−w)·q̃ built outside the engine from HF forwards and xgrammar's
mask, and not the law with only p masked (what a grammar applied to the target alone would give);
the openai SDK's `parse` round-trips a pydantic model; bad schemas and slow compiles get clear
errors; fault retries keep constrained rows exact; the SGLang backend refuses it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Annotated

import httpx
import openai
import pytest
import torch
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from server.engine.protocol import EngineError, GenerationRequest, ResponseFormat, SamplingOptions
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.fake_sglang import sglang_gateway
from tests.scripted_engine import live_server
from tests.stats import ALPHA, chi_square_pvalue
from tests.tiny_pair import fixed_and_adaptive
from verifier.dial import Verification

pytest.importorskip("xgrammar")

NAME = "tiny-pair"
MSG = [{"role": "user", "content": "Tom has 12 apples"}]
# Bounded (a random pair would otherwise write strings until max_tokens), with each kind of node.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


def _engine(tiny_pair, num_draft, **kw):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    config = EmbeddedEngineConfig(
        *tiny_pair, num_draft=num_draft, max_batch=8, max_context=200, served_name=NAME, **kw
    )
    return EmbeddedEngine(config)


@pytest.fixture(scope="module")
def engines(tiny_pair):
    with fixed_and_adaptive(tiny_pair, max_batch=8, max_context=200, served_name=NAME) as engines:
        yield engines


def _request(engine, seed, fmt, max_tokens=80, **spec) -> GenerationRequest:
    verify = Verification(**{k: spec.pop(k) for k in list(spec) if k in Verification.__dataclass_fields__})
    sampling = SamplingOptions(max_tokens=max_tokens, seed=seed, **spec)
    return GenerationRequest(
        f"s{seed}", tuple(engine.encode_chat(MSG)), sampling, verify, response_format=fmt
    )


def _run(engine, requests) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) per request, all submitted at once."""

    async def one(req):
        chunks = [c async for c in engine.generate(req)]
        return (
            [t for c in chunks for t in c.token_ids],
            "".join(c.text for c in chunks),
            chunks[-1].finish_reason,
        )

    async def main():
        return await asyncio.gather(*[one(r) for r in requests])

    return asyncio.run(main())


@pytest.mark.parametrize("which", ["fixed", "adaptive"])
@pytest.mark.parametrize("spec", [dict(weight=0.0), dict(weight=0.25), dict(weight=0.5), dict(weight=1.0),
                                  dict(weight=0.5, temperature=0.0), dict(weight=0.5, top_k=5)])  # fmt: skip
def test_every_output_validates_at_every_quality(engines, which, spec):
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    out = _run(engines[which], [_request(engines[which], seed, fmt, **dict(spec)) for seed in range(24)])
    validator = Draft202012Validator(SCHEMA)
    for _, text, finish in out:
        assert finish == "stop", text  # the grammar ended, then EOS
        validator.validate(json.loads(text))  # strict JSON: no raw control characters either


def test_json_object_outputs_are_objects(engines):
    """Any JSON object: unbounded, so a random pair may run out of tokens inside a string; every
    output that ended is an object, and some do."""
    engine = engines["fixed"]
    out = _run(
        engine, [_request(engine, seed, ResponseFormat("json_object"), weight=0.5) for seed in range(16)]
    )
    ended = [json.loads(text) for _, text, finish in out if finish == "stop"]
    assert ended and all(isinstance(obj, dict) for obj in ended)


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_the_first_free_token_follows_the_masked_ensemble(engines, tiny_pair, weight):
    """An enum of strings: the first token is the forced quote, the second is one of a few letters.
    With N = 3 and strict ν (a fixed N) it is a drafted position, so its law is ν̃ = w·p̃ + (1−w)·q̃,
    p̃ and q̃ each masked and renormalised. The reference comes from HF forwards and xgrammar's
    mask after the quote, outside the engine. Power: the law with only p masked (q left whole,
    renormalised over the allowed tokens afterwards) is rejected at w = 0.5; the few letters hold
    little of q's mass, which is where the two differ."""
    from transformers import LlamaForCausalLM

    engine = engines["fixed"]
    schema = {"enum": ["ab", "ba", "ca", "cb", "da"]}
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    samples = 3000
    requests = [_request(engine, seed, fmt, max_tokens=2, weight=weight) for seed in range(samples)]
    out = [o for at in range(0, samples, 200) for o in _run(engine, requests[at : at + 200])]  # queue bound
    firsts = {tokens[0] for tokens, _, _ in out}
    assert len(firsts) == 1  # the quote, forced
    second = torch.tensor([tokens[1] for tokens, _, _ in out])

    grammar = engine.grammars().row(fmt)
    grammar.accept(firsts.pop())
    allowed = grammar.allowed()  # [V]
    ids = torch.tensor([list(_request(engine, 0, fmt).prompt_token_ids) + [out[0][0][0]]])
    with torch.no_grad():
        p_logits, q_logits = (LlamaForCausalLM.from_pretrained(str(m))(ids).logits[0, -1] for m in tiny_pair)
    masked = [logits.masked_fill(~allowed, float("-inf")).softmax(-1) for logits in (p_logits, q_logits)]
    nu = weight * masked[0] + (1 - weight) * masked[1]
    assert chi_square_pvalue(second, nu) > ALPHA
    if weight < 1:
        p_only = (weight * masked[0] + (1 - weight) * q_logits.softmax(-1)) * allowed  # q unmasked
        assert chi_square_pvalue(second, p_only / p_only.sum()) < ALPHA


def test_fault_retries_keep_constrained_rows_exact(engines):
    """A batched round that raises is re-run row by row; the constrained rows' matchers give back
    the drafts the failed round fed them, so each gets exactly its output alone."""
    from tests.test_engine_faults import Collector

    engine = engines["fixed"]
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    innocent = [_request(engine, seed, fmt, weight=w) for seed, w in ((1, 0.5), (2, 1.0), (3, 0.25))]
    alone = [tokens for tokens, _, _ in _run(engine, innocent)]
    sinks = [Collector() for _ in range(4)]
    rows = [engine.make_row(r, s) for r, s in zip([*innocent, _request(engine, 9, fmt)], sinks, strict=True)]
    rows[-1].temperature = float("nan")  # reaches the sampling transform in the batched round
    with engine.scheduler._cv:
        for row in rows:
            engine.scheduler.submit(row)
    done = [s.wait() for s in sinks]
    assert isinstance(done[-1].error, EngineError)
    assert [d.tokens for d in done[:3]] == alone


def test_a_failed_batch_gives_back_the_drafts_its_matchers_took(engines):
    """Fault isolation re-runs a failed batch's rows alone: the drafts the failed run fed each
    row's matcher are rolled back first (`Scheduler._isolating`), so the re-run starts from the
    accepted prefix. Here a run takes one draft per row and raises only when batched."""
    engine = engines["fixed"]
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    rows = [engine.make_row(_request(engine, seed, fmt), lambda _item: None) for seed in (1, 2)]
    opening = int(rows[0].grammar.allowed().nonzero()[0])  # "{", the only token allowed first

    def run(group):
        for row in group:
            row.grammar.accept(opening)
            row.rounds += 1 if len(group) == 1 else 0  # advanced only when alone
        if len(group) > 1:
            raise RuntimeError("batched round failed")

    engine.scheduler._isolating(rows, run)
    for row in rows:  # one "{" each: the batched run's was given back
        assert row.rounds == 1 and len(row.grammar.window) == 1
        assert not bool(row.grammar.allowed()[opening])


def test_schemas_that_do_not_compile_and_slow_compiles_are_refused(tiny_pair, monkeypatch):
    from server.engine.embedded.grammar import GrammarCache

    engine = _engine(tiny_pair, 3, grammar_timeout_s=0.2)
    engine.start_sync()
    try:
        bad = ResponseFormat("json_schema", json.dumps({"type": "string", "pattern": "(?<=a)b"}))
        with pytest.raises(EngineError) as err:
            _run(engine, [_request(engine, 0, bad)])
        assert err.value.kind == "invalid_request" and "response_format" in str(err.value)
        compile_ = GrammarCache.compile
        monkeypatch.setattr(GrammarCache, "compile", lambda self, fmt: time.sleep(1.0) or compile_(self, fmt))
        ticks = []

        async def ticker():
            for _ in range(10):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        async def consume():
            slow = _request(engine, 0, ResponseFormat("json_schema", json.dumps({"type": "integer"})))
            return [c async for c in engine.generate(slow)]

        async def main():
            started = time.monotonic()
            results = await asyncio.gather(consume(), ticker(), return_exceptions=True)
            return results[0], time.monotonic() - started

        error, seconds = asyncio.run(main())
        assert isinstance(error, EngineError) and "did not compile within 0.2 s" in str(error)
        assert seconds < 0.9  # bounded by the limit, not by the compile (1 s)
        assert ticks[-1] - ticks[0] < 0.5  # the loop kept running while the schema compiled
    finally:
        asyncio.run(engine.stop())
        threading.Event().wait(1.0)  # let the abandoned compile finish before the engine is gone


# ------------------------------------------------------------------------------------------ API level
@pytest.fixture(scope="module")
def client(tiny_pair):
    with live_server(create_app(_engine(tiny_pair, 3), GatewaySettings())) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60), srv.url


class Person(BaseModel):
    name: Annotated[str, Field(max_length=4)]
    age: Annotated[int, Field(ge=0, le=99)]
    ok: bool


@pytest.mark.parametrize("quality", [0, 0.5, 1])
def test_sdk_parse_round_trips_a_pydantic_model(client, quality):
    c, _ = client
    r = c.chat.completions.parse(
        model=NAME,
        messages=MSG,
        max_tokens=60,
        seed=3,
        response_format=Person,
        extra_body={"quality": quality},
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_streamed_and_completions_outputs_validate(client):
    c, _ = client
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    stream = c.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=80, seed=4, response_format=fmt, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    Draft202012Validator(SCHEMA).validate(json.loads(text))
    r = c.completions.create(
        model=NAME, prompt="Tom", max_tokens=80, seed=4, extra_body={"response_format": fmt}
    )
    Draft202012Validator(SCHEMA).validate(json.loads(r.choices[0].text))


def test_bad_formats_are_a_400_naming_the_field(client):
    _, url = client
    base = {"model": NAME, "messages": MSG, "max_tokens": 4}

    def schema(s):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}

    cases = [
        (schema({"type": 5}), "response_format.json_schema.schema"),  # not a JSON Schema
        ({"type": "json_schema"}, "response_format"),
        ({"type": "xml"}, "response_format.type"),
        (schema({"type": "string", "pattern": "(?<=a)b"}), None),  # valid, but xgrammar cannot compile it
    ]
    for fmt, param in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, "response_format": fmt}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param or (param is None and "response_format" in err["message"]), r.text
    r = httpx.post(
        f"{url}/v1/chat/completions", json={**base, "response_format": {"type": "text"}}, timeout=30
    )
    assert r.status_code == 200


def test_sglang_backend_passes_response_format_as_its_json_schema(tiny_pair):
    """SGLang masks p with its grammar and the plugin masks q the same way (issue 30), so the
    gateway sends the schema on at every quality, in SGLang's own `json_schema` parameter."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    with sglang_gateway(tiny_pair[0]) as (engine, srv, runtime):
        assert engine.info.structured_output is True
        for quality, rf in ((0.25, fmt), (1.0, {"type": "json_object"})):
            body = {"model": "gpu-pair", "messages": MSG, "max_tokens": 4, "quality": quality,
                    "response_format": rf}  # fmt: skip
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            sent = runtime.requests[-1]["sampling_params"]
            assert json.loads(sent["json_schema"]) == {"type": "object"}
            assert sent["custom_params"]["dialspec_w"] == quality
        plain = {"model": "gpu-pair", "messages": MSG, "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/chat/completions", json=plain, timeout=30).status_code == 200
        assert "json_schema" not in runtime.requests[-1]["sampling_params"]
