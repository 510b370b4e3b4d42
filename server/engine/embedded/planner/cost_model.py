"""The cost of a decoding round: the start-up profile's shape times live speed factors.

Terms
    R, n, T   rows in a round, its draft length, and tokens per row in one forward (T = n + 1
              for the target's); for a draft step, T = n: its mean over a round's n steps.
    M         tokens one forward processes, what a stage's cost mostly depends on: R·T for the
              target, R for a draft step, R·(n + 1) for the check, L for a catch-up over L tokens.
    shape     seconds per `Stage` from the rounds profiled at start (`cost_profile.py`),
              frozen: linear over T between a batch size's own points, else over M between all
              points (equal M averaged), proportional to M past the last; non-decreasing either
              way (one noisy point cannot make a longer forward read cheaper). A round's draft
              phase at a profiled R is a line over n, a + b·n (`_draft_phase`): a first-step
              premium and a step, fitted to every n profiled (one run each at real sizes, where
              each n's own mean made N = 1 against 2 a coin toss). A stage with no points of its
              own (a catch-up, a draft-only step) takes the draft step's at M.
    speed     log of how much slower than profiled the host runs now, read from the one stage
              every speculative round runs: the target's forward. An exponential average of
              log(measured / shape) over rounds (the first observations are a plain mean).
    relative  per other computing stage (draft — bonus steps included —, check, catch-up,
              draft-only), the same average of log(measured / (shape · speed)), over the rounds
              that run it.
    overhead  `other` (per round) and `step` (per scheduler step), by R: the engine's Python,
              which dummy stages cannot run; measured at start on the engine's own plain rounds
              (`overhead_profile.py`) as points of the shape, then the same average per R of
              what was measured (seconds, not a factor: Python does not scale with the models).

    round(R, n, b) = n·draft(R, n) + b·draft(R, 1) + score(R, n + 1) + check(R, n) + other(R)
    with b the expected bonus steps (rows that draw the bonus from ν: a draft step after the
    target's forward, as a round's first is), and stage = shape · exp(speed + relative).

Why two factors, not one per stage: a host that slows down or speeds up (this one swings by 2x
over minutes) is seen by every round, plain ones included, and must move the price of drafting
with it; otherwise, after a fast spell re-timed plain rounds only, drafting stayed priced at the
old speed and the planner never drafted again. What the profile's dummy inputs get wrong about
one stage relative to the target (the engine's draft phase also feeds the drafts and builds masks;
a draft-only loop keeps the draft's weights in cache and runs faster than a round's draft step) is
learned where that stage runs. Drafting that the profile underprices is corrected by the rounds
it runs; drafting it overprices by the planner's exploration (`draft_planner.py`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from enum import StrEnum


class Stage(StrEnum):
    """A decoding step's stages: what the round times (`timers.py`) and this model prices."""

    DRAFT = "draft"  # a draft step of R rows with its sampling (priced as its mean over n steps)
    BONUS = "bonus"  # a draft step for q after the last proposal (rows that draw from ν)
    SCORE = "score"  # one target forward over N + 1 tokens per row, with p
    CHECK = "check"  # ensemble weights, `verifier.verify`, the results read back
    CATCH_UP = "catch_up"  # a lagging draft's forward over the tokens it has not read
    DRAFT_ONLY = "draft_only"  # a draft step of a draft-only round (quality 0: no target)
    OTHER = "other"  # the rest of a round: batch assembly, advancing rows, detokenising
    STEP = "step"  # a scheduler step outside its rounds and prefills: plan, admit, retire
    ROUND = "round"
    PREFILL = "prefill"
    PLAN = "plan"


FORMAT = "dialspec-cost-model/2"
RATE = 0.1  # an observation's weight once a factor has 10 (a ~10-round memory)
CLIP = 0.7  # one reading moves a factor by at most this log step (a 2x outlier)
COMPUTING = (Stage.DRAFT, Stage.SCORE, Stage.CHECK, Stage.CATCH_UP, Stage.DRAFT_ONLY)
OVERHEADS = (Stage.OTHER, Stage.STEP)
_PRICED_AS = {Stage.BONUS: Stage.DRAFT}  # a bonus step is a draft step after the target's forward


def size(stage: Stage, r: int, t: int) -> int:
    """M, the tokens a stage processes (what its shape is interpolated over)."""
    if stage == Stage.SCORE:
        return r * t
    if stage == Stage.CHECK:
        return r * (t + 1)
    return r


class CostModel:
    """Seconds per stage by (stage, R, T): T is the target's tokens per row for `score`, n for
    `check` and `draft`, else 1; R is the tokens M for `catch_up`. `round_time` composes a round."""

    def __init__(self, meta: dict | None = None):
        self.points: dict[Stage, dict[tuple[int, int], float]] = {}
        self.meta = dict(meta or {})
        self.log_factor: dict[Stage, float] = {}  # SCORE: speed; others: relative
        self.seen: dict = {}  # readings per computing stage, and per (overhead, R)
        self.overhead: dict[Stage, dict[int, float]] = {s: {} for s in OVERHEADS}
        self.updates = 0
        self._curves: dict[tuple, tuple[list[int], list[float]]] = {}
        self._lines: dict[tuple[int, int], tuple[float, ...]] = {}  # (R, n) -> drafts, score, check shapes
        self._phases: dict[int, tuple[float, float] | None] = {}  # R -> the draft phase's (a, b)

    # -- the shape -------------------------------------------------------------------------
    def set(self, stage: Stage | str, r: int, t: int, seconds: float) -> None:
        """A profiled (or cached) point of the shape."""
        self.points.setdefault(Stage(stage), {})[(r, t)] = float(seconds)
        self._curves.clear()
        self._lines.clear()
        self._phases.clear()

    def _curve(self, stage: Stage, r: int | None) -> tuple[list[int], list[float]]:
        """(sizes, seconds) made non-decreasing: over T at batch size r, or over M (r = None)."""
        key = (stage, r)
        if key not in self._curves:
            by_x: dict[int, list[float]] = {}
            for (rr, t), s in self.points.get(stage, {}).items():
                if r is None or rr == r:
                    by_x.setdefault(size(stage, rr, t) if r is None else t, []).append(s)
            xs, values, top = sorted(by_x), [], 0.0
            for x in xs:
                top = max(top, sum(by_x[x]) / len(by_x[x]))
                values.append(top)
            self._curves[key] = (xs, values)
        return self._curves[key]

    def _draft_phase(self, r: int) -> tuple[float, float] | None:
        """(a, b): a round's n draft steps at R rows take a + b·n seconds, least squares over the
        profiled n (its per-step means times n), a >= 0 (the first step, after the target's
        forward, is the dearest); None if R has no draft points."""
        if r not in self._phases:
            totals = [(t, t * s) for (rr, t), s in self.points.get(Stage.DRAFT, {}).items() if rr == r]
            line = None
            if totals:
                mx, my = (sum(v) / len(totals) for v in zip(*totals, strict=True))
                var = sum((x - mx) ** 2 for x, _ in totals)
                b = sum((x - mx) * (y - my) for x, y in totals) / var if var else my / mx
                a = my - b * mx
                line = (a, b) if a >= 0 and b >= 0 else (0.0, my / mx)  # else through the origin
            self._phases[r] = line
        return self._phases[r]

    def shape(self, stage: Stage, r: int, t: int) -> float:
        """The profiled seconds of one stage at (R, T) (module doc)."""
        if stage == Stage.DRAFT and (phase := self._draft_phase(r)) is not None:
            return phase[0] / max(t, 1) + phase[1]
        ts, values = self._curve(stage, r)
        if ts and ts[0] <= t <= ts[-1]:
            return _linear(ts, values, t)
        sizes, values = self._curve(stage, None)
        m = size(stage, r, t)
        if not sizes:
            return self.shape(Stage.DRAFT, m, 1) if stage in (Stage.CATCH_UP, Stage.DRAFT_ONLY) else 0.0
        return values[-1] * m / sizes[-1] if m >= sizes[-1] else _linear(sizes, values, m)

    # -- reading ---------------------------------------------------------------------------
    def factor(self, stage: Stage) -> float:
        """exp(speed + relative): live seconds over profiled ones for a computing stage."""
        stage = _PRICED_AS.get(stage, stage)
        rel = 0.0 if stage == Stage.SCORE else self.log_factor.get(stage, 0.0)
        return math.exp(self.log_factor.get(Stage.SCORE, 0.0) + rel)

    def time(self, stage: Stage | str, r: int, t: int = 1) -> float:
        stage = Stage(stage)
        if stage in OVERHEADS:
            measured = self.overhead[stage]
            if not measured:  # the profiled points, if any
                return self.shape(stage, r, 0)
            return measured.get(r) or measured[min(measured, key=lambda k: abs(k - r))]
        return self.shape(_PRICED_AS.get(stage, stage), r, t) * self.factor(stage)

    def round_time(self, r: int, n: int, bonus: float = 0.0, per_round: tuple | None = None) -> float:
        """Predicted seconds of one round of R rows at draft length n with `bonus` expected
        bonus steps: the shape's draft phase, target forward and check (read once per (R, n):
        the shape is frozen) times this moment's factors. `per_round`: `_per_round(r)`, if
        already read."""
        if (r, n) not in self._lines:
            drafts = n * self.shape(Stage.DRAFT, r, n) if n else 0.0
            self._lines[r, n] = (drafts, self.shape(Stage.SCORE, r, n + 1), self.shape(Stage.CHECK, r, n))
        drafts, score, check = self._lines[r, n]
        bonus_step, draft_factor, score_factor, check_factor, other = per_round or self._per_round(r)
        return (
            draft_factor * drafts + bonus * bonus_step + score_factor * score + check_factor * check + other
        )

    def round_times(self, r: int, max_n: int) -> list[float]:
        """`round_time` for n = 0..max_n, what does not depend on n read once (a plan reads these
        per batch size; reading them per n was half of the planner's time)."""
        per_round = self._per_round(r)
        return [self.round_time(r, n, per_round=per_round) for n in range(max_n + 1)]

    def _per_round(self, r: int) -> tuple[float, float, float, float, float]:
        """(bonus step, draft, target and check factors, other) at R rows: a round's parts but n."""
        return (
            self.time(Stage.BONUS, r),
            self.factor(Stage.DRAFT),
            self.factor(Stage.SCORE),
            self.factor(Stage.CHECK),
            self.time(Stage.OTHER, r),
        )

    def draft_only_round_time(self, r: int, n: int) -> float:
        return n * self.time(Stage.DRAFT_ONLY, r) + self.time(Stage.OTHER, r)

    # -- learning --------------------------------------------------------------------------
    def observe(self, stage: Stage | str, r: int, t: int, seconds: float) -> None:
        """One measured stage time (per draft step for `draft`, `bonus`, `draft_only`)."""
        stage, seconds = Stage(stage), max(float(seconds), 0.0)
        self.updates += 1
        if stage in OVERHEADS:  # a plain mean of the first readings, then the average
            line = self.overhead[stage]
            k = self.seen[stage, r] = self.seen.get((stage, r), 0) + 1
            line[r] = line.get(r, 0.0) + max(RATE, 1 / k) * (seconds - line.get(r, 0.0))
            return
        stage = _PRICED_AS.get(stage, stage)
        shape = self.shape(stage, r, t)
        if shape <= 0 or seconds <= 0:
            return
        base = 0.0 if stage == Stage.SCORE else self.log_factor.get(Stage.SCORE, 0.0)
        reading = math.log(seconds / shape) - base
        k = self.seen[stage] = self.seen.get(stage, 0) + 1
        old = self.log_factor.get(stage, 0.0)
        if k * RATE < 1:  # a plain mean of the first readings
            self.log_factor[stage] = old + (reading - old) / k
        else:
            self.log_factor[stage] = old + RATE * min(max(reading - old, -CLIP), CLIP)

    def frozen(self) -> CostModel:
        """The shape alone (no live factors or overheads): the start-up profile's predictions."""
        out = CostModel(self.meta)
        out.points = {s: dict(p) for s, p in self.points.items()}
        return out

    # -- (de)serialising and showing -------------------------------------------------------
    def to_dict(self) -> dict:
        rows = [[str(s), r, t, v] for s, p in sorted(self.points.items()) for (r, t), v in sorted(p.items())]
        return {"format": FORMAT, "meta": self.meta, "points": rows}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        out = cls(data.get("meta"))
        for s, r, t, v in data["points"]:
            out.set(s, int(r), int(t), float(v))
        return out

    def summary(self, batch_sizes: list[int], max_num_draft: int) -> dict:
        """Milliseconds per stage at the given batch sizes (`bench engine`, the engine's runtime
        info): the target's forward for T = 1..N_max+1, a draft step, the check, the overheads."""
        ms = lambda s: round(1e3 * s, 3)  # noqa: E731
        per_r = lambda stage, t=1: {r: ms(self.time(stage, r, t)) for r in batch_sizes}  # noqa: E731
        over_t = lambda stage, ts: {r: [ms(self.time(stage, r, t)) for t in ts] for r in batch_sizes}  # noqa: E731
        return {
            "meta": self.meta,
            "target_ms": over_t(Stage.SCORE, range(1, max_num_draft + 2)),
            "draft_step_ms": per_r(Stage.DRAFT),
            "check_ms": over_t(Stage.CHECK, range(max_num_draft + 1)),
            "other_ms": per_r(Stage.OTHER, 0),
            "step_ms": per_r(Stage.STEP, 0),
            "draft_only_step_ms": per_r(Stage.DRAFT_ONLY),
            "catch_up_ms": {m: ms(self.time(Stage.CATCH_UP, m)) for m in (16, 64, 256)},
            "profiled_points": sum(len(p) for p in self.points.values()),
            # the host now against the profile: 1.3 = the target's forward runs 30 % slower
            "speed": round(self.factor(Stage.SCORE), 3),
            # each other stage against the profile's shape at that speed
            "relative": {str(s): round(math.exp(v), 3) for s, v in self.log_factor.items() if s != "score"},
        }  # fmt: skip


def _linear(xs: list[int], values: list[float], x: int) -> float:
    if x <= xs[0]:
        return values[0]
    i = bisect_left(xs, x)
    if xs[i] == x:
        return values[i]
    return values[i - 1] + (x - xs[i - 1]) / (xs[i] - xs[i - 1]) * (values[i] - values[i - 1])
