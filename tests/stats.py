"""Goodness-of-fit helpers for the statistical tests.

Tolerances are derived, not tuned: each check is a hypothesis test at a fixed false-alarm level
ALPHA with fixed seeds (so a run is reproducible), and the test suites also check *power* —
that the same test rejects a plausible wrong law — so a check that cannot fail is caught.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats

# Per-check false-alarm probability. With ~50 checks in the suite the chance that a correct
# implementation trips any of them on some seed is < 0.5%.
ALPHA = 1e-4


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of integer `samples` against `probs` `[K]`.

    Cells with expected count < 5 are pooled into one (the chi-square approximation needs that);
    a sample landing on a zero-probability cell fails outright.
    """
    probs = probs.double().cpu()
    probs = probs / probs.sum()
    n = samples.numel()
    counts = torch.bincount(samples.flatten().cpu(), minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= 5
    small = (expected > 0) & ~big
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if small.any():
        obs.append(float(counts[small].sum()))
        exp.append(float(expected[small].sum()))
    obs_a, exp_a = np.array(obs), np.array(exp)
    if len(obs_a) < 2:
        return 1.0 if abs(obs_a.sum() - exp_a.sum()) < 1e-9 else 0.0
    exp_a *= obs_a.sum() / exp_a.sum()
    return float(stats.chisquare(obs_a, exp_a).pvalue)


def binomial_z(successes: float, n: int, prob: float) -> float:
    """z-score of an observed success count against Binomial(n, prob)."""
    sd = math.sqrt(max(n * prob * (1 - prob), 1e-12))
    return (successes - n * prob) / sd


# |z| bound matching ALPHA two-sided.
Z_BOUND = float(stats.norm.isf(ALPHA / 2))
