"""Percentiles and the summary block used for every latency.

`percentile(values, q)` uses linear interpolation between closest ranks, the same definition as
`numpy.percentile` (method "linear"), which `vllm bench serve` and `sglang.bench_serving` report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# The percentiles every latency summary carries (besides the mean).
PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`, linearly interpolated; NaN when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def summarize(values: Sequence[float], scale: float = 1.0) -> dict:
    """{count, mean, median, p90, p99, std, min, max} of `values` times `scale` (e.g. 1000 for ms).

    Empty input gives count 0 and None elsewhere (JSON-friendly; NaN is not valid JSON)."""
    n = len(values)
    if n == 0:
        return {
            k: (0 if k == "count" else None)
            for k in ("count", "mean", "median", "p90", "p99", "std", "min", "max")
        }
    xs = [v * scale for v in values]
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    return {
        "count": n,
        "mean": mean,
        "median": percentile(xs, 50.0),
        "p90": percentile(xs, 90.0),
        "p99": percentile(xs, 99.0),
        "std": std,
        "min": min(xs),
        "max": max(xs),
    }
