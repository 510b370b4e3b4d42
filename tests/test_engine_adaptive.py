"""The engine's adaptive draft length, its runtime info, and `dtype="auto"` (tiny pair).

The law of the output under adaptive N is tested in test_engine_distribution.py; here: what the
planner decides with a cost model where drafting cannot pay and one where it pays well, that a
per-request num_draft overrides it, and what the engine reports about itself.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.embedded.planner.cost_model import CostModel
from server.engine.embedded.row import RowMode
from server.engine.protocol import GenerationRequest, SamplingOptions
from verifier.dial import Verification


@pytest.fixture(scope="module")
def engine(tiny_pair):
    eng = EmbeddedEngine(
        EmbeddedEngineConfig(*tiny_pair, max_batch=4, max_context=96, profile_budget_s=0.5, dtype="auto")
    )
    eng.start_sync()
    yield eng
    asyncio.run(eng.stop())


def _run(engine, weight=1.0, num_draft=None, seed=0, n=4, max_tokens=24):
    ids = tuple(engine.encode_chat([{"role": "user", "content": "Tom has 12 apples"}]))

    async def one(i):
        req = GenerationRequest(
            f"r{i}", ids, SamplingOptions(max_tokens=max_tokens, seed=seed + i, ignore_eos=True),
            Verification(weight=weight, num_draft=num_draft),
        )  # fmt: skip
        return [c async for c in engine.generate(req)][-1].stats

    async def main():
        return await asyncio.gather(*[one(i) for i in range(n)])

    return asyncio.run(main())


def _costs(engine, score, draft):
    """Pin the engine's cost model (and stop it learning) to a synthetic cost structure."""
    planner = engine.scheduler.models.planner
    model = CostModel()
    for r in range(1, engine.config.max_batch + 1):
        model.set("draft", r, 1, draft)
        for t in range(1, engine.config.max_num_draft + 2):
            model.set("score", r, t, score(t))
    planner.set_cost(model)
    planner.learn = lambda batch, out, seconds: None
    return planner


def test_runtime_info_reports_dtype_and_cost_model(engine):
    info = engine.info
    assert info.adaptive_draft and info.runtime["draft_length"] == "adaptive"
    assert info.runtime["quality_zero"] == "draft only"
    assert info.runtime["dtype"] in ("float32", "bfloat16")
    assert info.runtime["dtype_choice"]["dtype"] == info.runtime["dtype"]
    cost = info.runtime["cost_model"]
    assert len(cost["target_ms"][1]) == engine.config.max_num_draft + 1 and cost["draft_step_ms"][1] > 0


def test_no_drafts_where_verification_cost_grows_with_tokens(engine):
    _costs(engine, score=lambda t: 0.010 * t, draft=0.004)
    stats = _run(engine, weight=1.0)
    assert all(s.drafts == 0 and s.verify_steps == 24 for s in stats)


def test_long_drafts_where_verification_is_flat_and_the_dial_is_low(engine):
    _costs(engine, score=lambda t: 0.010, draft=0.0005)
    max_n = engine.config.max_num_draft
    # A low w (not 0, which skips the target): every round after the first token (drawn with the
    # prefill) drafts, N_max per round but the last two, capped by the tokens left.
    stats = _run(engine, weight=0.05)
    assert all(s.drafts == s.verify_steps - 1 and s.draft_tokens >= max_n * (s.drafts - 2) for s in stats)
    assert all(s.draft_only_tokens == 0 for s in stats)


def test_quality_zero_decodes_from_the_draft_alone(engine):
    """w = 0: ν = q, so the target never runs, not even for the prompt: max_n tokens per draft-only
    round, no proposals, no verification; the draft's rounds are priced by the planner."""
    models = engine.scheduler.models
    calls = []
    target_forward = type(models.target).forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return target_forward(self, *args, **kwargs)

    models.target.forward = counting.__get__(models.target)
    try:
        stats = _run(engine, weight=0.0, max_tokens=20)
    finally:
        del models.target.forward
    max_n = engine.config.max_num_draft
    assert calls == []
    assert all(s.draft_only_tokens == 20 and s.verify_steps == s.draft_tokens == 0 for s in stats)
    assert all(s.mean_weight == 0.0 for s in stats)
    cost = models.planner.cost
    assert cost.seen["draft_only"] > 0  # learned from these rounds
    predicted = models.planner.predict([_Row()], max_n)
    assert predicted[0] == pytest.approx(max_n * cost.time("draft_only", 1, 1) + cost.time("other", 1, 0))


class _Row:
    mode = RowMode(adaptive=True, draft_only=True)


def test_quality_zero_rows_of_different_lengths_share_one_round_a_step(engine):
    """Draft-only rows run one round a step, as long as the most any of them has left; the rows
    with fewer left stop where they should, with the tokens they get alone (the round's draws are
    the first of each row's stream). One round a length instead was 0.78x plain decoding at batch
    32 on CUDA."""
    import threading

    max_n = engine.config.max_num_draft
    lengths = [max_n // 2, max_n, max_n + max_n // 2, 2 * max_n]  # draft-only rows draw all in rounds
    ids = tuple(engine.encode_chat([{"role": "user", "content": "Tom has 12 apples"}]))

    def req(i):
        sampling = SamplingOptions(max_tokens=lengths[i], seed=50 + i, ignore_eos=True)
        return GenerationRequest(f"q{i}", ids, sampling, Verification(weight=0.0))

    def collect(requests, together):
        out, done = {r.request_id: [] for r in requests}, threading.Semaphore(0)

        def sink_for(rid):
            def sink(item):
                out[rid].append(item)
                if isinstance(item, BaseException) or item.finish_reason is not None:
                    done.release()

            return sink

        sched = engine.scheduler
        if together:  # queued while stopped, so the first step admits them all
            sched.stop()
        for r in requests:
            engine.submit(r, sink_for(r.request_id))
        if together:
            sched.timers.reset()
            sched.start()
        for _ in requests:
            assert done.acquire(timeout=60)
        return {rid: [t for c in chunks for t in c.token_ids] for rid, chunks in out.items()}

    alone = {}
    for i in range(len(lengths)):
        alone.update(collect([req(i)], together=False))
    together = collect([req(i) for i in range(len(lengths))], together=True)
    assert together == alone and [len(alone[f"q{i}"]) for i in range(len(lengths))] == lengths
    assert engine.scheduler.timers.rounds == 2  # 2·max_n tokens; a round per length: 4


def test_a_pinned_n_keeps_quality_zero_speculative(engine):
    stats = _run(engine, weight=0.0, num_draft=2, n=2)
    assert all(s.draft_only_tokens == 0 and s.acceptance_rate == 1.0 and s.drafts > 0 for s in stats)


def test_per_request_num_draft_overrides_the_planner(engine):
    _costs(engine, score=lambda t: 0.010 * t, draft=0.004)  # the planner would pick 0
    stats = _run(engine, weight=0.5, num_draft=3)
    assert all(s.drafts > 0 and s.draft_tokens == 3 * s.drafts for s in stats)


def test_the_planner_learns_acceptance_and_costs_from_rounds(tiny_pair):
    eng = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=2, max_context=96, profile_budget_s=0.3))
    eng.start_sync()
    try:
        planner = eng.scheduler.models.planner
        before = planner.cost.updates
        _run(eng, weight=0.5, num_draft=2, n=2)
        assert planner.cost.updates > before
        assert planner.acceptance.tv_sums[1] > 0  # TV samples from the drafted positions
        assert planner.acceptance.kinds  # the drafted positions' acceptance, pooled by kind
        steps = planner.cost.overhead["step"]
        assert steps and all(s >= 0 for s in steps.values())  # each step's time outside its rounds
        timers = eng.scheduler.timers
        assert timers.predicted_rounds == timers.rounds > 0
    finally:
        asyncio.run(eng.stop())


def test_catch_ups_are_learned_apart_from_draft_steps(tiny_pair):
    """A w = 1 row feeds its prompt to the draft only when it first drafts (one forward over the
    prompt, in that round's draft phase). That forward is learned as a catch-up over its M tokens;
    the round's draft steps are learned without it. Catch-ups are slowed here by 200 ms each: a
    draft step (< 1 ms here) learned with one in it would read > 10 ms even averaged over every
    later round's observations (~6 with 8 tokens at N = 2)."""
    eng = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=1, max_context=96, profile_budget_s=0.3))
    eng.start_sync()
    try:
        models = eng.scheduler.models
        forward = type(models.draft).forward

        def slow_catch_ups(self, tokens, *args, **kwargs):
            if tokens.shape[1] > 2:
                time.sleep(0.2)
            return forward(self, tokens, *args, **kwargs)

        models.draft.forward = slow_catch_ups.__get__(models.draft)
        models.planner.force = 2
        prompt = len(eng.encode_chat([{"role": "user", "content": "Tom has 12 apples"}]))
        _run(eng, weight=1.0, n=1, max_tokens=8)
        cost = models.planner.cost
        # seq = prompt + the prefill's token, draft cache empty: all but the last pending are read
        # its 0.2 s reading, moved since with the host's speed as the target's forwards read it
        assert cost.seen["catch_up"] == 1 and cost.time("catch_up", prompt) >= 0.1
        assert cost.time("draft", 1, 1) < 0.01
    finally:
        models.planner.force = None
        asyncio.run(eng.stop())


def test_catch_up_near_the_context_end_stays_inside_the_draft_cache(tiny_pair):
    """An adaptive w = 1 row drafting for the first time feeds its whole sequence to the draft;
    beside it a row near `max_context` with a short lag must not be padded past the cache's end
    (found on an H100: the out-of-bounds write was a device-side assert that killed the engine).
    Each row's draft state must equal what it gets catching up alone."""
    import torch

    from server.engine.embedded.round import RoundBatch, _feed_pending
    from server.engine.embedded.row import Row

    eng = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=2, max_context=40, num_draft=2))
    eng.start_sync()
    try:
        models = eng.scheduler.models
        max_seq = models.draft_cache.shape.max_seq

        def row(slot, length, dlen):
            req = GenerationRequest(f"r{slot}", tuple(range(5, 5 + length)), SamplingOptions(max_tokens=1),
                                    Verification(weight=0.5))  # fmt: skip
            r = Row(req, lambda _c: None, 2, eng.tokenizer, frozenset())
            r.slot, r.dlen, r.tlen = slot, dlen, length - 1
            return r

        near_end, first_draft = row(0, 38, 35), row(1, 30, 0)  # lags 3 and 30
        assert near_end.dlen + (len(first_draft.seq) - 1) > max_seq  # one shared padding would overflow
        rows = [near_end, first_draft]
        together = _feed_pending(models, RoundBatch.of(rows, 2, models.device))  # [2, Hd]
        alone = torch.cat([_feed_pending(models, RoundBatch.of([r], 2, models.device)) for r in rows])
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
    finally:
        asyncio.run(eng.stop())


@pytest.mark.parametrize("from_prefill", [True, False])
def test_first_token_comes_with_the_prefill_unless_disabled(tiny_pair, from_prefill):
    """Default: the first token is drawn from the prefill's last position (a round without drafts;
    one target forward fewer per request). Disabled (what eval and training use): the first round
    drafts it, so every position goes through the request's own verification rule."""
    eng = EmbeddedEngine(
        EmbeddedEngineConfig(
            *tiny_pair, num_draft=3, max_batch=2, max_context=96, profile_budget_s=0.3,
            first_token_from_prefill=from_prefill,
        )
    )  # fmt: skip
    eng.start_sync()
    try:
        stats = _run(eng, weight=0.5, n=2, max_tokens=12)
        timers = eng.scheduler.timers
    finally:
        asyncio.run(eng.stop())
    assert all(s.drafts == s.verify_steps - from_prefill for s in stats)
    assert all(s.draft_tokens == 3 * s.drafts for s in stats)
    assert timers.rounds == max(s.verify_steps for s in stats) - from_prefill  # both rows in each round


def test_draft_only_tokens_count_what_was_kept_when_a_stop_ends_the_round(engine):
    """A draft-only round draws N_max tokens; a stop token inside it ends the request there, and
    `draft_only_tokens` counts the completion's tokens, not the ones drawn past the stop."""
    ids = tuple(engine.encode_chat([{"role": "user", "content": "Tom has 12 apples"}]))

    def run(stop_ids=()):
        req = GenerationRequest(
            "s", ids, SamplingOptions(max_tokens=20, seed=3, ignore_eos=True, stop_token_ids=stop_ids),
            Verification(weight=0.0),
        )  # fmt: skip

        async def go():
            return [c async for c in engine.generate(req)]

        return asyncio.run(go())

    free = run()
    tokens = [t for c in free for t in c.token_ids]
    stop = tokens[2]  # the third token: inside the first draft-only round (N_max >= 4)
    assert engine.config.max_num_draft >= 4 and stop not in tokens[:2]
    last = run((stop,))[-1]
    assert last.finish_reason == "stop" and last.completion_tokens == 3
    assert last.stats.draft_only_tokens == 3
