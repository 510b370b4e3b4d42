"""The chain bound: how far any per-position weight policy can rise above the SD <-> draft chord.

Some tasks score a reply 1 only if every position emits what the target would: on `math` each
`a + b = c` result feeds the next line and the `####` answer copies the last one. On such a task
spending acceptance a little everywhere buys less score than spending it all on some replies, and
this module measures how much room that leaves for any policy that sets w per position.

Terms
    a_t          per position of a reference reply (teacher-forced), TV(p_t, q_t). On a critical
                 task it is also the draft's error mass there: `gain_share` checks it, the share of
                 TV that is `p_t(ref) − q_t(ref)` (math: 1.00; summary: ~0.6, not such a task). It
                 is necessary, not sufficient: code reads 1.00 too, yet SpecCascade stays far above
                 code's chord up to ~79 % acceptance, because some departures from the reference
                 are still correct programs (past that knee code does behave as a chain).
    the model    under ν_t (weight w_t) the reply goes wrong at t with probability (1 − w_t)·a_t and
                 t costs w_t·a_t expected rejections; a reply succeeds iff it goes wrong nowhere:
                 `P = Π_t (1 − (1 − w_t)·a_t)`, its cost `Σ_t w_t·a_t`. P0 = P at w ≡ 0 (all
                 draft), A = Σ_t a_t (the cost of w ≡ 1, lossless SD, where P = 1).
    chord        time-sharing between SD and the draft, request by request: at cost c ∈ [0, A],
                 `P0 + (1 − P0)·c/A`. Every method's frontier contains it (a mixture of its ends).
    oracle       the clairvoyant knapsack: knows every reply's (A_i, P0_i) before generating and
                 makes replies exact in decreasing order of `(1 − P0_i)/A_i`.

Claim 1 (one reply): every policy's (cost, P) lies on or below that reply's chord.
    P and the cost are affine in each w_t, so moving one w_t moves the point along a segment whose
    ends have w_t ∈ {0, 1}: every point is a mixture of 0/1 policies. A 0/1 policy exact on S fails
    with probability f(S'), S' the other positions, f(T) = 1 − Π_{t∈T}(1 − a_t). Adding t to T
    raises f by a_t·(1 − f(T)) ≤ a_t·f(T)/a(T) (because f(T) ≥ a(T)·(1 − f(T))), so f(T)/a(T)
    never grows with T: f(S') ≥ (1 − P0)·a(S')/A, i.e. P(S) ≤ chord(a(S)).
Claim 2 (many replies): by claim 1 the pooled score at total cost C is at most the best sum of
    per-reply chords, a fractional knapsack whose greedy solution is the oracle. So the oracle
    bounds every per-position policy, whatever it reads; a causal head knows far less than A_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from training.rollout import Forced


def success_probability(w: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`Π_t (1 − (1 − w_t)·a_t)` per reply `[B]` for weights `w`, errors `a` and `mask` `[B, T]`."""
    factor = 1.0 - (1.0 - w) * a  # [B, T]
    return torch.where(mask, factor, torch.ones_like(factor)).prod(-1)


def policy_cost(w: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Expected rejections `Σ_t w_t·a_t` per reply `[B]`."""
    return (w * a * mask).sum(-1)


def reply_slopes(a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(1 − P0_i)/A_i` per reply `[B]`: score gained per unit of acceptance spent making it exact
    (the oracle's order; 0 for a reply the draft already matches everywhere)."""
    a = torch.where(mask, a, torch.zeros_like(a))
    full = a.sum(-1)  # [B] A_i
    p0 = success_probability(torch.zeros_like(a), a, mask)  # [B]
    return torch.where(full > 0, (1.0 - p0) / full.clamp_min(1e-300), torch.zeros_like(full))


@dataclass(frozen=True)
class ChainBound:
    """Chord and oracle frontiers pooled over replies, on a shared cost grid `[K]` (cost as a
    fraction of the SD cost Σ A_i: 0 = all draft, 1 = lossless SD); scores are mean P."""

    cost: torch.Tensor  # [K] fraction of the SD cost
    chord: torch.Tensor  # [K]
    oracle: torch.Tensor  # [K]
    positions: int  # reply positions pooled (to turn cost into per-position acceptance)
    total_cost: float  # Σ_i A_i

    @property
    def room(self) -> float:
        """Mean of oracle − chord over the cost range: the most any per-position policy can gain,
        on average over the range, over time-sharing SD with the draft."""
        return float(torch.trapezoid(self.oracle - self.chord, self.cost))

    @property
    def max_room(self) -> float:
        return float((self.oracle - self.chord).max())

    def acceptance(self) -> torch.Tensor:
        """`1 − cost / positions` `[K]`: expected acceptance per reply position."""
        return 1.0 - self.cost * self.total_cost / self.positions


def chain_bound(a: torch.Tensor, mask: torch.Tensor, points: int = 201) -> ChainBound:
    """The pooled chord and oracle of replies with per-position errors `a` `[B, T]`."""
    a = torch.where(mask, a.double().clamp(0.0, 1.0), torch.zeros((), dtype=torch.float64))
    full = a.sum(-1)  # [B] A_i
    p0 = success_probability(torch.zeros_like(a), a, mask)  # [B]
    total = float(full.sum())
    b = a.shape[0]
    grid = torch.linspace(0.0, 1.0, points, dtype=torch.float64)  # [K]
    if total <= 0.0:  # draft and target agree everywhere: nothing to buy
        flat = torch.full_like(grid, float(p0.mean()))
        return ChainBound(grid, flat, flat, int(mask.sum()), 0.0)
    chord = (p0.sum() + (1.0 - p0).sum() * grid) / b
    order = reply_slopes(a, mask).argsort(descending=True)
    knots_cost = torch.cat([torch.zeros(1, dtype=torch.float64), full[order].cumsum(0)]) / total  # [B+1]
    knots_score = (
        p0.sum() + torch.cat([torch.zeros(1, dtype=torch.float64), (1.0 - p0)[order].cumsum(0)])
    ) / b
    # a zero-cost reply repeats a knot with the same score (A_i = 0 means P0_i = 1), so ties are benign
    oracle = torch.from_numpy(np.interp(grid.numpy(), knots_cost.numpy(), knots_score.numpy()))
    return ChainBound(grid, chord, oracle, int(mask.sum()), total)


def gain_share(forced: Forced) -> float:
    """Share of TV that is the target's advantage on the reference token, `Σ (p(ref) − q(ref))⁺ /
    Σ TV`: 1 when every unit of TV is the draft missing the reference (the model above applies)."""
    gain = (forced.p_tok - forced.q_tok).clamp_min(0.0) * forced.mask
    return float(gain.sum() / (forced.tv * forced.mask).sum().clamp_min(1e-12))
