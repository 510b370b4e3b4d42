"""Frontiers of task score vs acceptance (or time) per method, their areas, and paired verdicts.

Terms
    point       one policy setting (a method at one knob value) evaluated on a task's prompts:
                per-prompt scores and per-prompt (accepted, proposed) draft-token counts.
    acceptance  of a point: Σ accepted / Σ proposed over its prompts (the paper's acceptance rate).
    frontier    of a method: the upper concave hull of its points in the (acceptance, score) plane,
                made non-increasing in acceptance — mixing two settings request by request reaches
                any point on the segment between them, and a higher-acceptance setting that scores
                at least as well serves every lower acceptance too. It is defined for acceptance
                up to the method's highest measured acceptance (flat to the left of its lowest).
    shared range  for a comparison: from the lowest of the methods' lowest acceptances to the
                lowest of their highest — where every method's frontier is defined (below its
                own lowest point a method scores that point's score: it is faster than needed).
    area        the mean of the frontier over the shared range (area / width: a score). Methods
                whose frontiers end before the others' begin (lossy and typical acceptance sit a
                point above SD's on math and code) would leave no range shared by all; the areas
                then leave out, lowest end first, the methods that end too early, and say so.
    dominance   A dominates B at matched acceptance when the mean of f_A − f_B over their shared
                range exceeds 2 standard errors AND at no grid point of that range is f_A − f_B
                below −2 of its own standard errors.
    SE          from a paired bootstrap over prompts: every method saw the same prompts with the
                same seeds, so each resample draws prompt indices once and recomputes every
                point's acceptance and score, every frontier and every difference from them.

The time axis (score vs normalised time, lower is better) uses the same construction on
`−norm_time`. Where the eval kept each interleaved chunk's (seconds, tokens) for every point and
for AR (`training.policy_eval`: all policies ran chunk j in the same minutes), each resample also
draws chunk indices, once for all points, and recomputes every normalised time from those chunks:
the SE then covers the host's timing noise as well as the prompts' draws. Without chunk times
(older results) a point's time is one measurement and the bootstrap varies scores only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

GRID = 41  # evaluation points across a shared range
MIN_WIDTH = 0.01  # a shared range narrower than this is "no overlap"


@dataclass(frozen=True)
class Point:
    family: str  # the method, e.g. "static", "cascade", "learned"
    name: str  # e.g. "static w=0.5"
    scores: np.ndarray  # [P] per-prompt task score
    accepted: np.ndarray  # [P] accepted draft tokens per prompt
    proposed: np.ndarray  # [P] proposed draft tokens per prompt
    norm_time: float  # time per token / AR's
    chunk_time: np.ndarray | None = None  # [C, 2] (seconds, completion tokens) per interleaved chunk
    ar_chunk_time: np.ndarray | None = None  # [C, 2] AR's, same chunks

    def norm_time_on(self, chunks: np.ndarray | None) -> float:
        """Normalised time over a resample of chunk indices (None: as measured, all chunks)."""
        if chunks is None or self.chunk_time is None or self.ar_chunk_time is None:
            return self.norm_time
        own, ar = self.chunk_time[chunks].sum(0), self.ar_chunk_time[chunks].sum(0)  # [2], [2]
        return float((own[0] / max(own[1], 1.0)) / (ar[0] / max(ar[1], 1.0)))


def _hull(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Upper concave hull of points (x ascending), then made non-increasing in x from the right."""
    order = np.lexsort((-ys, xs))
    hull: list[tuple[float, float]] = []
    for x, y in zip(xs[order], ys[order], strict=True):
        if hull and x == hull[-1][0]:
            continue  # same x: the higher y came first
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (x - x1) <= (y - y1) * (x2 - x1):  # middle point on or below the chord
                hull.pop()
            else:
                break
        hull.append((float(x), float(y)))
    hx, hy = np.array([h[0] for h in hull]), np.array([h[1] for h in hull])
    return hx, np.maximum.accumulate(hy[::-1])[::-1]  # serving higher x also serves lower x


def frontier_at(xs: np.ndarray, ys: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The frontier of points (xs, ys) evaluated on `grid` (NaN beyond the largest x)."""
    hx, hy = _hull(np.asarray(xs, float), np.asarray(ys, float))
    out = np.interp(grid, hx, hy)  # flat left of the first hull point
    return np.where(grid > hx[-1] + 1e-12, np.nan, out)


Sample = tuple[np.ndarray, np.ndarray | None]  # (prompt indices [P], chunk indices [C] or None)


def _coords(points: list[Point], sample: Sample, axis: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, score) of each point on a resample (prompts, chunks); x = acceptance or −norm_time."""
    idx, chunks = sample
    if axis == "acceptance":
        x = np.array([p.accepted[idx].sum() / max(p.proposed[idx].sum(), 1) for p in points])
    else:
        x = np.array([-p.norm_time_on(chunks) for p in points])
    return x, np.array([p.scores[idx].mean() for p in points])


def _chunk_count(groups: dict[str, list[Point]]) -> int:
    """C when every point has chunk times over the same C chunks, else 0 (time not resampled)."""
    counts = {
        0 if p.chunk_time is None or p.ar_chunk_time is None else len(p.chunk_time)
        for pts in groups.values()
        for p in pts
    }
    return counts.pop() if len(counts) == 1 else 0


def _extent(pts: list[Point], axis: str) -> tuple[float, float]:
    x, _ = _coords(pts, (np.arange(len(pts[0].scores)), None), axis)
    return float(x.min()), float(x.max())


def shared_range(groups: dict[str, list[Point]], axis: str) -> tuple[float, float] | None:
    extents = [_extent(pts, axis) for pts in groups.values()]
    lo, hi = min(e[0] for e in extents), min(e[1] for e in extents)  # lowest minimum, lowest maximum
    return (lo, hi) if hi - lo >= MIN_WIDTH else None


def _area_members(groups: dict[str, list[Point]], axis: str) -> tuple[list[str], dict[str, float]]:
    """The methods the areas compare, and those left out (name -> where its frontier ends): all of
    them if they share a range, else drop the method whose frontier ends lowest until they do."""
    ends = {m: _extent(pts, axis)[1] for m, pts in groups.items()}
    members, left_out = list(groups), {}
    while len(members) > 2 and shared_range({m: groups[m] for m in members}, axis) is None:
        name = min(members, key=lambda m: (ends[m], m))
        members.remove(name)
        left_out[name] = ends[name]
    return members, left_out


def _curves(groups: dict[str, list[Point]], idx, axis, grid) -> dict[str, np.ndarray]:
    return {name: frontier_at(*_coords(pts, idx, axis), grid) for name, pts in groups.items()}


def analyse(groups: dict[str, list[Point]], axis: str = "acceptance", boot: int = 400, seed: int = 0) -> dict:
    """Areas over the range shared by every method, and pairwise verdicts over each pair's range.

    `groups`: method -> its points (each method needs >= 1 point; AR has no acceptance and is
    left out by the caller). Returns {"range", "areas": {m: {area, se}}, "left_out": {m: where its
    frontier ends}, "pairs": {"A>B": {...}}}.
    """
    rng = np.random.default_rng(seed)
    prompts = len(next(iter(groups.values()))[0].scores)
    draws = [rng.integers(0, prompts, prompts) for _ in range(boot)]
    # chunks from a stream of their own: the prompt resamples stay those of results without chunks
    rng_chunks, c = np.random.default_rng(seed + 1), _chunk_count(groups)
    chunks = [rng_chunks.integers(0, c, c) if c > 1 else None for _ in range(boot)]
    samples: list[Sample] = [(np.arange(prompts), None), *zip(draws, chunks, strict=True)]
    members, left_out = _area_members(groups, axis)
    shared = {m: groups[m] for m in members}
    out: dict = {"axis": axis, "range": shared_range(shared, axis), "areas": {}, "pairs": {}}
    out["left_out"] = left_out if out["range"] is not None else {}
    if out["range"] is not None:
        grid = np.linspace(*out["range"], GRID)
        with warnings.catch_warnings():  # a method with no point in the range has an all-NaN curve
            warnings.simplefilter("ignore", RuntimeWarning)
            curves = [_curves(shared, s, axis, grid).values() for s in samples]
            vals = np.array([[np.nanmean(c) for c in per] for per in curves])
        for j, name in enumerate(shared):
            out["areas"][name] = {"area": float(vals[0, j]), "se": float(np.nanstd(vals[1:, j], ddof=1))}
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            out["pairs"][f"{a} vs {b}"] = _pair(groups, a, b, axis, samples)
    return out


def _pair(groups, a: str, b: str, axis: str, samples) -> dict:
    rng_ab = shared_range({a: groups[a], b: groups[b]}, axis)
    if rng_ab is None:
        return {"range": None, "verdict": "no overlap"}
    grid = np.linspace(*rng_ab, GRID)
    diffs = []
    for s in samples:
        fa = frontier_at(*_coords(groups[a], s, axis), grid)
        fb = frontier_at(*_coords(groups[b], s, axis), grid)
        diffs.append(fa - fb)  # [GRID]; NaN where a resample pushed a method's range below the grid
    diffs = np.array(diffs)  # [1+boot, GRID]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN resamples are dropped below
        mean_diff = np.nanmean(diffs, axis=1)  # [1+boot]
    se = float(np.nanstd(mean_diff[1:], ddof=1))
    point_se = np.nanstd(diffs[1:], axis=0, ddof=1)  # [GRID]
    worst = float(np.nanmin(diffs[0] + 2 * point_se))  # < 0: somewhere clearly below
    margin = float(mean_diff[0])
    if margin > 2 * se and worst >= 0:
        verdict = f"{a} dominates"
    elif -margin > 2 * se and float(np.nanmin(-diffs[0] + 2 * point_se)) >= 0:
        verdict = f"{b} dominates"
    else:
        verdict = "neither dominates"
    return {"range": rng_ab, "mean_diff": margin, "se": se, "verdict": verdict}


def prompt_oracle(points: list[Point], lambdas: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """The frontier of an oracle that picks, per prompt, one of `points` as it realised (its score
    and its accepted/proposed counts on that prompt), to maximise the mean score at each pooled
    acceptance: an upper bound for anything that decides per prompt among these settings, and an
    optimistic one (at temperature > 0 it keeps each prompt's luckiest draw).

    Pooled acceptance a = Σ accepted / Σ proposed, so "acceptance ≥ a" is Σ (accepted − a·proposed)
    ≥ 0, and the Lagrangian splits per prompt: for a multiplier λ ≥ 0 each prompt takes the setting
    maximising score + λ·(accepted − a·proposed) / proposed̄ (counts scaled to one prompt's mean). Every
    such choice is a supported point of the frontier; returns their hull's vertices (x ascending).
    On a grid of a and λ: within 1e-3 of the exact hull (tests: every choice of 3 settings x 5 prompts)."""
    scores = np.stack([p.scores for p in points])  # [K, P]
    accepted = np.stack([p.accepted for p in points])  # [K, P]
    proposed = np.stack([p.proposed for p in points])  # [K, P]
    scale = max(float(proposed.mean()), 1.0)
    cols = np.arange(scores.shape[1])
    xs, ys = [], []
    for a in np.linspace(0.0, 1.0, 101):
        for lam in np.concatenate([[0.0], np.geomspace(1e-3, 1e3, lambdas)]):
            pick = np.argmax(scores + lam * (accepted - a * proposed) / scale, axis=0)  # [P]
            xs.append(accepted[pick, cols].sum() / max(proposed[pick, cols].sum(), 1.0))
            ys.append(scores[pick, cols].mean())
    return _hull(np.array(xs), np.array(ys))
