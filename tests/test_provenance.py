"""Per-token provenance (`dialspec_trace`): which tokens the draft wrote, which the verifier
corrected, which were bonus or target tokens, and the w applied at each position.

The row-level tests drive `Row` directly with chosen rounds (exact expectations, stop rules);
the API tests run the real embedded engine (tiny pair) behind a live gateway and check the trace
against what the response itself says (text, token counts, speculative counters, static w)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from server.engine.embedded.row import Row
from server.engine.protocol import GenerationRequest, SamplingOptions
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.fake_sglang import sglang_gateway
from tests.scripted_engine import live_server
from verifier.dial import PolicyKind, Verification

NAME = "tiny-pair"
N = 4
MSG = [{"role": "user", "content": "Tom has 12 apples"}]


# ------------------------------------------------------------------------------------------ Row level
@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_pair[0]))


def _row(tokenizer, *, trace=True, n=N, max_tokens=64, stop=(), policy=PolicyKind.ENSEMBLE):
    chunks = []
    request = GenerationRequest(
        "r",
        tuple(tokenizer.encode("The")),
        SamplingOptions(max_tokens=max_tokens, stop=stop, seed=0),
        Verification(policy=policy, weight=0.5),
        trace=trace,
    )
    return Row(request, chunks.append, n, tokenizer, frozenset({tokenizer.eos_token_id})), chunks


def _round(row, tokens, k, weights, n=None, from_nu=False):
    row.record_round(k, weights, row.num_draft if n is None else n, from_nu)
    row.emit_tokens(tokens)


def test_row_labels_drafts_corrections_and_bonus(tokenizer):
    ids = tokenizer.encode(" quick brown fox jumps over the lazy dog", add_special_tokens=False)
    assert len(ids) >= 8
    row, chunks = _row(tokenizer)
    _round(row, ids[:3], 2, [0.1, 0.2, 0.3, 0.4])  # 2 drafts accepted, then the correction
    _round(row, ids[3:8], 4, [0.5, 0.6, 0.7, 0.8, 0.9], from_nu=True)  # all 4, then the bonus from ν
    first, second = (c.provenance for c in chunks)
    assert [(t.source, t.position, t.weight, t.num_draft) for t in first] == [
        ("draft", 0, 0.1, N),
        ("draft", 1, 0.2, N),
        ("corrected", 2, 0.3, N),
    ]
    assert [t.source for t in second] == ["draft"] * 4 + ["bonus"]
    assert [t.weight for t in second] == [0.5, 0.6, 0.7, 0.8, 0.9]  # the bonus step's w (round.bonus)
    # no bonus step (an adaptive row's default): the bonus was drawn from p, the law of w = 1
    _round(row, ids[8:13], 4, [0.5] * 4)
    assert row.weight == 0.5 and chunks[-1].provenance[-1].weight == 1.0
    for chunk in chunks:  # per-token text pieces add up to the chunk's text
        assert "".join(t.text for t in chunk.provenance) == chunk.text
        assert len(chunk.provenance) == len(chunk.token_ids)


def test_row_trace_follows_stop_rules(tokenizer):
    ids = tokenizer.encode(" quick brown fox jumps", add_special_tokens=False)
    # max_tokens cuts the round: only the emitted tokens are labelled
    row, chunks = _row(tokenizer, max_tokens=2)
    _round(row, ids[:4], 3, [0.5] * N)
    assert [t.source for t in chunks[0].provenance] == ["draft", "draft"]
    assert chunks[0].finish_reason == "length"
    # EOS ends the round: it is a token (counted, labelled) that releases no text
    row, chunks = _row(tokenizer)
    _round(row, [ids[0], tokenizer.eos_token_id, ids[1]], 2, [0.5] * N)
    assert [t.source for t in chunks[0].provenance] == ["draft", "draft"]
    assert chunks[0].provenance[-1].text == "" and chunks[0].finish_reason == "stop"
    assert "".join(t.text for t in chunks[0].provenance) == chunks[0].text
    # a stop string (here split over tokens and rounds): the text stops before it, and every
    # chunk's pieces still add up to its text
    ids = tokenizer.encode(" quick brown fox jumps over the lazy dog", add_special_tokens=False)
    row, chunks = _row(tokenizer, stop=("fox",))
    for start in range(0, len(ids), N + 1):
        _round(row, ids[start : start + N + 1], N, [0.5] * N)
        if row.done:
            break
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == " quick brown "
    for chunk in chunks:
        assert "".join(t.text for t in chunk.provenance) == chunk.text


def test_row_autoregressive_baselines_and_off(tokenizer):
    ids = tokenizer.encode(" quick brown", add_special_tokens=False)
    row, chunks = _row(tokenizer, n=0)
    _round(row, ids[:1], 0, [])
    assert [(t.source, t.weight, t.num_draft) for t in chunks[0].provenance] == [("target", None, 0)]
    row, chunks = _row(tokenizer)  # a round without drafts (adaptive N = 0) that drew from ν
    _round(row, ids[:1], 0, [0.5], n=0, from_nu=True)
    assert [(t.source, t.weight, t.num_draft) for t in chunks[0].provenance] == [("bonus", 0.5, 0)]
    _round(row, ids[1:2], 0, [], n=0)  # ... and one that drew from p (ν = p for it)
    assert [(t.source, t.weight) for t in chunks[1].provenance] == [("target", None)]
    row, chunks = _row(tokenizer, policy=PolicyKind.LOSSY)  # baselines have no w
    _round(row, ids[:2], 1, [0.5] * N)
    assert [(t.source, t.weight) for t in chunks[0].provenance] == [("draft", None), ("corrected", None)]
    row, chunks = _row(tokenizer, trace=False)  # off: nothing is built
    _round(row, ids[:2], 1, [0.5] * N)
    assert chunks[0].provenance is None


# ------------------------------------------------------------------------------------------ API level
def _head(h_draft, h_target, dial):  # a stand-in learned head: w_t varies with the target state
    return torch.sigmoid(h_target[..., 0] * 4.0) * dial.view(-1, 1)  # [R, N]


@pytest.fixture(scope="module")
def served(tiny_pair):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            target, draft, num_draft=N, max_batch=4, max_context=256, served_name=NAME, head=_head
        )
    )
    with live_server(create_app(engine, GatewaySettings())) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _rounds(trace: list[dict]) -> list[list[dict]]:
    rounds: list[list[dict]] = []
    for t in trace:
        if t["position"] == 0:
            rounds.append([])
        rounds[-1].append(t)
    return rounds


def _check_trace(trace, text, usage, stats):
    """What must hold for any traced choice: one entry per token, the pieces make the text, each
    round is drafts then at most one correction (k < N) or bonus (k = N), and the counters agree."""
    assert len(trace) == usage.completion_tokens
    assert "".join(t["text"] for t in trace) == text
    rounds = _rounds(trace)
    for i, rnd in enumerate(rounds):
        assert [t["position"] for t in rnd] == list(range(len(rnd)))
        *head, last = rnd
        assert all(t["source"] == "draft" for t in head)
        if last["source"] == "corrected":
            assert last["position"] < last["num_draft"]
        elif last["source"] == "bonus":
            assert last["position"] == last["num_draft"]
        elif last["source"] == "target":  # a round without drafts, drawn from p
            assert last["num_draft"] == 0 and len(rnd) == 1
        else:  # only the final round may be cut short (max_tokens, stop)
            assert last["source"] == "draft" and i == len(rounds) - 1
    accepted = sum(t["source"] == "draft" for t in trace)
    assert len(rounds) == stats["verify_steps"]
    if stats["drafts"]:
        assert sum(1 for rnd in rounds if rnd[0]["num_draft"]) == stats["drafts"]
        # emitted drafts = accepted, but for the last round's drafts cut off by max_tokens/stop
        assert 0 <= stats["accepted_tokens"] - accepted < N
    return rounds


@pytest.mark.parametrize("quality", [0, 0.25, 1])
def test_trace_agrees_with_the_response(client, quality):
    extra = {"quality": quality, "dialspec_trace": True}
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=40, seed=5, extra_body=extra)
    choice, stats = r.choices[0], r.model_extra["dialspec"]
    trace = choice.model_extra["dialspec_trace"]
    _check_trace(trace, choice.message.content, r.usage, stats)
    # The first token comes with the prefill (N = 0): from ν as a bonus at w < 1, from p at w = 1.
    first, *rest = trace
    assert first["num_draft"] == 0 and all(t["num_draft"] == N for t in rest)
    assert (first["source"], first["w"]) == (("target", None) if quality == 1 else ("bonus", quality))
    for t in rest:
        assert t["w"] == quality  # every position, the bonus included (drawn from ν)
    if quality == 0:  # w = 0 accepts every draft: nothing is ever corrected
        assert {t["source"] for t in trace} <= {"draft", "bonus"}


def test_trace_autoregressive_and_baseline(client):
    r = client.completions.create(
        model=NAME, prompt="def add", max_tokens=10, seed=1,
        extra_body={"mode": "autoregressive", "dialspec_trace": True},
    )  # fmt: skip
    trace = r.choices[0].model_extra["dialspec_trace"]
    assert len(trace) == r.usage.completion_tokens
    assert all(t["source"] == "target" and t["w"] is None and t["num_draft"] == 0 for t in trace)
    extra = {"verifier": "lossy", "dialspec_trace": True}
    r = client.completions.create(model=NAME, prompt="def add", max_tokens=10, seed=1, extra_body=extra)
    assert all(t["w"] is None for t in r.choices[0].model_extra["dialspec_trace"])


def test_trace_reports_the_learned_heads_w(client):
    extra = {"quality": "auto", "dialspec_trace": True}
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=40, seed=2, extra_body=extra)
    trace = r.choices[0].model_extra["dialspec_trace"]
    _check_trace(trace, r.choices[0].message.content, r.usage, r.model_extra["dialspec"])
    ws = [t["w"] for t in trace if t["source"] in ("draft", "corrected")]
    assert ws and all(0.0 <= w <= 1.0 for w in ws)
    assert len({round(w, 6) for w in ws}) > 1, "per-token w_t, not one static value"


def test_stream_trace_equals_non_stream_and_changes_nothing(client):
    kw = dict(model=NAME, messages=MSG, max_tokens=32, seed=9, temperature=1.0)
    plain = client.chat.completions.create(**kw, extra_body={"quality": 0.5})
    assert "dialspec_trace" not in plain.choices[0].model_extra  # off by default
    traced = client.chat.completions.create(**kw, extra_body={"quality": 0.5, "dialspec_trace": True})
    assert traced.choices[0].message.content == plain.choices[0].message.content
    assert traced.model_extra["dialspec"] == plain.model_extra["dialspec"]
    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True},
            extra_body={"quality": 0.5, "dialspec_trace": True},
        )
    )  # fmt: skip
    per_chunk = [c.choices[0].model_extra.get("dialspec_trace") for c in chunks if c.choices]
    streamed = [t for trace in per_chunk for t in trace or []]
    assert streamed == traced.choices[0].model_extra["dialspec_trace"]
    for c in chunks:  # each chunk's entries carry exactly its own text
        if c.choices and c.choices[0].model_extra.get("dialspec_trace") is not None:
            pieces = "".join(t["text"] for t in c.choices[0].model_extra["dialspec_trace"])
            assert pieces == (c.choices[0].delta.content or "")
    untraced = client.chat.completions.create(
        **kw, stream=True, extra_body={"quality": 0.5}
    )  # off: no chunk carries a trace
    assert all("dialspec_trace" not in (c.choices[0].model_extra if c.choices else {}) for c in untraced)


def test_trace_field_is_strict_and_documented(served):
    body = {"model": NAME, "messages": MSG, "max_tokens": 2, "dialspec_trace": 1}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dialspec_trace"
    schema = httpx.get(served.url + "/openapi.json").json()
    comps = schema["components"]["schemas"]
    assert "dialspec_trace" in comps["ChatCompletionRequest"]["properties"]
    assert "dialspec_trace" in comps["CompletionRequest"]["properties"]
    sources = set(comps["TraceToken"]["properties"]["source"]["enum"])
    assert sources == {"draft", "corrected", "bonus", "target"}
    assert "/v1/dial" in schema["paths"]


def test_dial_endpoint(served):
    d = httpx.get(served.url + "/v1/dial").json()
    assert d["model"] == NAME and d["backend"] == "embedded" and d["num_draft"] == N
    assert [t["name"] for t in d["tiers"]] == ["lite", "standard", "pro", "exact"]
    assert d["has_head"] is True and d["token_provenance"] is True


def test_sglang_backend_refuses_trace(tiny_pair):
    """SGLang reports aggregate counters only: the gateway says so instead of inventing a trace."""
    with sglang_gateway(tiny_pair[0]) as (engine, srv, runtime):
        assert engine.info.token_provenance is False
        body = {"model": "gpu-pair", "messages": MSG, "max_tokens": 4, "dialspec_trace": True}
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "dialspec_trace", r.text
            assert err["code"] == "trace_unsupported" and "sglang" in err["message"]
        sent = len(runtime.requests)
        off = {**body, "dialspec_trace": False}
        r = httpx.post(srv.url + "/v1/chat/completions", json=off, timeout=30)
        assert r.status_code == 200 and len(runtime.requests) == sent + 1
        assert json.loads(r.text)["choices"][0].get("dialspec_trace") is None
