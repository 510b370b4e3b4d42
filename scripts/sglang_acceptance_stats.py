"""Statistics of the SGLang acceptance suite (scripts/sglang_acceptance.py), pure Python + scipy.

Every test here is a hypothesis test at a stated false-alarm level; the suite applies a
Bonferroni correction over the tests of one check (`alpha / m` each), so a correct runtime fails
a check with probability at most `alpha`. Tests that must *reject* (power checks) use the same
machinery, so a check that cannot fail is itself caught.

Terms
    sample      one generated sequence, a tuple of token ids (positions 1..L).
    cell        a category of the chi-square table (a token id, or OTHER for the pooled rest).
    expected    under the null: counts the cell would have on average.
Cells whose expected count is below `MIN_EXPECTED` are pooled into OTHER (the chi-square
approximation needs about 5 per cell); a test with fewer than two cells is not run (None).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

MIN_EXPECTED = 5.0
OTHER = -1


@dataclass(frozen=True)
class ChiSquare:
    """A chi-square test result: statistic, degrees of freedom, p-value, cells used."""

    statistic: float
    df: int
    pvalue: float
    cells: int

    def rejects(self, level: float) -> bool:
        return self.pvalue < level


def _pool(cells: dict[int, list[float]], expected_of, min_expected: float) -> dict[int, list[float]]:
    """Merge cells whose expected count (by `expected_of(values)`) is small into OTHER."""
    out: dict[int, list[float]] = {}
    other: list[float] | None = None
    for key, values in cells.items():
        if key != OTHER and expected_of(values) >= min_expected:
            out[key] = values
        else:
            other = values if other is None else [a + b for a, b in zip(other, values, strict=True)]
    if other is not None:
        if expected_of(other) >= min_expected or not out:
            out[OTHER] = other
        else:  # still too small: fold OTHER into the smallest cell
            smallest = min(out, key=lambda k: expected_of(out[k]))
            out[smallest] = [a + b for a, b in zip(out[smallest], other, strict=True)]
    return out


def two_sample(a: Sequence[int], b: Sequence[int], min_expected: float = MIN_EXPECTED) -> ChiSquare | None:
    """Pearson chi-square test that two samples of categories come from one law (homogeneity)."""
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        return None
    ca, cb = Counter(a), Counter(b)
    n = na + nb
    cells = {k: [float(ca.get(k, 0)), float(cb.get(k, 0))] for k in set(ca) | set(cb)}
    # expected count of the smaller sample's share: the binding constraint for the approximation
    share = min(na, nb) / n
    pooled = _pool(cells, lambda v: (v[0] + v[1]) * share, min_expected)
    if len(pooled) < 2:
        return None
    stat = 0.0
    for oa, ob in pooled.values():
        tot = oa + ob
        ea, eb = tot * na / n, tot * nb / n
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = len(pooled) - 1
    return ChiSquare(stat, df, float(stats.chi2.sf(stat, df)), len(pooled))


def goodness_of_fit(
    sample: Sequence[int], probs: Mapping[int, float], min_expected: float = MIN_EXPECTED
) -> ChiSquare | None:
    """Pearson chi-square test of `sample` against the law `probs` (token -> probability).

    Tokens outside `probs` count as OTHER, whose probability is 1 − Σ probs (clamped at 0): the
    law may be known only on a set of tokens (e.g. the top-K log-probs a server returned).
    """
    n = len(sample)
    if n == 0:
        return None
    counts = Counter(t if t in probs else OTHER for t in sample)
    rest = max(0.0, 1.0 - sum(probs.values()))
    cells = {k: [float(counts.get(k, 0)), n * p] for k, p in probs.items()}
    cells[OTHER] = [float(counts.get(OTHER, 0)), n * rest]
    pooled = _pool(cells, lambda v: v[1], min_expected)
    if len(pooled) < 2:
        return None
    total_expected = sum(e for _, e in pooled.values())
    scale = n / total_expected  # probs from a server sum to 1 only up to rounding
    stat = sum((o - e * scale) ** 2 / (e * scale) for o, e in pooled.values())
    df = len(pooled) - 1
    return ChiSquare(stat, df, float(stats.chi2.sf(stat, df)), len(pooled))


def per_position(samples: Sequence[Sequence[int]], position: int) -> list[int]:
    """Token at 1-based `position` of every sample long enough to have one."""
    return [s[position - 1] for s in samples if len(s) >= position]


@dataclass(frozen=True)
class Bootstrap:
    """Observed difference of pooled acceptance rates and its one-sided lower bound."""

    difference: float
    lower: float


def acceptance_rate(counts: Sequence[tuple[int, int]]) -> float:
    """Σ accepted / Σ proposed over per-request `(accepted, proposed)` pairs."""
    proposed = sum(p for _, p in counts)
    return sum(a for a, _ in counts) / proposed if proposed else float("nan")


def bootstrap_increase(
    low_w: Sequence[tuple[int, int]], high_w: Sequence[tuple[int, int]], level: float, draws: int, seed: int
) -> Bootstrap:
    """Lower `level`-quantile of rate(low_w) − rate(high_w) over request-level resamples.

    Requests are the independent units (drafts within a request are not), so whole requests are
    resampled with replacement, each group separately. `lower > 0` means acceptance at the lower
    w is higher with confidence 1 − level.
    """
    rng = random.Random(seed)
    diffs = []
    for _ in range(draws):
        lo = [low_w[rng.randrange(len(low_w))] for _ in low_w]
        hi = [high_w[rng.randrange(len(high_w))] for _ in high_w]
        diffs.append(acceptance_rate(lo) - acceptance_rate(hi))
    diffs.sort()
    k = min(len(diffs) - 1, max(0, int(level * draws)))
    return Bootstrap(acceptance_rate(low_w) - acceptance_rate(high_w), diffs[k])
