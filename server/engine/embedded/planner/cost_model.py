"""The measured cost of a decoding round: profiled at engine start, refined by every round.

Terms
    R           rows in a round (its batch size).
    n           the round's draft length; 0 = no drafts.
    T           new tokens per row in one forward; the target scores T = n + 1.
    M           tokens in one forward, the size the cost mostly depends on (`_size`): R·T for the
                target, R for a draft step (and a catch-up forward over L tokens is M = L),
                R·(n + 1) for the check.
    stages      (the stages of `server/engine/embedded/round.py`)
      draft     one draft forward of one token per row, its sampling transform and pick, run
                right after another draft step: t_draft(R)
      first_draft  the same forward right after the target's (a round's first draft step, which
                also feeds the pending tokens, and its bonus step): on a small pair the target's
                forward has evicted the draft's weights from cache, so it costs more than the
                steps after it (embedded pair: 1.42 vs 1.06 ms at R = 1, 2.04 vs 1.65 at R = 8;
                Qwen2.5 0.5B/1.5B shapes on CPU: equal); `draft` until measured
      score     one target forward over T tokens per row and its transform: t_score(R, T)
      check     ensemble weights, `verifier.verify`, results to the host: t_check(R, n)
      other     the rest of a round (batch assembly, advancing rows, detokenising): t_other(R)
      draft_only one step of a draft-only round (quality 0, `draft_only.py`): the draft alone in a
                tight loop, which on a small pair keeps its weights in cache and runs faster than
                a draft step between target forwards (the embedded pair: 1.35 vs 2.2 ms at R = 8);
                learned from those rounds only, `draft` until one has run
      catch_up  one draft forward over the M tokens a lagging draft has not read (rows that feed
                the draft only when they first draft, `round._feed_pending`): learned from the
                catch-ups rounds run, over M on a half-octave grid (`draft_length.catch_up_bucket`:
                prompt lengths rarely repeat); until one has run, `draft`'s cost at M (a prompt's
                worth of tokens is read in one forward, as a batch of M draft steps would be)
    Outside the sizes it has measured, `draft_only`, `catch_up` and `first_draft` follow `draft`'s
    curve scaled to their nearest measured point.
    step        a scheduler step's time outside its rounds and prefills, by running rows R: the
                plan, retiring and admitting rows, the loop. Paid once a step whatever the draft
                lengths, so rounds that emit more tokens spread it thinner (the embedded pair:
                ~0.5 ms against a 4 ms plain round). Learned online only (0 until a step has run).
    bonus       the expected number of bonus draft steps in a round (0..1): rows whose bonus is
                drawn from ν (w < 1) need the draft's q after the last proposal, which costs one
                more draft step when all n drafts were accepted, and always at n = 0.

    round(R, n, bonus) = (min(n, 1) + bonus)·t_first_draft(R) + max(n − 1, 0)·t_draft(R)
                         + t_score(R, n + 1) + t_check(R, n) + t_other(R)

Profile: at engine start, within a time budget, the stages run on dummy tokens at the points
that matter most first (batch 1 across T, then the largest batch); other points are interpolated
over M, piecewise linearly, and extrapolated past the largest measured M (`time`). Online: every
round's measured stage times update their entries (a running mean, then an exponential average),
so decisions follow the host's actual speed; a draft phase of n > 1 steps is split between
`first_draft` and `draft` in their current proportion, which the steps timed alone (a bonus step,
n = 1) and the profile set (`DraftPlanner.learn`). A model is cached as JSON per pair shape +
device + dtype + threads + engine code (`cost_profile.cache_key`), so a restart skips the profile.

Level: rounds re-time only the stages they run. While the planner decodes plainly, the draft and
the longer forwards are not re-timed, and a host that then slows down or speeds up (this one swings
by up to 2x over minutes) would leave drafting priced at the old speed against a plain round at the
new one: after a fast spell made plain rounds cheap, the planner would not draft again. So the model
keeps a `level`, the log of how far the host has moved: an average, over observations as they
arrive, of each re-timed entry's log(value now / its reference), the reference being the mean of
its values over its online observations `_REF_SEEN` to `_REF_SEEN + _REF_SPAN − 1` (brought to level
0), so a profile's bias on dummy inputs does not read as the host moving. Only the stages that compute count
(forwards and the check): `other` and `step` are the scheduler's Python, which drifts on its own
(+0.3 where forwards read +0.04 over one minute here). An entry not written in the last
`_STALE_AFTER` observations reads scaled by exp(level − its level when last written); entries the
rounds re-time read as measured.

Anchor: the level measures the host against live rounds, so it cannot see a profile taken in a
spell unlike the serving one (the Qwen-shape bench once read its start-up profile 2x slow, and a
row's first rounds at N = 4, priced from it alone, 33 % off). Entries the rounds have never
observed read their profile value times `anchor`: the mean ratio, over the live observations
`_ANCHOR_SKIP + 1 .. _ANCHOR_SKIP + _ANCHOR_SPAN` of each profiled entry of a computing stage
(brought to level 0), of observed to profiled seconds, shrunk towards 1 by `_ANCHOR_PRIOR`
observations. A stage's first observation is its own prior from then on, so the anchor prices
only what no round has run yet; what remains is the profile's shape (a long forward's cost
relative to a short one's), which the anchor keeps.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

KINDS = ("draft", "first_draft", "score", "check", "other", "draft_only", "catch_up", "step")
# Kinds priced like another until they have entries of their own (see the module doc).
_FALLBACK = {"draft_only": "draft", "catch_up": "draft", "first_draft": "draft"}
_EMA = 0.1  # weight of a new observation once an entry has 10 (a ~10-round memory)
_CACHED_COUNT = 3  # a cached entry counts as 3 observations: this host's rounds soon outweigh it
# The level (see the module doc). Its weight per observation: a plain round makes two that count
# (score, check), so it follows the re-timed entries within ~5 rounds; they are averages already.
_LEVEL_RATE = 0.1
_LEVEL_KINDS = frozenset(KINDS) - {"other", "step"}
_LEVEL_CLIP = 0.7  # one reading moves the level by at most this log step (a 2x outlier)
_LEVEL_FLOOR = 1e-5  # entries under 10 µs time noise more than the host: no reading
_LEVEL_BUCKET = 0.01  # fits are cached until the level moves by 1 %
# An entry's reference is the mean of log(value) − level over its online observations
# _REF_SEEN .. _REF_SEEN + _REF_SPAN − 1: its value (an average itself) from then on, less noisy
# than one reading of it (σ 0.3 per observation: one reading's error has σ ~0.1, the mean's ~0.05).
_REF_SEEN, _REF_SPAN = 8, 24
_STALE_AFTER = 64  # observations (~16 rounds) without a write before an entry follows the level
# The anchor (see the module doc): observations 2..17 of each profiled entry (the first may pay a
# shape's first-call costs), each ratio clipped to 4x either way, shrunk by one observation of 1
# (so one reading cannot move every unrun stage by its own noise; 16 plain rounds of two entries
# bring a 2x-off profile within 2 %).
_ANCHOR_SKIP, _ANCHOR_SPAN, _ANCHOR_PRIOR, _ANCHOR_CLIP = 1, 16, 1.0, 4.0
FORMAT = "dialspec-cost-model/1"


def _size(kind: str, r: int, t: int) -> int:
    """M, the tokens a stage processes (what its cost is interpolated over)."""
    if kind == "score":
        return r * t
    if kind == "check":
        return r * (t + 1)
    return r


@dataclass
class Entry:
    seconds: float
    count: int = 1
    mark: float = 0.0  # the model's level when `seconds` was written
    last: int = 0  # the model's `updates` then
    seen: int = 0  # online observations (`observe`)
    ref: float = 0.0  # its reference (see _REF_SEEN), complete once seen >= _REF_SEEN + _REF_SPAN
    origin: float | None = None  # log(seconds) − level as profiled (`set`); None if first observed


class CostModel:
    """Seconds per stage by (kind, R, T); `round_time` composes them into one round's time.

    `T` is the target's tokens per row for `score`, n for `check`, 0 for `other`, else 1; `R` is
    the tokens M for `catch_up`."""

    def __init__(self, meta: dict | None = None):
        self.entries: dict[tuple[str, int, int], Entry] = {}
        self.meta = dict(meta or {})
        self.updates = 0  # online observations so far (plans may cache on it)
        self.level = 0.0  # log of the host's speed change (see "Level" in the module doc)
        self._anchor = [0.0, 0.0]  # sum of observed / profiled ratios, their count ("Anchor")
        self._level_bucket = (0, 0)
        self._curves: dict[str, tuple[list[int], list[float]]] = {}

    @property
    def anchor(self) -> float:
        """Live over profiled seconds, for stages no round has run (see "Anchor")."""
        total, n = self._anchor
        return (total + _ANCHOR_PRIOR) / (n + _ANCHOR_PRIOR)

    def _read(self, e: Entry) -> float:
        s = e.seconds * self.anchor if e.seen == 0 and e.origin is not None else e.seconds
        if self.updates - e.last <= _STALE_AFTER:
            return s
        return s * math.exp(self.level - e.mark)

    # -- reading ---------------------------------------------------------------------------
    def _fit(self, kind: str) -> tuple[dict[int, list[tuple[int, float]]], list[int], list[float]]:
        """A kind's entries as read (cached until the next write): per batch size R, (T, seconds)
        sorted and made non-decreasing in T (`_isotonic`, weighted by observation counts: one noisy
        observation cannot make a longer forward look cheaper than a well-measured shorter one);
        and the same over M, all batch sizes pooled (entries of equal M averaged)."""
        fit = self._curves.get(kind)
        if fit is None:
            by_batch: dict[int, list[tuple[int, Entry]]] = {}
            for (k, rr, tt), e in self.entries.items():
                if k == kind:
                    by_batch.setdefault(rr, []).append((tt, e))
            per_batch: dict[int, list[tuple[int, float]]] = {}
            by_size: dict[int, list[Entry]] = {}
            for rr, points in by_batch.items():
                points.sort(key=lambda p: p[0])
                values = _isotonic([self._read(e) for _, e in points], [e.count for _, e in points])
                per_batch[rr] = [(tt, v) for (tt, _), v in zip(points, values, strict=True)]
                for (tt, e), v in zip(points, values, strict=True):
                    by_size.setdefault(_size(kind, rr, tt), []).append(Entry(v, e.count))
            sizes = sorted(by_size)
            means = [sum(e.seconds for e in by_size[m]) / len(by_size[m]) for m in sizes]
            weights = [sum(e.count for e in by_size[m]) for m in sizes]
            fit = self._curves[kind] = (per_batch, sizes, _isotonic(means, weights))
        return fit

    def time(self, kind: str, r: int, t: int) -> float:
        """Seconds of one stage: from R's own measured points (fitted, `_fit`) where t lies within
        them, else interpolated over M, kept on the right side of R's nearest measured point.

        Past the largest measured M the cost grows along the secant through all measured points
        and never faster than proportionally to M: a cost has a fixed part and a per-token part,
        and two noisy neighbours must not extrapolate to a steep line."""
        per_batch, sizes, values = self._fit(kind)
        m = _size(kind, r, t)
        if kind in _FALLBACK and (not sizes or not sizes[0] <= m <= sizes[-1]):
            # Outside its own points: the fallback kind's curve, scaled to the nearest own point
            # (one catch-up of 8 x 68 tokens must not price a 30-token one at the same seconds).
            guess = self.time(_FALLBACK[kind], r, t)
            if not sizes:
                return guess
            edge = 0 if m < sizes[0] else -1
            ref = self.time(_FALLBACK[kind], sizes[edge], 1)
            return values[edge] * guess / ref if ref > 0 else values[edge]
        # A catch-up's R is its size M: its one point per M is read off the fit over M, so a cold
        # first catch-up (one slow observation) cannot price its M above larger, well-measured ones.
        points = None if kind == "catch_up" else per_batch.get(r)
        if points and points[0][0] <= t <= points[-1][0]:
            i = bisect_left(points, (t, -math.inf))
            if points[i][0] == t:
                return points[i][1]
            (t0, v0), (t1, v1) = points[i - 1], points[i]
            return v0 + (t - t0) / (t1 - t0) * (v1 - v0)
        v = self._over_size(sizes, values, _size(kind, r, t))
        if points:  # never below R's last measured T, never above its first
            v = max(v, points[-1][1]) if t > points[-1][0] else min(v, points[0][1])
        return v

    @staticmethod
    def _over_size(sizes: list[int], values: list[float], m: int) -> float:
        if not sizes:
            return 0.0
        if m <= sizes[0]:
            return values[0]
        if m >= sizes[-1]:
            if len(sizes) == 1:
                return values[0]
            slope = max(0.0, (values[-1] - values[0]) / (sizes[-1] - sizes[0]))
            return min(values[-1] + slope * (m - sizes[-1]), values[-1] * m / sizes[-1])
        i = bisect_left(sizes, m)
        frac = (m - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return values[i - 1] + frac * (values[i] - values[i - 1])

    def round_time(self, r: int, n: int, bonus: float = 0.0) -> float:
        """Predicted seconds of one round of R rows with draft length n (see the module doc)."""
        return self.round_times(r, n, n)[0] + bonus * self.time("first_draft", r, 1)

    def round_times(self, r: int, max_n: int, min_n: int = 0) -> list[float]:
        """`round_time(r, n)` for n = min_n..max_n, reading the per-round stages once."""
        first, later, other = (
            self.time("first_draft", r, 1),
            self.time("draft", r, 1),
            self.time("other", r, 0),
        )
        return [
            min(n, 1) * first
            + max(n - 1, 0) * later
            + self.time("score", r, n + 1)
            + self.time("check", r, n)
            + other
            for n in range(min_n, max_n + 1)
        ]

    def draft_only_round_time(self, r: int, n: int) -> float:
        """Predicted seconds of a draft-only round: n draft steps and the round's fixed part."""
        return n * self.time("draft_only", r, 1) + self.time("other", r, 0)

    # -- writing ---------------------------------------------------------------------------
    def set(self, kind: str, r: int, t: int, seconds: float, count: int = 1, profiled: bool = True) -> None:
        """An entry as profiled (or cached; `profiled=False`: a live measurement, which the anchor
        leaves alone)."""
        if kind not in KINDS:
            raise ValueError(f"unknown stage {kind!r}; one of {KINDS}")
        origin = math.log(seconds) - self.level if profiled and seconds > 0 else None
        self.entries[(kind, r, t)] = Entry(float(seconds), count, self.level, self.updates, origin=origin)
        self._curves.pop(kind, None)

    def observe(self, kind: str, r: int, t: int, seconds: float) -> None:
        """One measured stage time: a running mean for the first observations, then an EMA; then
        the entry's log(now / reference) moves the level (see "Level" in the module doc)."""
        self.updates += 1
        e = self.entries.get((kind, r, t))
        if e is None:
            self.set(kind, r, t, seconds, profiled=False)
            return
        e.seconds = self._read(e)  # anchored and at the level first, then this observation
        e.count += 1
        e.seconds += max(1.0 / e.count, _EMA) * (float(seconds) - e.seconds)
        e.seen += 1
        if (
            e.origin is not None and kind in _LEVEL_KINDS and seconds > _LEVEL_FLOOR
            and _ANCHOR_SKIP < e.seen <= _ANCHOR_SKIP + _ANCHOR_SPAN
        ):  # fmt: skip
            ratio = seconds / math.exp(e.origin + self.level)
            self._anchor[0] += min(max(ratio, 1 / _ANCHOR_CLIP), _ANCHOR_CLIP)
            self._anchor[1] += 1
        e.last = self.updates
        if kind in _LEVEL_KINDS and e.seconds > _LEVEL_FLOOR and e.seen >= _REF_SEEN:
            reading = math.log(e.seconds) - self.level
            k = e.seen - _REF_SEEN
            if k < _REF_SPAN:
                e.ref += (reading - e.ref) / (k + 1)
            else:
                step = reading - e.ref
                self.level += _LEVEL_RATE * min(max(step, -_LEVEL_CLIP), _LEVEL_CLIP)
        e.mark = self.level
        bucket = (round(self.level / _LEVEL_BUCKET), round(math.log(self.anchor) / _LEVEL_BUCKET))
        if bucket != self._level_bucket:
            self._level_bucket = bucket
            self._curves.clear()
        else:
            self._curves.pop(kind, None)

    def scale(self, factor: float) -> None:
        """Every entry times `factor` (the host's speed changed; the shape did not). References
        move too: the level measures change from here on, not this change once more."""
        for e in self.entries.values():
            e.seconds *= factor
            e.ref += math.log(factor)
            if e.origin is not None:
                e.origin += math.log(factor)
        self._curves.clear()

    def copy(self) -> CostModel:
        out = CostModel(self.meta)
        out.entries = {k: Entry(**vars(e)) for k, e in self.entries.items()}
        out.updates = self.updates
        out.level, out._level_bucket = self.level, self._level_bucket
        out._anchor = list(self._anchor)
        return out

    # -- (de)serialising and showing -------------------------------------------------------
    def to_dict(self) -> dict:
        rows = [[k, r, t, self._read(e), e.count] for (k, r, t), e in sorted(self.entries.items())]
        return {"format": FORMAT, "meta": self.meta, "entries": rows}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        out = cls(data.get("meta"))
        for k, r, t, seconds, count in data["entries"]:
            out.set(k, int(r), int(t), float(seconds), min(int(count), _CACHED_COUNT))
        return out

    def summary(self, batch_sizes: list[int], max_num_draft: int) -> dict:
        """Milliseconds per stage at the given batch sizes (what `bench engine` and the engine's
        runtime info show): target forward for T = 1..N_max+1, draft step, check, other."""
        ms = lambda s: round(1e3 * s, 3)  # noqa: E731
        return {
            "meta": self.meta,
            "target_ms": {
                r: [ms(self.time("score", r, t)) for t in range(1, max_num_draft + 2)] for r in batch_sizes
            },
            "draft_step_ms": {r: ms(self.time("draft", r, 1)) for r in batch_sizes},
            # a round's first draft step and its bonus step (after the target's forward)
            "first_draft_step_ms": {r: ms(self.time("first_draft", r, 1)) for r in batch_sizes},
            "check_ms": {
                r: [ms(self.time("check", r, n)) for n in range(max_num_draft + 1)] for r in batch_sizes
            },
            "other_ms": {r: ms(self.time("other", r, 0)) for r in batch_sizes},
            "step_ms": {r: ms(self.time("step", r, 0)) for r in batch_sizes},
            # the draft step until a draft-only round has run
            "draft_only_step_ms": {r: ms(self.time("draft_only", r, 1)) for r in batch_sizes},
            # a lagging draft's catch-up forward over M tokens (the draft's cost at M until one has run)
            "catch_up_ms": {m: ms(self.time("catch_up", m, 1)) for m in (16, 64, 256)},
            "measured_points": len(self.entries),
            # the host's speed against the live references (see "Level"): 1.3 = stages run 30 % slower
            "level": round(math.exp(self.level), 3),
            # live over profiled seconds, applied to stages no round has run: 2 = the profile read 2x fast
            "anchor": round(self.anchor, 3),
        }


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, length]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += n
    return [s / w for s, w, n in blocks for _ in range(int(n))]
