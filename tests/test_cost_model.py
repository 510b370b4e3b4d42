"""The cost model (shape × live factors) and the start-up profile (bounded) and its cache."""

from __future__ import annotations

import json
import math
import random
import time
from types import SimpleNamespace

import pytest

from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.embedded.planner.cost_model import CostModel
from server.engine.embedded.planner.cost_profile import cache_key, cache_path, load_or_profile, profile


def test_round_time_composes_the_stages():
    m = CostModel()
    m.set("draft", 2, 1, 0.01)
    m.set("score", 2, 4, 0.05)
    m.set("check", 2, 3, 0.002)
    m.observe("other", 2, 0, 0.003)
    assert m.round_time(2, 3, bonus=0.5) == pytest.approx(3.5 * 0.01 + 0.05 + 0.002 + 0.003)


def test_a_rounds_draft_phase_is_a_first_step_premium_and_a_step_and_a_bonus_step_the_first():
    """The profile times a round's n draft steps together (the first follows the target's forward,
    with the draft's weights out of cache; the next ones follow the draft's own): n steps cost
    a + b·n, fitted over every n profiled. A bonus step follows the target's forward, as a
    round's first step does: a + b."""
    m = CostModel()
    m.set("draft", 1, 1, 0.004)  # one step: a + b
    m.set("draft", 1, 4, 0.0025)  # four: (a + 4b) / 4
    m.set("score", 1, 1, 0.01)
    m.set("score", 1, 5, 0.01)  # the target's forward costs the same at T = 1..5 here
    assert m.round_time(1, 4) == pytest.approx(4 * 0.0025 + 0.01)
    assert m.round_time(1, 2) == pytest.approx(0.002 + 2 * 0.002 + 0.01)  # a = b = 2 ms
    assert m.round_time(1, 4, bonus=0.5) == pytest.approx(4 * 0.0025 + 0.5 * 0.004 + 0.01)
    m.observe("draft", 1, 4, 0.005)  # a round's draft phase ran at twice its price
    assert m.round_time(1, 4) == pytest.approx(4 * 0.005 + 0.01)
    assert m.time("bonus", 1) == pytest.approx(0.008)  # the factor is the draft step's


def test_the_draft_phase_line_averages_noisy_points_and_never_prices_a_first_step_below_the_rest():
    """One run per point at real sizes: every n's total informs the line, so one noisy mean does
    not decide between N = 1 and 2. A fit whose first step would be the cheapest (the totals fall
    short of a line through the origin) is a line through the origin: the same price per step."""
    m = CostModel()
    noise = (1.06, 0.95, 1.04, 0.97, 1.02, 0.98, 1.03, 0.96)
    for n, e in zip(range(1, 9), noise, strict=True):
        m.set("draft", 2, n, 0.05 * e)  # the same 50 ms step at every n, ±6 % per point
    line_error = sum(abs(m.time("draft", 2, n) / 0.05 - 1) for n in range(1, 9)) / 8
    assert line_error < sum(abs(e - 1) for e in noise) / 8 / 2  # 1.2 % against the points' 3.6 %
    m.set("draft", 3, 1, 0.01)
    m.set("draft", 3, 2, 0.012)  # the second step read 14 ms against the first's 10: a < 0
    assert m.time("draft", 3, 1) == m.time("draft", 3, 2) == pytest.approx((0.01 + 0.024) / 3)


def test_overheads_are_the_profiled_points_until_measured_live():
    """The engine's own time per round (`other`) and per step: the start-up profile's points
    (`overhead_profile.py`), over R between them, kept by the frozen profile; live, what the
    engine measures replaces them, a plain mean of the first readings, then an average."""
    m = CostModel()
    m.set("other", 1, 0, 1e-3)
    m.set("other", 8, 0, 8e-3)
    assert m.time("other", 4, 0) == pytest.approx(4e-3) and m.time("step", 4, 0) == 0.0
    for seconds in (3e-3, 1e-3, 2e-3):  # one outlier first: averaged, not kept at 0.9^k of it
        m.observe("other", 1, 0, seconds)
    assert m.time("other", 1, 0) == pytest.approx(2e-3)
    assert m.time("other", 8, 0) == pytest.approx(2e-3)  # live readings, nearest batch size
    assert m.frozen().time("other", 1, 0) == 1e-3  # the profile keeps its own
    for _ in range(20):
        m.observe("other", 1, 0, 4e-3)
    # the mean of the first 10 readings (3.4 ms), then 13 at weight 0.1
    assert m.time("other", 1, 0) == pytest.approx(4e-3 - 0.6e-3 * 0.9**13)


def test_the_shape_interpolates_over_tokens_per_forward_and_never_falls():
    m = CostModel()
    m.set("score", 1, 1, 1.0)
    m.set("score", 1, 3, 3.0)  # M = 3
    m.set("score", 8, 1, 5.0)  # M = 8
    assert m.time("score", 1, 2) == pytest.approx(2.0)  # between M = 1 and 3
    assert m.time("score", 2, 2) == pytest.approx(3.4)  # M = 4: between 3 and 8
    assert m.time("score", 8, 2) == pytest.approx(5.0 * 16 / 8)  # past the largest M: proportional
    m.set("score", 1, 2, 4.0)  # a noisy T = 2 above T = 3: a longer forward never reads cheaper
    assert m.time("score", 1, 3) == pytest.approx(4.0)
    costs = [m.time("score", 1, t) for t in range(1, 12)]
    assert costs == sorted(costs)
    assert m.time("draft", 1) == 0.0 and m.time("other", 4, 0) == 0.0  # nothing profiled or seen


def test_catch_ups_and_draft_only_steps_take_the_draft_steps_shape_until_profiled():
    """A lagging draft reads M tokens in one forward, a draft-only step is a draft step: both are
    priced from the draft's shape at the same M until profiled, and learn factors of their own."""
    m = CostModel()
    m.set("draft", 1, 1, 0.01)
    m.set("draft", 8, 1, 0.05)
    assert m.time("catch_up", 4) == pytest.approx(m.time("draft", 4))
    assert m.time("catch_up", 32) == pytest.approx(0.05 * 32 / 8)  # past the largest: grows with M
    assert m.draft_only_round_time(8, 4) == pytest.approx(4 * 0.05)
    m.observe("draft_only", 8, 1, 0.025)  # the draft alone in a tight loop runs faster
    m.observe("catch_up", 16, 1, 0.06)
    assert m.time("draft_only", 8) == pytest.approx(0.025) and m.time("draft_only", 1) == pytest.approx(0.005)
    assert m.time("catch_up", 32) == pytest.approx(0.12)
    assert m.time("draft", 8) == pytest.approx(0.05)  # neither moves the draft step


def test_a_factor_starts_at_the_mean_of_its_readings_then_tracks_the_latest():
    m = CostModel()
    m.set("score", 1, 1, 1.0)
    for s in (1.0, 4.0):
        m.observe("score", 1, 1, s)
    assert m.time("score", 1, 1) == pytest.approx(2.0)  # geometric mean of 1 and 4
    for _ in range(100):
        m.observe("score", 1, 1, 10.0)
    assert m.time("score", 1, 1) == pytest.approx(10.0, rel=1e-3)
    m.observe("score", 1, 1, 1000.0)  # one outlier moves it by at most exp(RATE * CLIP)
    assert m.time("score", 1, 1) < 10.0 * math.exp(0.1 * 0.7) * 1.0001


def _profiled(bias: float = 1.0) -> CostModel:
    """The profile of a pair whose 1-token target forward costs 10 ms, read `bias` times its cost."""
    m = CostModel()
    for t in range(1, 7):
        m.set("score", 1, t, bias * (0.010 + 0.002 * (t - 1)))
    for n in range(6):
        m.set("check", 1, n, bias * (0.0005 + 0.0001 * n))
    m.set("draft", 1, 1, bias * 0.003)
    return m


def _plain_rounds(m: CostModel, rounds: int, speed: float, rng: random.Random, noise: float = 0.0) -> None:
    """Rounds at n = 0 (what the planner runs when drafting does not pay) on a host `speed` times
    as slow as the true costs (score(1, 1) 10 ms, check 0.5 ms), each off by lognormal noise."""
    for _ in range(rounds):
        jitter = lambda: math.exp(rng.gauss(0.0, noise))  # noqa: E731
        m.observe("score", 1, 1, speed * 0.010 * jitter())
        m.observe("check", 1, 0, speed * 0.0005 * jitter())
        m.observe("other", 1, 0, 0.0002 * jitter())
        m.observe("step", 1, 0, 0.0003 * jitter())


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_a_host_that_changes_speed_moves_the_price_of_stages_plain_rounds_do_not_run(speed):
    """Plain rounds time only the target's 1-token forward and the check. A host that speeds up 2x
    (or slows down) must move drafting's price with them: a draft step priced at the old speed
    against plain rounds at the new one kept the planner from drafting again after a fast spell.
    40 rounds with 30 % lognormal noise per reading: the speed factor's error is ~0.3 · √(0.1/1.9)
    ≈ 7 % (σ of an EMA of rate 0.1), so 25 % is > 3σ."""
    m = _profiled()
    _plain_rounds(m, 40, speed, random.Random(0), noise=0.3)
    for stage, r, t, true in (("draft", 1, 1, 0.003), ("score", 1, 6, 0.020), ("catch_up", 8, 1, 0.024)):
        assert m.time(stage, r, t) == pytest.approx(speed * true, rel=0.25), stage
    assert m.round_time(1, 4) / m.round_time(1, 0) == pytest.approx(
        _profiled().round_time(1, 4) / _profiled().round_time(1, 0), rel=0.05
    )  # the profile's shape is kept (the overheads aside)


def test_a_stage_the_profile_misprices_is_learned_where_it_runs_apart_from_the_host():
    """A profile read 2x slow throughout (another spell) is read right by the first plain rounds.
    A draft step that in rounds runs 1.5x what the profile's shape says, relative to the target
    (after the target's forward it has lost its cache), is learned from drafting rounds; a host
    that then speeds up 2x moves it with the target, the relation kept."""
    m = _profiled(bias=2.0)
    _plain_rounds(m, 3, 1.0, random.Random(0))
    assert m.time("score", 1, 1) == pytest.approx(0.010, rel=1e-6)
    assert m.time("draft", 1, 1) == pytest.approx(0.003, rel=1e-6)
    for _ in range(60):
        m.observe("score", 1, 3, 0.014)
        m.observe("draft", 1, 1, 1.5 * 0.003)
    assert m.time("draft", 1, 1) == pytest.approx(0.0045, rel=1e-3)
    _plain_rounds(m, 60, 0.5, random.Random(1))
    assert m.time("draft", 1, 1) == pytest.approx(0.00225, rel=5e-3)  # 0.9^60 of log 2 left: 0.1 %
    assert m.summary([1], 2)["relative"]["draft"] == pytest.approx(1.5, rel=1e-3)


def test_json_round_trip_keeps_the_shape_only():
    m = CostModel({"device": "x"})
    m.set("score", 4, 2, 0.5)
    m.observe("score", 4, 2, 1.0)
    back = CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.points == {"score": {(4, 2): 0.5}} and back.meta == {"device": "x"}
    assert back.time("score", 4, 2) == 0.5
    with pytest.raises(ValueError):
        CostModel.from_dict({"format": "other"})


@pytest.fixture(scope="module")
def models(tiny_pair):
    eng = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=4, max_context=64))
    return eng.load_models()


def test_profile_measures_the_stages_within_its_budget(models):
    t0 = time.perf_counter()
    m = profile(models, max_batch=4, max_num_draft=8, budget_s=1.0)
    assert time.perf_counter() - t0 < 2.0
    assert {"score", "draft", "check", "catch_up"} <= set(m.points)
    # a lagging draft's forward over a prompt's worth of tokens (half the cache here, at most 64)
    assert (min(64, models.draft_cache.shape.max_seq // 2), 1) in m.points["catch_up"]
    assert all(s > 0 for points in m.points.values() for s in points.values())
    summary = m.summary([1, 4], 8)
    assert len(summary["target_ms"][1]) == 9 and summary["draft_step_ms"][4] > 0


def test_first_call_costs_do_not_eat_the_profile_budget(models, monkeypatch):
    """A real-size model's first forward (first touch of its weights) can take longer than the
    whole budget; it runs before the clock, so the budget still buys the T = N_max + 1 point."""
    from server.engine.embedded.planner import cost_profile

    real_run = cost_profile._Stages.run
    first = {"done": False}

    def slow_first(self, stage, r, t):
        if not first["done"]:
            first["done"] = True
            time.sleep(0.6)
        return real_run(self, stage, r, t)

    monkeypatch.setattr(cost_profile._Stages, "run", slow_first)
    m = profile(models, max_batch=4, max_num_draft=8, budget_s=0.5)
    assert {(1, 1), (1, 9)} <= set(m.points["score"]) and (1, 1) in m.points["draft"]
    assert m.meta["warm_up_s"] >= 0.6 and m.meta["profile_s"] < 0.6 + 0.5


def test_each_point_is_its_fastest_pass(models, monkeypatch):
    """The plan runs twice and a point keeps its faster reading: a host stall in one pass (here
    the first, then the second, at every other point) does not price the point. A budget that
    buys one pass only measures each point once, the first pass first."""
    from server.engine.embedded.planner import cost_profile
    from server.engine.embedded.planner.cost_model import Stage

    seen: dict = {}

    def measure(self, stage, r, n, reps, warm_up=True):
        key = (stage, r, n)
        runs = seen[key] = seen.get(key, 0) + 1
        stalled = runs == 1 + list(seen).index(key) % 2  # even points stall in pass 1, odd in pass 2
        seconds = 1e-4 * (r + n + 1) * (10 if stalled else 1)
        if stage == Stage.CATCH_UP:
            return {(stage, r, n): seconds}
        return {(Stage.SCORE, r, n + 1): seconds, (Stage.CHECK, r, n): 1e-5}

    monkeypatch.setattr(cost_profile._Stages, "measure", measure)
    m = profile(models, max_batch=4, max_num_draft=3, budget_s=5.0)
    assert set(seen.values()) == {cost_profile.PASSES} == {2}
    for stage, r, n in seen:
        kind, at = ("score", (r, n + 1)) if stage == Stage.ROUND else ("catch_up", (r, n))
        assert m.points[kind][at] == pytest.approx(1e-4 * (r + n + 1)), (stage, r, n)
    seen.clear()
    monkeypatch.setattr(cost_profile, "time", SimpleNamespace(perf_counter=_clock(step=0.05)))
    profile(models, max_batch=4, max_num_draft=3, budget_s=0.5)
    assert seen and set(seen.values()) == {1}


def _clock(step: float):
    """A clock that moves `step` seconds a reading (a profile that sees its budget run out)."""
    t = [0.0]

    def now() -> float:
        t[0] += step
        return t[0]

    return now


def test_a_tiny_budget_still_measures_the_first_point(models):
    """The first point is a plain round at batch 1 (N = 0: what every tier is measured against)."""
    m = profile(models, max_batch=4, max_num_draft=8, budget_s=0.0)
    assert m.points.keys() == {"score", "check"}
    assert (1, 1) in m.points["score"] and (1, 0) in m.points["check"]


def test_the_profile_times_each_stage_where_a_round_runs_it(models, monkeypatch):
    """Each point is a round's stages in a round's order: n draft steps, the target's forward over
    n + 1 tokens, the check; a catch-up alone. Every round a planner chooses between is priced
    from such points: at batch 1 and the largest, N = 0, 1 and N_max, and a check with no drafts."""
    from server.engine.embedded.planner import cost_profile

    calls: list[tuple[str, int, int]] = []
    real_run = cost_profile._Stages.run
    monkeypatch.setattr(cost_profile, "WARM_UP_S", 0.0)

    def spy(self, stage, r, t):
        calls.append((str(stage), r, t))
        return real_run(self, stage, r, t)

    monkeypatch.setattr(cost_profile._Stages, "run", spy)
    m = profile(models, max_batch=4, max_num_draft=3, budget_s=5.0)
    warm_up = [("draft", 1, 1), ("score", 1, 2), ("check", 1, 1)]
    assert calls[:3] == warm_up  # one round before the clock (WARM_UP_S = 0 here)
    one_round = [("draft", 4, 1)] * 3 + [("score", 4, 4), ("check", 4, 3)]  # R = 4, n = 3
    rounds = [calls[i : i + 5] for i in range(len(calls) - 4)]
    assert one_round in rounds
    assert {(1, 0), (4, 0), (1, 3), (4, 3)} <= set(m.points["check"])
    assert {(1, 1), (1, 3), (4, 1), (4, 3)} <= set(m.points["draft"])  # (R, n): a step's mean over n
    assert {(r, t) for r in (1, 4) for t in range(1, 5)} <= set(m.points["score"])
    assert ("catch_up", min(64, models.draft_cache.shape.max_seq // 2), 1) in calls


def test_a_fresh_profile_holds_the_engines_own_overheads_and_a_cached_one_reads_them(
    tiny_pair, tmp_path, monkeypatch
):
    """The engine's own time per round and step is measured once, on plain dummy requests at
    batch 1 and its largest batch, and cached with the profile: a restart plans seeded rows on the
    same overheads (same fingerprint) without measuring them again."""
    from server.engine.embedded import overhead_profile

    config = EmbeddedEngineConfig(*tiny_pair, max_batch=3, max_context=64, cache_dir=tmp_path)
    first = EmbeddedEngine(config)
    profile_ = first.load_models().planner.profile
    for stage in ("other", "step"):
        assert set(profile_.points[stage]) == {(1, 0), (3, 0)}
        assert all(s > 0 for s in profile_.points[stage].values())
    assert profile_.meta["overheads_s"] > 0

    def measured_again(*args):
        raise AssertionError("a cached profile's overheads were measured again")

    monkeypatch.setattr(overhead_profile, "measure_overheads", measured_again)
    again = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=3, max_context=64, cache_dir=tmp_path))
    cached = again.load_models().planner.profile
    assert cached.meta["source"] == "cache" and cached.points == profile_.points
    assert again.info.runtime["system_fingerprint"] == first.info.runtime["system_fingerprint"]


def test_cache_is_keyed_by_shape_device_dtype_and_code(models, tmp_path):
    first = load_or_profile(models, 4, 8, 0.5, tmp_path)
    path = cache_path(tmp_path, cache_key(models))
    assert path.is_file() and first.meta["source"] == "profile"
    again = load_or_profile(models, 4, 8, 0.5, tmp_path)
    assert again.meta["source"] == "cache"
    assert again.points == first.points  # the shape as profiled (the live factors read today's speed)
    key = cache_key(models)
    assert cache_path(tmp_path, key | {"dtype": "torch.bfloat16"}) != path
    assert cache_path(tmp_path, key | {"code": "edited"}) != path  # timings of other engine code


def test_the_code_digest_covers_the_engine_rooms_and_the_verifier(tmp_path):
    """Cached timings are invalidated by an edit to any source a round runs: the embedded engine's
    round, model and planner (in their sub-packages since the engine split into rooms) and the
    verifier. The bench and the SGLang client only read or bypass the engine: edits there keep
    the cache."""
    import shutil

    from server.engine.embedded.planner.cost_profile import ROOT, code_digest, timed_sources

    names = {f.relative_to(ROOT).as_posix() for f in timed_sources()}
    assert {
        "server/engine/embedded/round.py",
        "server/engine/embedded/model/llama.py",
        "server/engine/embedded/planner/cost_model.py",
        "verifier/chain.py",
        "verifier/policies.py",
    } <= names
    assert not any("/bench/" in n or "/sglang/" in n for n in names)
    # an edit in a copy of the tree moves its digest; one in the bench does not
    for part in ("server/engine/embedded", "verifier"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = code_digest(tmp_path)
    assert before == code_digest.__wrapped__(ROOT)  # the copy reads as the tree it came from
    for edited in ("server/engine/embedded/model/llama.py", "verifier/chain.py"):
        with (tmp_path / edited).open("a") as f:
            f.write("# edited\n")
        after = code_digest.__wrapped__(tmp_path)
        assert after != before, edited
        before = after
    with (tmp_path / "server/engine/embedded/bench/report.py").open("a") as f:
        f.write("# edited\n")
    assert code_digest.__wrapped__(tmp_path) == before
