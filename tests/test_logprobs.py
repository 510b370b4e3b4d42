"""Log-probs (`logprobs` / `top_logprobs`, issue 31 part 2): the log-probabilities of the law each
token was drawn from, checked against an independent reference.

Engine level: every reported value is compared with the law rebuilt from plain HF forwards of the
target and the draft over prompt + output (`transformers`' own Llama, not the engine's decoder),
through the row's sampling transform, mixed with the w the token's provenance reports (None: drawn
from p; 0 in draft-only rounds: q). So at quality 1 the values are the target's log-probs, at
quality 0 the draft's, in between ν's. API level: the OpenAI SDK parses both shapes, streamed and
not; misuse gets a 400 naming the field (the SGLang backend: tests/test_sglang_client_logprobs.py).

Tolerance: the engine and HF run the same float32 math in different kernels (fused q/k/v,
interleaved RoPE); their logits agree to ~1e-5 here, so log-probs (a log-softmax, error at most
twice the logit error) agree far inside the 1e-3 used. Values the law gives no mass are -9999.0 on
both sides.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from server.engine.protocol import LOGPROB_FLOOR, EngineError, GenerationRequest, SamplingOptions
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.scripted_engine import live_server
from tests.tiny_pair import fixed_and_adaptive
from verifier import logits_to_probs
from verifier.dial import PolicyKind, Verification

NAME = "tiny-pair"
MSG = [{"role": "user", "content": "Tom has 12 apples"}]
ATOL = 1e-3  # see the module doc


def _head(h_draft, h_target, dial):  # a stand-in learned head: w_t varies with the target state
    return torch.sigmoid(h_target[..., 0] * 4.0) * dial.view(-1, 1)  # [R, N]


def _engine(tiny_pair, num_draft):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    config = EmbeddedEngineConfig(
        *tiny_pair, num_draft=num_draft, max_batch=4, max_context=160, served_name=NAME, head=_head
    )
    return EmbeddedEngine(config)


@pytest.fixture(scope="module")
def engines(tiny_pair):
    """A fixed N = 3 (strict ν: every position drafted or drawn from ν) and the default adaptive N
    (with costs under which it drafts: bonuses and N = 0 rounds from p, quality 0 draft-only)."""
    with fixed_and_adaptive(tiny_pair, max_batch=4, max_context=160, served_name=NAME, head=_head) as engines:
        yield engines


@pytest.fixture(scope="module")
def reference(tiny_pair):
    from transformers import LlamaForCausalLM

    return [LlamaForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval() for p in tiny_pair]


def _generate(engine, top: int, seed=3, max_tokens=24, stop=(), **spec):
    verify = Verification(**{k: spec.pop(k) for k in list(spec) if k in Verification.__dataclass_fields__})
    ids = tuple(engine.encode_chat(MSG))
    sampling = SamplingOptions(max_tokens=max_tokens, seed=seed, stop=stop, ignore_eos=True, **spec)
    request = GenerationRequest("lp", ids, sampling, verify, trace=True, logprobs=top)

    async def run():
        return [c async for c in engine.generate(request)]

    return request, asyncio.run(run())


@torch.no_grad()
def _reference_laws(reference, request, tokens, weights) -> torch.Tensor:
    """log ν `[T, V]` at each output position from HF forwards: ν = w·p + (1−w)·q under the row's
    sampling transform (temperature 1 for greedy rows, as the engine verifies them)."""
    s = request.sampling
    greedy = s.temperature <= 0
    transform = dict(temperature=1.0 if greedy else s.temperature, top_k=0 if greedy else s.top_k)
    transform["top_p"] = 1.0 if greedy else s.top_p
    ids = torch.tensor([list(request.prompt_token_ids) + tokens])
    start = len(request.prompt_token_ids) - 1
    p, q = (logits_to_probs(m(ids).logits[0, start : start + len(tokens)], **transform) for m in reference)
    w = torch.tensor(weights).unsqueeze(-1)  # [T, 1]
    return (w * p + (1 - w) * q).log().clamp_min(LOGPROB_FLOOR)  # [T, V]


def _check(reference, request, chunks, top: int) -> list[str]:
    """Every token's reported log-prob and top list against the reference; returns the sources."""
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    trace = [t for c in chunks for t in c.provenance]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    weights = [1.0 if t.weight is None else t.weight for t in trace]  # None: drawn from p
    law = _reference_laws(reference, request, tokens, weights)  # [T, V]
    for i, (tok, e) in enumerate(zip(tokens, entries, strict=True)):
        assert e.logprob == pytest.approx(law[i, tok].item(), abs=ATOL), (i, trace[i])
        assert len(e.top) == top
        best = law[i].topk(top).values.tolist() if top else []
        assert [t.logprob for t in e.top] == pytest.approx(best, abs=ATOL)
        assert all(a.logprob >= b.logprob for a, b in zip(e.top, e.top[1:], strict=False))
    return [t.source for t in trace]


CASES = [  # (engine, spec, what the sources must include)
    ("fixed", dict(weight=1.0), {"draft", "corrected"}),  # ν = p: the target's log-probs
    ("fixed", dict(weight=0.0), {"draft", "bonus"}),  # a pinned N at quality 0: q, the draft's
    ("fixed", dict(weight=0.5), {"draft", "corrected"}),  # ν, the bonus from ν too
    ("fixed", dict(weight=0.6, dial=0.6), {"draft"}),  # the learned head's w_t per position
    ("fixed", dict(weight=0.5, temperature=0.8, top_k=20, top_p=0.9), {"draft"}),
    ("fixed", dict(weight=0.5, temperature=0.0), {"corrected"}),  # the temperature-1 ν whose argmax it took
    ("adaptive", dict(weight=0.0), {"draft"}),  # draft-only rounds: q
    ("adaptive", dict(weight=0.5), {"target", "draft"}),  # the prefill's token and bonuses from p
    ("adaptive", dict(mode="autoregressive"), {"target"}),  # p only
]


@pytest.mark.parametrize("top", [0, 5])
@pytest.mark.parametrize(("which", "spec", "sources"), CASES)
def test_logprobs_are_those_of_the_law_drawn_from(engines, reference, which, spec, sources, top):
    request, chunks = _generate(engines[which], top, **dict(spec))
    assert sources <= set(_check(reference, request, chunks, top))


def test_quality_one_and_zero_are_the_target_and_the_draft(engines, reference):
    """The issue's statement in so many words: at w = 1 the target's log-probs, at w = 0 (quality
    0, the draft alone) the draft's, with no mixing at all."""
    for weight, model in ((1.0, reference[0]), (0.0, reference[1])):
        request, chunks = _generate(engines["adaptive"], 3, weight=weight)
        tokens = [t for c in chunks for t in c.token_ids]
        ids = torch.tensor([list(request.prompt_token_ids) + tokens])
        start = len(request.prompt_token_ids) - 1
        with torch.no_grad():
            logp = model(ids).logits[0, start : start + len(tokens)].log_softmax(-1)  # [T, V]
        got = [e.logprob for c in chunks for e in c.logprobs]
        assert got == pytest.approx(
            logp.gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0].tolist(), abs=ATOL
        )


def test_tokens_carry_their_own_bytes_and_stop_rules_hold(engines):
    engine = engines["fixed"]
    _, chunks = _generate(engine, 2, weight=0.5, max_tokens=40)
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    specials = set(engine.tokenizer.added_tokens_decoder)
    joined = b"".join(bytes(e.token_bytes) for t, e in zip(tokens, entries, strict=True) if t not in specials)
    assert joined.decode("utf-8", errors="replace") == engine.decode(tokens)  # a random pair: bytes too
    text = "".join(c.text for c in chunks)
    # a stop string cuts the round: one entry per emitted token still
    _, cut = _generate(engine, 1, weight=0.5, max_tokens=40, stop=(text[5:8],))
    assert all(len(c.logprobs) == len(c.token_ids) for c in cut)
    assert sum(len(c.token_ids) for c in cut) < len(tokens)


def test_the_engine_refuses_what_it_cannot_report(engines):
    engine = engines["fixed"]
    ids = tuple(engine.encode_chat(MSG))
    bad = [
        (21, Verification()),
        (True, Verification()),
        (2, Verification(policy=PolicyKind.LOSSY, lenience=0.5)),
    ]
    for top, verify in bad:
        with pytest.raises(EngineError) as err:
            engine.make_row(
                GenerationRequest("x", ids, SamplingOptions(), verify, logprobs=top), lambda _c: None
            )
        assert err.value.kind == "invalid_request" and "logprobs" in str(err.value)
    # the target alone has a law whatever the verifier named
    auto = Verification(policy=PolicyKind.LOSSY, mode="autoregressive")
    engine.make_row(GenerationRequest("x", ids, SamplingOptions(), auto, logprobs=2), lambda _c: None)


# ------------------------------------------------------------------------------------------ API level
@pytest.fixture(scope="module")
def client(tiny_pair):
    with live_server(create_app(_engine(tiny_pair, 3), GatewaySettings())) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60), srv.url


def test_chat_logprobs_parse_in_the_sdk_streamed_and_not(client):
    c, _ = client
    kw = dict(model=NAME, messages=MSG, max_tokens=20, seed=7, logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**kw, extra_body={"quality": 0.5})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 and e.bytes for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - ATOL for e in content)
    stream = c.chat.completions.create(**kw, stream=True, extra_body={"quality": 0.5})
    streamed = [
        e for ch in stream for choice in ch.choices if choice.logprobs for e in choice.logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=4)
    assert plain.choices[0].logprobs is None  # not asked: nothing computed, nothing sent


def test_completion_logprobs_parse_in_the_sdk_streamed_and_not(client):
    c, _ = client
    kw = dict(model=NAME, prompt="Tom has", max_tokens=16, seed=7, logprobs=2)
    r = c.completions.create(**kw, extra_body={"quality": 1})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs)  # tokens sharing a text share a key
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    parts = [
        ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True, extra_body={"quality": 1})
    ]
    parts = [p for p in parts if p is not None]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
    assert [x for p in parts for x in p.text_offset] == lp.text_offset  # offsets continue across chunks


def test_misuse_is_a_400_naming_the_field(client):
    _, url = client
    chat = {"model": NAME, "messages": MSG, "max_tokens": 4}
    cases = [
        ("chat", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("chat", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {**chat, "logprobs": 1}, "logprobs"),
        ("chat", {**chat, "logprobs": True, "verifier": "lossy"}, "logprobs"),
        ("completions", {"model": NAME, "prompt": "a", "logprobs": 21}, "logprobs"),
    ]
    for path, body, param in cases:
        r = httpx.post(f"{url}/v1/{path.replace('chat', 'chat/completions')}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
