"""Fault isolation in the embedded engine (tiny pair): a request that makes a batched step raise
fails alone, the requests batched with it get exactly the tokens they get without it, the engine
keeps serving; an engine that cannot run even a probe request declares a fault and stops.
Also the admission of sampling values no engine can honour as given (issue 12's inputs)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.engine.protocol import EngineError, GenerationRequest, SamplingOptions
from verifier.dial import Verification

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=[3, None], ids=["fixed_n", "adaptive_n"])
def engine(tiny_pair, request):
    """A fixed N, and the default adaptive N with costs under which N varies: seeded rows keep
    their exact output through fault retries either way (their N follows their own history)."""
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from tests.tiny_pair import drafting_costs

    target, draft = tiny_pair
    config = EmbeddedEngineConfig(target, draft, num_draft=request.param, max_batch=4, max_context=128)
    eng = EmbeddedEngine(config)
    eng.start_sync()
    eng.scheduler.models.planner.set_cost(drafting_costs(4, eng.config.max_num_draft))
    yield eng
    eng.scheduler.stop()
    eng.scheduler = None


def request(rid: str, seed: int, weight: float = 1.0, **sampling) -> GenerationRequest:
    opts = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": seed, "ignore_eos": True, **sampling}
    return GenerationRequest(rid, (5, 6, 7, 8 + seed), SamplingOptions(**opts), Verification(weight=weight))


class Collector:
    """A sink: token ids per request, or the exception that ended it."""

    def __init__(self):
        self.cv = threading.Condition()
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.finished = False

    def __call__(self, item) -> None:
        with self.cv:
            if isinstance(item, BaseException):
                self.error, self.finished = item, True
            else:
                self.tokens += item.token_ids
                self.finished = item.finish_reason is not None
            self.cv.notify_all()

    def wait(self, timeout: float = 60.0) -> Collector:
        with self.cv:
            assert self.cv.wait_for(lambda: self.finished, timeout), "request did not finish"
        return self


def run_together(engine, requests, poison=None) -> list[Collector]:
    """Build every row first and queue them at once, so the scheduler admits them into one batch;
    `poison(row)` may break a row after admission checks, as a bug reachable from a request would."""
    sinks = [Collector() for _ in requests]
    rows = [engine.make_row(r, s) for r, s in zip(requests, sinks, strict=True)]
    for row in rows:
        if poison is not None:
            poison(row)
    with engine.scheduler._cv:  # hold the loop off until all are queued: one admission, one batch
        for row in rows:
            engine.scheduler.submit(row)
    return [s.wait() for s in sinks]


def solo(engine, req) -> list[int]:
    return run_together(engine, [req])[0].tokens


def is_poisoned(row) -> bool:
    return row.request.request_id.startswith("poison")


def test_round_fault_fails_only_its_request_and_keeps_the_others_exact(engine):
    innocent = [request(f"ok-{i}", seed=i) for i in range(3)]
    alone = [solo(engine, r) for r in innocent]
    faults = engine.scheduler.faults

    def nan_temperature(row):  # a value admission would refuse, reaching the sampling transform
        if is_poisoned(row):
            row.temperature = float("nan")

    out = run_together(engine, [innocent[0], request("poison", 9), *innocent[1:]], nan_temperature)
    assert isinstance(out[1].error, EngineError) and out[1].error.kind == "internal"
    assert "ValueError" in str(out[1].error)
    # each row's coins were put back before it was re-run alone: same tokens as without the fault
    assert [o.tokens for o in (out[0], out[2], out[3])] == alone
    assert all(o.error is None and len(o.tokens) == MAX_TOKENS for o in (out[0], out[2], out[3]))
    assert engine.scheduler.faults == faults + 1 and engine.fault is None
    assert asyncio.run(engine.readiness()) is None
    assert solo(engine, innocent[0]) == alone[0]  # still serving


def test_prefill_fault_fails_only_its_request(engine):
    innocent = [request(f"ok-{i}", seed=10 + i) for i in range(2)]
    alone = [solo(engine, r) for r in innocent]

    def bad_token(row):  # past the embedding table: the prefill forward raises
        if is_poisoned(row):
            row.seq[1] = 10**6

    out = run_together(engine, [innocent[0], request("poison", 3), innocent[1]], bad_token)
    assert isinstance(out[1].error, EngineError) and out[1].error.kind == "internal"
    assert [out[0].tokens, out[2].tokens] == alone and engine.fault is None


def test_fault_while_emitting_fails_only_that_row(engine):
    innocent = [request(f"ok-{i}", seed=20 + i) for i in range(3)]
    alone = [solo(engine, r) for r in innocent]

    class Exploding:
        def feed(self, text):
            raise RuntimeError("stop filter bug")

        flush = feed

    def explode(row):
        if is_poisoned(row):
            row.stopper = Exploding()

    out = run_together(engine, [innocent[0], innocent[1], request("poison", 4), innocent[2]], explode)
    assert isinstance(out[2].error, EngineError) and "RuntimeError" in str(out[2].error)
    assert [out[0].tokens, out[1].tokens, out[3].tokens] == alone and engine.fault is None


@pytest.mark.parametrize("fault_after", [2, 4, 12])
@pytest.mark.parametrize(
    "weights",
    [(0.5, 0.7, 0.3, 0.5), (0.7, 0.7, 0.7, 0.7), (0.5, 0.5, 0.5, 0.5)],
    ids=["mixed", "w0.7", "w0.5"],
)
def test_fault_while_emitting_mid_request_keeps_the_others_exact(engine, fault_after, weights):
    """The poisoned row raises in a later round's `advance`: the rows before it in the batch have
    advanced (and learned their acceptance from the round), the rows after it run their round next
    step. Under the adaptive N each must be planned as if nothing had happened: the evidence of an
    advanced row is its own (`round.advance`), and a row whose round did not run is planned again
    from the same state (`Scheduler.step`)."""
    # (on the tiny pair with `drafting_costs` these tiers draft at N 1-3, and w = 0.7 stops
    # drafting once its evidence says so: N moves with what each row has learned. Measured: with
    # the evidence learned after the round, as before, 5 of these 9 cases failed)
    innocent = [request(f"ok-{i}", seed=30 + i, weight=w) for i, w in enumerate(weights[:3])]
    alone = [solo(engine, r) for r in innocent]

    class ExplodingLater:
        def __init__(self):
            self.fed = 0

        def feed(self, text):
            self.fed += 1
            if self.fed > fault_after:
                raise RuntimeError("stop filter bug")
            return text, False

        def flush(self):
            return ""

    def explode(row):
        if is_poisoned(row):
            row.stopper = ExplodingLater()

    poison = request("poison", 4, weight=weights[3])
    out = run_together(engine, [innocent[0], poison, innocent[1], innocent[2]], explode)
    assert isinstance(out[1].error, EngineError) and "RuntimeError" in str(out[1].error)
    assert [out[0].tokens, out[2].tokens, out[3].tokens] == alone and engine.fault is None


def test_sampling_values_are_served_as_the_engine_can(engine):
    """Issue 12's inputs, sent by a direct Python caller: each is served or refused with an
    EngineError, and a normal request afterwards is served."""
    base = request("base", seed=5)
    greedy = solo(engine, request("g", seed=5, temperature=0.0))
    assert solo(engine, request("t", seed=5, temperature=1e-50)) == greedy  # tiny t = greedy
    assert solo(engine, request("t", seed=5, temperature=1e-30)) == greedy
    # top_p 5e-324 is 0 in float32; any top_p <= 1/V keeps exactly the top token
    assert solo(engine, request("p", seed=5, top_p=5e-324)) == solo(engine, request("p", seed=5, top_p=1e-3))
    # top_k past int64 (and past the vocabulary) keeps every token, as top_k = 0 does
    assert solo(engine, request("k", seed=5, top_k=2**63)) == solo(engine, base)
    for bad in ({"seed": False}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_k": True}):
        with pytest.raises(EngineError) as exc:
            engine.make_row(request("bad", **{"seed": 5, **bad}), Collector())
        assert exc.value.kind == "invalid_request" and next(iter(bad)) in str(exc.value)
        assert len(solo(engine, base)) == MAX_TOKENS
    bad_prompt = GenerationRequest("b", (1, False), SamplingOptions())  # bool is not a token id
    with pytest.raises(EngineError, match="token ids"):
        engine.make_row(bad_prompt, Collector())


def test_unrecoverable_fault_stops_the_engine(tiny_pair):
    """When the probe request fails too, the engine is broken: every request fails, readiness says
    so, and new requests are refused (the gateway then exits non-zero: test_gateway_faults)."""
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    target, draft = tiny_pair
    eng = EmbeddedEngine(EmbeddedEngineConfig(target, draft, num_draft=3, max_batch=2, max_context=128))
    eng.start_sync()
    try:
        assert solo(eng, request("before", seed=1))

        def device_lost(*args, **kwargs):
            raise RuntimeError("device lost")

        eng.scheduler.models.target.forward = device_lost
        out = run_together(eng, [request("a", 1), request("b", 2)])
        assert all(isinstance(o.error, EngineError) for o in out)
        eng.scheduler._thread.join(10)  # the probe runs after the suspects are failed
        assert isinstance(eng.fault, RuntimeError) and not eng.scheduler.alive
        reason = asyncio.run(eng.readiness())
        assert reason is not None and "failed" in reason and "RuntimeError" in reason
        with pytest.raises(EngineError) as exc:
            eng.submit(request("after", 3), Collector())
        assert exc.value.kind == "unavailable"
    finally:
        eng.scheduler.stop()
        eng.scheduler = None
