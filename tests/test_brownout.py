"""Brownout: the dial's floor rules (verifier.dial) and the controller (server/gateway/brownout.py),
on a fake clock; the live overload test is in test_brownout_live.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.gateway.brownout import Brownout
from verifier.dial import (
    DialConfig,
    DialError,
    PolicyKind,
    at_quality,
    ladder,
    lowered_quality,
    resolve,
    resolve_floor,
)

CONFIG = DialConfig()
RUNGS = ladder(CONFIG)  # (1.0, 0.75, 0.5, 0.25, 0.0)
K = len(RUNGS) - 1
unit = st.floats(0.0, 1.0, allow_nan=False)


def test_ladder_is_the_tiers_and_the_draft_alone_highest_first():
    assert RUNGS == (1.0, 0.75, 0.5, 0.25, 0.0)
    assert ladder(DialConfig(tiers={"a": 0.6, "b": 0.6, "c": 0.9}, default_quality="c")) == (0.9, 0.6, 0.0)


@given(q=unit, f=unit, level=st.integers(0, K + 3))
def test_lowered_quality_never_goes_below_the_floor_nor_above_the_request(q, f, level):
    f = min(f, q)
    served = lowered_quality(q, f, level, RUNGS)
    assert f <= served <= q
    assert served == q or served in RUNGS  # a lowered request lands on a rung
    # a higher level never serves higher
    assert lowered_quality(q, f, level + 1, RUNGS) <= served


@given(q=unit, f=unit)
def test_level_zero_serves_as_asked_and_level_k_serves_at_the_lowest_allowed_rung(q, f):
    f = min(f, q)
    assert lowered_quality(q, f, 0, RUNGS) == q
    allowed = [r for r in RUNGS if f <= r < q]
    assert lowered_quality(q, f, K, RUNGS) == (min(allowed) if allowed else q)


def test_low_levels_lower_the_requests_with_the_most_room_first():
    # exact with floor 0 has room 4, exact with floor lite room 3, pro with floor standard room 1
    assert lowered_quality(1.0, 0.0, 1, RUNGS) == 0.75
    assert lowered_quality(1.0, 0.25, 1, RUNGS) == 1.0
    assert lowered_quality(1.0, 0.25, 2, RUNGS) == 0.75
    assert lowered_quality(0.75, 0.5, 3, RUNGS) == 0.75
    assert lowered_quality(0.75, 0.5, 4, RUNGS) == 0.5
    assert [lowered_quality(1.0, 0.0, k, RUNGS) for k in range(K + 1)] == list(RUNGS)


def test_resolve_floor_defaults_to_the_quality_and_reads_tiers_and_numbers():
    point = resolve("exact", config=CONFIG)
    assert resolve_floor(None, point, CONFIG) == 1.0
    assert resolve_floor("lite", point, CONFIG) == 0.25
    assert resolve_floor(0, point, CONFIG) == 0.0
    assert resolve_floor(0.3, resolve(0.6, config=CONFIG), CONFIG) == 0.3


@pytest.mark.parametrize(
    ("quality", "kw", "floor", "says"),
    [
        ("lite", {}, "pro", "above the requested quality"),
        (0.5, {}, 0.75, "above the requested quality"),
        ("exact", {}, "bogus", "unknown min_quality tier"),
        ("exact", {}, 1.5, "must lie in [0, 1]"),
        ("exact", {}, True, "must be a number"),
        ("exact", {"mode": "autoregressive"}, 0, "remove min_quality"),
        ("exact", {"policy": PolicyKind.LOSSY}, 0, "remove min_quality"),
        ("auto", {"head_dial": 0.5}, 0, "remove min_quality"),
    ],
)
def test_resolve_floor_refuses_what_brownout_cannot_honour(quality, kw, floor, says):
    point = resolve(quality, config=CONFIG, **kw)
    with pytest.raises(DialError, match=says.replace("[", r"\[")) as err:
        resolve_floor(floor, point, CONFIG)
    assert err.value.param == "min_quality" and err.value.code == "invalid_min_quality"


def test_at_quality_labels_the_tier_it_lands_on_and_keeps_n():
    point = resolve("exact", num_draft=3, config=CONFIG)
    lite = at_quality(point, 0.25, CONFIG)
    assert lite.label == "lite" and lite.verification.weight == 0.25 and lite.verification.num_draft == 3
    zero = at_quality(point, 0.0, CONFIG)
    assert zero.label == "custom" and zero.verification.weight == 0.0
    assert at_quality(point, 1.0, CONFIG) is point


# -- the controller, on a fake clock -----------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(objective=1.0, slots=4):
    clock = Clock()
    queue = {"oldest": 0.0}
    b = Brownout(CONFIG, objective, slots, lambda now: queue["oldest"], clock)
    return b, clock, queue


def feed(b: Brownout, clock: Clock, rate: float, seconds: float, per_token: dict, floor=0.0, tokens=20):
    """`rate` arrivals/s of exact requests with `floor`, each served as brownout says now and
    finishing at the cost `per_token[served quality]`; the controller ticks every 0.25 s."""
    due = 0.0
    for _ in range(int(seconds / 0.25)):
        clock.now += 0.25
        due += rate * 0.25
        while due >= 1:
            due -= 1
            asked = resolve("exact", config=CONFIG)
            b.arrived()
            served = b.serve(asked, floor)
            assert served.quality >= floor
            b.finished(asked, floor, served, per_token[served.quality] * tokens, tokens, 1)
        b.tick()


# seconds per token and slot: quality 0 (the draft alone) 4x faster than exact, the rungs between
PER_TOKEN = {1.0: 0.010, 0.75: 0.009, 0.5: 0.008, 0.25: 0.0065, 0.0: 0.0025}
# exact requests of 20 tokens on 4 slots: 0.2 slot-seconds each -> 20 requests/s at level 0


def test_below_capacity_nothing_changes_even_with_floors():
    b, clock, queue = make()
    feed(b, clock, rate=10, seconds=20, per_token=PER_TOKEN)
    assert b.level == 0 and b.degraded_s == 0
    assert b.capacity(0) == pytest.approx(20, rel=1e-6)


def true_capacity(level: int) -> float:
    """Requests/s 4 slots serve when every request is exact with floor 0, at `level`."""
    return 4 / (20 * PER_TOKEN[RUNGS[level]])


def simulate(b: Brownout, clock: Clock, queue: dict, rate: float, seconds: float, backlog: float = 0.0):
    """A fluid model of the gateway: arrivals at `rate` join a FIFO backlog that drains at the true
    capacity of the level each request was admitted at; the head's wait is backlog / capacity.
    Returns (levels per tick, the backlog at the end)."""
    levels = []
    for _ in range(int(seconds / 0.25)):
        clock.now += 0.25
        n = round(rate * 0.25)
        for _ in range(n):
            b.arrived()
        cap = true_capacity(b.level)
        served = min(backlog + n, cap * 0.25)
        for _ in range(round(served)):
            asked = resolve("exact", config=CONFIG)
            got = b.serve(asked, 0.0)
            b.finished(asked, 0.0, got, PER_TOKEN[got.quality] * 20, 20, 1)
        backlog = max(0.0, backlog + n - cap * 0.25)
        queue["oldest"] = backlog / cap
        levels.append(b.tick())
    return levels, backlog


def test_an_overload_raises_to_a_level_that_keeps_up_and_settles_there():
    b, clock, queue = make()
    levels, backlog = simulate(b, clock, queue, rate=10, seconds=5)
    assert set(levels) == {0} and backlog == 0
    levels, backlog = simulate(b, clock, queue, rate=30, seconds=20)  # 1.5x exact's capacity
    settled = levels[-40:]  # the last 10 s
    assert len(set(settled)) == 1 and true_capacity(settled[0]) >= 30
    assert queue["oldest"] < 0.5  # the objective (1 s) holds with room
    # then the load falls back: one level per hold down to 0, the queue stays empty
    levels, backlog = simulate(b, clock, queue, rate=10, seconds=20)
    assert levels[-1] == 0 and backlog == 0
    assert all(b2 <= b1 for b1, b2 in zip(levels, levels[1:], strict=False))


def test_the_feedback_raises_one_level_a_second_when_the_model_says_enough():
    b, clock, queue = make()
    feed(b, clock, rate=10, seconds=5, per_token=PER_TOKEN)
    queue["oldest"] = 0.9  # waiting although the model (only exact measured) sees no shortfall
    levels = []
    for _ in range(12):  # 3 s
        clock.now += 0.25
        levels.append(b.tick())
    assert levels == [1] * 4 + [2] * 4 + [3] * 4


def test_refusals_raise_like_a_long_wait():
    """The bounded queue keeps waits short by answering 429: a refusal is the same alarm."""
    b, clock, queue = make()
    feed(b, clock, rate=10, seconds=5, per_token=PER_TOKEN)
    queue["oldest"] = 0.1  # short
    clock.now += 0.25
    assert b.tick() == 0
    b.refused()
    clock.now += 0.25
    assert b.tick() == 1
    # and no step down while refusals go on, however calm the queue looks
    queue["oldest"] = 0.0
    for _ in range(20):
        b.refused()
        clock.now += 0.25
        b.tick()
    assert b.level >= 1


def test_it_recovers_one_level_per_hold_once_the_queue_is_empty_and_load_fell():
    b, clock, queue = make()
    feed(b, clock, rate=10, seconds=5, per_token=PER_TOKEN)
    b._set(K, clock.now)
    queue["oldest"] = 0.0
    seen = []
    for _ in range(60):  # 15 s at 10 req/s: level 0 covers 10 req/s with 30 % headroom
        feed(b, clock, rate=10, seconds=0.25, per_token=PER_TOKEN)
        seen.append(b.level)
    assert seen[-1] == 0
    drops = [i for i in range(1, len(seen)) if seen[i] < seen[i - 1]]
    assert len(drops) == K and all(seen[i - 1] - seen[i] == 1 for i in drops)
    assert all(b2 - b1 >= 8 for b1, b2 in zip(drops, drops[1:], strict=False))  # 2 s hold = 8 ticks


def test_off_never_lowers_anything():
    b, clock, queue = make(objective=None)
    feed(b, clock, rate=100, seconds=5, per_token=PER_TOKEN)
    queue["oldest"] = 100.0
    clock.now += 1
    assert b.tick() == 0 and not b.enabled
    asked = resolve("exact", config=CONFIG)
    assert b.serve(asked, 0.0) is asked


def test_requests_without_a_floor_are_never_lowered():
    b, clock, queue = make()
    b.level = K
    for quality in ("exact", "pro", 0.6):
        asked = resolve(quality, config=CONFIG)
        assert b.serve(asked, asked.quality) is asked
    learned = resolve("auto", head_dial=0.5, config=CONFIG)
    assert b.serve(learned, None) is learned
