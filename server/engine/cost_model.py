"""The measured cost of a decoding round: profiled at engine start, refined by every round.

Terms
    R           rows in a round (its batch size).
    n           the round's draft length; 0 = no drafts.
    T           new tokens per row in one forward; the target scores T = n + 1.
    M           tokens in one forward, the size the cost mostly depends on (`_size`): R·T for the
                target, R for a draft step (and a catch-up forward over L tokens is M = L),
                R·(n + 1) for the check.
    stages      (the stages of `server/engine/step.py`)
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
                the draft only when they first draft, `step._feed_pending`): learned from the
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
n = 1) and the profile set (`DraftPlanner.learn`). A model is cached as JSON per pair shape + device +
dtype + threads + engine code (`cache_key`), so a restart skips the profile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import platform
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from server.engine.step import Models

KINDS = ("draft", "first_draft", "score", "check", "other", "draft_only", "catch_up", "step")
# Kinds priced like another until they have entries of their own (see the module doc).
_FALLBACK = {"draft_only": "draft", "catch_up": "draft", "first_draft": "draft"}
_EMA = 0.1  # weight of a new observation once an entry has 10 (a ~10-round memory)
_CACHED_COUNT = 3  # a cached entry counts as 3 observations: this host's rounds soon outweigh it
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


class CostModel:
    """Seconds per stage by (kind, R, T); `round_time` composes them into one round's time.

    `T` is the target's tokens per row for `score`, n for `check`, 0 for `other`, else 1; `R` is
    the tokens M for `catch_up`."""

    def __init__(self, meta: dict | None = None):
        self.entries: dict[tuple[str, int, int], Entry] = {}
        self.meta = dict(meta or {})
        self.updates = 0  # online observations so far (plans may cache on it)
        self._curves: dict[str, tuple[list[int], list[float]]] = {}

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
                values = _isotonic([e.seconds for _, e in points], [e.count for _, e in points])
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
        return (
            (min(n, 1) + bonus) * self.time("first_draft", r, 1)
            + max(n - 1, 0) * self.time("draft", r, 1)
            + self.time("score", r, n + 1)
            + self.time("check", r, n)
            + self.time("other", r, 0)
        )

    def draft_only_round_time(self, r: int, n: int) -> float:
        """Predicted seconds of a draft-only round: n draft steps and the round's fixed part."""
        return n * self.time("draft_only", r, 1) + self.time("other", r, 0)

    # -- writing ---------------------------------------------------------------------------
    def set(self, kind: str, r: int, t: int, seconds: float, count: int = 1) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown stage {kind!r}; one of {KINDS}")
        self.entries[(kind, r, t)] = Entry(float(seconds), count)
        self._curves.pop(kind, None)

    def observe(self, kind: str, r: int, t: int, seconds: float) -> None:
        """One measured stage time: a running mean for the first observations, then an EMA."""
        self.updates += 1
        e = self.entries.get((kind, r, t))
        if e is None:
            self.set(kind, r, t, seconds)
            return
        e.count += 1
        e.seconds += max(1.0 / e.count, _EMA) * (float(seconds) - e.seconds)
        self._curves.pop(kind, None)

    def scale(self, factor: float) -> None:
        """Every entry times `factor` (the host's speed changed; the shape did not)."""
        for e in self.entries.values():
            e.seconds *= factor
        self._curves.clear()

    def copy(self) -> CostModel:
        out = CostModel(self.meta)
        out.entries = {k: Entry(e.seconds, e.count) for k, e in self.entries.items()}
        return out

    # -- (de)serialising and showing -------------------------------------------------------
    def to_dict(self) -> dict:
        rows = [[k, r, t, e.seconds, e.count] for (k, r, t), e in sorted(self.entries.items())]
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


# -- profiling ---------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def code_digest() -> str:
    """A digest of the engine's and the verifier's source, which is what cached timings were
    measured with: an edit there (another kernel path, a cheaper transform) invalidates cached
    cost models and dtype choices instead of leaving decisions measured on older code (a cached
    dtype probe once kept float32 for a pair that runs 2x faster in bfloat16)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for f in sorted([*(root / "server" / "engine").glob("*.py"), *(root / "verifier").glob("*.py")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_key(models: Models) -> dict:
    """What a cached model is valid for: the pair's shapes, device, dtype, threads, torch, code."""
    t, d = models.target, models.draft
    return {
        "target": vars(t.args),
        "draft": vars(d.args),
        "device": device_name(models.device),
        "dtype": str(t.embed.weight.dtype),
        "threads": models.num_threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "code": code_digest(),
    }


def cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"cost-{digest}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Stages:
    """The round's stages on dummy inputs, in the engine's own caches (free before serving)."""

    def __init__(self, models: Models):
        self.m = models
        self.dev = models.device
        self.vocab = models.target.args.vocab_size
        self.ctx = min(64, models.target_cache.shape.max_seq // 2)  # a short chat's context

    def _forward(self, model, cache, r: int, t: int) -> torch.Tensor:
        from verifier import logits_to_probs

        tokens = torch.randint(0, self.vocab, (r, t), device=self.dev)  # [R, T]
        slots = torch.arange(r, device=self.dev)  # [R]
        starts = torch.full((r,), self.ctx, dtype=torch.long, device=self.dev)  # [R]
        return logits_to_probs(model.logits(model(tokens, slots, starts, cache, True)))  # [R, T, V]

    def run(self, kind: str, r: int, t: int) -> None:
        from verifier import sample_inverse_cdf, verify

        m = self.m
        with torch.inference_mode():
            if kind == "catch_up":  # one draft forward over r tokens of one row, no logits
                tokens = torch.randint(0, self.vocab, (1, r), device=self.dev)  # [1, M]
                zero = torch.zeros(1, dtype=torch.long, device=self.dev)  # [1]
                m.draft(tokens, zero, zero, m.draft_cache, True)
            elif kind == "score":
                self._forward(m.target, m.target_cache, r, t)
            elif kind == "draft":
                q = self._forward(m.draft, m.draft_cache, r, 1)[:, 0]  # [R, V]
                sample_inverse_cdf(q, torch.rand(r, device=self.dev))
            elif kind == "first_draft":  # a draft step timed from after a target forward, as in a round
                self._forward(m.target, m.target_cache, r, 2)
                _sync(self.dev)
                t0 = time.perf_counter()
                self.run("draft", r, 1)
                return time.perf_counter() - t0
            elif kind == "check":
                p = torch.rand(r, t + 1, self.vocab, device=self.dev).softmax(-1)  # [R, n+1, V]
                q = torch.rand(r, t, self.vocab, device=self.dev).softmax(-1)  # [R, n, V]
                x = torch.randint(0, self.vocab, (r, t), device=self.dev)  # [R, n]
                _sync(self.dev)
                t0 = time.perf_counter()
                res = verify(p, q, x, 0.5, uniforms=torch.rand(r, t + 1, device=self.dev), validate=False)
                res.num_accepted.tolist(), res.tokens.tolist()
                return time.perf_counter() - t0
        _sync(self.dev)
        return None

    def measure(self, kind: str, r: int, t: int, reps: int, warm_up: bool = True) -> float:
        """Median of `reps` timed runs (after one untimed run at this shape if `warm_up`)."""
        times = []
        for i in range(reps + warm_up):
            _sync(self.dev)
            t0 = time.perf_counter()
            inner = self.run(kind, r, t)
            dt = inner if inner is not None else time.perf_counter() - t0
            if i or not warm_up:
                times.append(dt)
        return sorted(times)[len(times) // 2]


def _plan(max_batch: int, max_n: int, catch_up: int = 64) -> list[tuple[str, int, int]]:
    """Profile points, most useful first: batch 1 (latency) at both ends of T (with the draft
    step, the two points a fixed + per-token cost needs), then the largest batch, then a catch-up
    over a prompt's worth (`catch_up` tokens: the level its curve is scaled to), then the rest."""
    tmax, rmax = max_n + 1, max_batch
    mids = [r for r in (2, 4) if 1 < r < rmax]
    order = [
        ("score", 1, 1), ("draft", 1, 1), ("score", 1, tmax), ("check", 1, 1), ("score", 1, 2),
        ("score", rmax, 1), ("draft", rmax, 1), ("score", rmax, tmax), ("score", rmax, 2),
        ("check", 1, max_n), ("check", rmax, max_n), ("check", rmax, 1), ("catch_up", catch_up, 1),
        ("first_draft", 1, 1), ("first_draft", rmax, 1),
        *[("score", 1, t) for t in range(3, tmax)],
        *[(k, r, t) for r in mids for (k, t) in (("score", 1), ("draft", 1), ("score", 2), ("score", tmax))],
        *[("score", rmax, t) for t in range(3, tmax)],
    ]  # fmt: skip
    seen, out = set(), []
    for point in order:
        if point not in seen:
            seen.add(point)
            out.append(point)
    return out


def profile(models: Models, max_batch: int, max_num_draft: int, budget_s: float = 3.0) -> CostModel:
    """Measure the stages within about `budget_s` seconds (the first point is always measured;
    a point whose predicted cost would overrun the budget is skipped).

    The first forward of each model runs before the clock starts: it pays one-off costs (first
    touch of the weights' pages, allocator growth) that on a real-size model on CPU take seconds
    and would otherwise leave no budget for the points. Cheap points (< 20 ms) are the median of 3
    runs after a warm-up run; expensive ones are one run (a warm-up would double their cost for
    little: host noise is a smaller share of a long forward, and rounds refine them online)."""
    stages = _Stages(models)
    model = CostModel({"source": "profile", "budget_s": budget_s})
    t_warm = time.perf_counter()
    stages.run("score", 1, 1)
    stages.run("draft", 1, 1)
    t_start = time.perf_counter()
    for kind, r, t in _plan(max_batch, max_num_draft, stages.ctx):
        guess = model.time(kind, r, t)
        if kind == "first_draft":  # it runs after an untimed target forward, which costs as much
            guess += model.time("score", r, 2)
        cheap = guess < 0.02
        runs = 4 if cheap else 1
        spent = time.perf_counter() - t_start
        if model.entries and spent + guess * runs > budget_s:
            continue
        model.set(kind, r, t, stages.measure(kind, r, t, 3 if cheap else 1, warm_up=cheap))
    model.meta["warm_up_s"] = round(t_start - t_warm, 3)
    model.meta["profile_s"] = round(time.perf_counter() - t_start, 3)
    return model


def load_or_profile(
    models: Models, max_batch: int, max_num_draft: int, budget_s: float, cache_dir: Path | None
) -> CostModel:
    """The cached model for this pair shape + device + dtype + threads, else a fresh profile
    (written to the cache when `cache_dir` is set)."""
    key = cache_key(models)
    path = cache_path(cache_dir, key) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            model = CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            model = None  # unreadable or another format: profile again and overwrite
        if model is not None:
            model.meta.update(source="cache", path=str(path))
            recalibrate(model, models)
            return model
    model = profile(models, max_batch, max_num_draft, budget_s)
    model.meta.update(device=key["device"], dtype=key["dtype"], threads=key["threads"])
    if path is not None:
        save(model, path)
    return model


def recalibrate(model: CostModel, models: Models) -> float:
    """Scale a cached model to this host's speed now; returns the factor (also in `meta`).

    A cache keeps the speeds of the minutes it was profiled in, and this host's speed swings by up
    to 2x. Rounds correct only the stages they exercise: decoding plainly re-times the target's
    1-token forward but never the draft or the longer forwards, so a model cached in a slow spell
    went on pricing drafting at the slow speed and the planner never drafted (seen: a fresh engine
    on a 2x-slow cache decoded 8 requests plainly where drafting ran 1.35x). The target's 1-token
    forward and a draft step are timed once more (median of 3 when cheap) and every entry is
    scaled by the geometric mean of measured / cached: the cached shape is kept, its level is
    this host's now."""
    stages = _Stages(models)
    stages.run("score", 1, 1)  # first-call costs out of the clock, as in `profile`
    stages.run("draft", 1, 1)
    logs = []
    for kind in ("score", "draft"):
        cached = model.time(kind, 1, 1)
        if cached > 0:
            cheap = cached < 0.02
            measured = stages.measure(kind, 1, 1, 3 if cheap else 1, warm_up=cheap)
            logs.append(math.log(max(measured, 1e-9) / cached))
    factor = math.exp(sum(logs) / len(logs)) if logs else 1.0
    model.scale(factor)
    model.meta["recalibrated"] = round(factor, 4)
    return factor


def save(model: CostModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=1) + "\n")
    tmp.replace(path)
