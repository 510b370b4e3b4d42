"""Goodput-optimal draft length per row and round, down to none (n = 0).

Terms
    β         a row's per-position acceptance probability (taken constant along the chain).
    TV̂        the pair's measured disagreement: a running mean of one-draw estimates
              `1 − min(1, p(x)/q(x))` (x ~ q; `verifier.theory.tv_estimates`) over the drafted
              positions of every sampling row (`PairAgreement`), starting from an optimistic prior
              so that a fresh engine tries drafting where it could pay.
    prior β   1 − w̄·TV̂, with w̄ the row's weight (its running mean w_t for learned rows);
              rows of other policies use 1 − TV̂.
    estimate  the row's own evidence (`AcceptanceEstimate`): the posterior mean
              (S·prior + Σ a_t)/(S + #t) over its tested positions t (drafts up to and including
              the first rejection), a_t the verifier's acceptance probability there (the
              conditional mean of the 0/1 outcome: same expectation, less noise), S = PRIOR_STRENGTH.
    E(β, n)   expected tokens a round emits: 1 + β + … + β^n.
    needs_q   the row draws its bonus (and, at n = 0, its only token) from ν = w·p + (1−w)·q,
              which needs the draft's q after the last proposal: one more draft step when all n
              drafts are accepted (probability β^n), always at n = 0. Rows with w = 1 (ν = p)
              and baseline policies do not.
    lag       tokens the draft cache is behind (rows that decoded without drafts); drafting
              again first feeds them to the draft, a cost charged to that choice.
    goodput   a step's expected tokens per second, Σ_rows E(β_r, n_r) / Σ_groups round(R_g, n_g),
              one round per distinct n (the scheduler groups rows by n; `cost_model.round_time`).

`choose` is the pure policy; `DraftPlanner` feeds it from rows and the engine's cost model.
Choosing n never changes what is sampled: whatever n a round has, it emits tokens distributed
exactly as ν, and n is fixed from the past alone, so this is purely a speed decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verifier.dial import PolicyKind
from verifier.theory import expected_accepted_length_constant

PRIOR_STRENGTH = 8.0  # the prior β counts as this many observed positions
MARGIN = 0.03  # drafting must beat no drafting by this much (predictions err; n = 0 is the safe side)
CATCHUP_HORIZON = 4.0  # rounds over which a lagging draft's catch-up is charged

RoundTime = Callable[[int, int, float], float]  # (rows, n, expected bonus steps) -> seconds


def expected_tokens(beta: float, n: int) -> float:
    """E(β, n) = 1 + β + … + β^n: the accepted drafts plus the one correction or bonus token."""
    return 1.0 + expected_accepted_length_constant(min(max(beta, 0.0), 1.0), n)


@dataclass(frozen=True)
class RowChoice:
    """What the policy needs to know about one row."""

    beta: float  # acceptance estimate
    needs_q: bool = False  # bonus from ν with w < 1 (see the module doc)
    fixed: int | None = None  # a per-request num_draft (or 0 for autoregressive rows): not adapted
    lag: int = 0  # draft-cache lag in tokens


@dataclass
class AcceptanceEstimate:
    """A row's own acceptance evidence (see `estimate` in the module doc)."""

    accept_sum: float = 0.0
    tested: int = 0

    def observe(self, accept_probs: Sequence[float]) -> None:
        self.accept_sum += float(sum(accept_probs))
        self.tested += len(accept_probs)

    def beta(self, prior: float) -> float:
        return (PRIOR_STRENGTH * prior + self.accept_sum) / (PRIOR_STRENGTH + self.tested)


@dataclass
class PairAgreement:
    """TV̂ over recent drafted positions (decayed past `window`, so it follows the workload)."""

    prior_tv: float = 0.3
    prior_weight: float = 16.0
    window: float = 4096.0
    total: float = 0.0
    count: float = 0.0

    def observe(self, samples: Sequence[float]) -> None:
        self.total += float(sum(samples))
        self.count += len(samples)
        if self.count > self.window:
            scale = self.window / self.count
            self.total, self.count = self.total * scale, self.window

    @property
    def tv(self) -> float:
        return (self.prior_tv * self.prior_weight + self.total) / (self.prior_weight + self.count)


def goodput(rows: Sequence[RowChoice], ns: Sequence[int], round_time: RoundTime, draft_step: float = 0.0):
    """Expected tokens per second of one step with draft lengths `ns` (see the module doc).

    `draft_step` is one draft step's seconds at batch 1, the unit of a lagging row's catch-up."""
    groups: dict[int, list[RowChoice]] = {}
    for row, n in zip(rows, ns, strict=True):
        groups.setdefault(n, []).append(row)
    seconds = 0.0
    for n, group in groups.items():
        bonus = _bonus_steps(group, n)
        seconds += round_time(len(group), n, bonus)
        if n:
            seconds += sum(r.lag for r in group if r.lag > 2) * draft_step / CATCHUP_HORIZON
    tokens = sum(expected_tokens(r.beta, n) for r, n in zip(rows, ns, strict=True))
    return tokens / seconds if seconds > 0 else math.inf


def _bonus_steps(group: Sequence[RowChoice], n: int) -> float:
    """Expected bonus draft steps of a round: P(some row that needs q accepts all n drafts)."""
    needy = [r.beta for r in group if r.needs_q]
    if not needy:
        return 0.0
    if n == 0:
        return 1.0
    none = 1.0
    for beta in needy:
        none *= 1.0 - min(max(beta, 0.0), 1.0) ** n
    return 1.0 - none


def choose(
    rows: Sequence[RowChoice],
    round_time: RoundTime,
    max_n: int,
    margin: float = MARGIN,
    draft_step: float = 0.0,
) -> list[int]:
    """Draft lengths for `rows` maximising the step's goodput; fixed rows keep theirs.

    A common n for all adapted rows first (drafting only if it beats n = 0 by `margin`), then
    single-row moves while any improves goodput; the result falls back to n = 0 for all adapted
    rows unless it beats that by `margin`."""
    adaptive = [i for i, r in enumerate(rows) if r.fixed is None]
    base = [0 if r.fixed is None else r.fixed for r in rows]
    if not adaptive:
        return base

    def score(ns):
        return goodput(rows, ns, round_time, draft_step)

    floor = score(base)
    best, best_score = base, floor
    for n in range(1, max_n + 1):
        ns = [n if r.fixed is None else r.fixed for r in rows]
        s = score(ns)
        if s > best_score:
            best, best_score = ns, s
    if best_score < floor * (1 + margin):
        best, best_score = base, floor
    for _ in range(2):  # single-row moves; two passes settle a batch of mixed tiers
        moved = False
        for i in adaptive:
            for n in range(max_n + 1):
                if n == best[i]:
                    continue
                trial = list(best)
                trial[i] = n
                s = score(trial)
                if s > best_score * (1 + 1e-9):
                    best, best_score, moved = trial, s, True
        if not moved:
            break
    return best if best_score >= floor * (1 + margin) else base


class DraftPlanner:
    """The engine's side of the policy: sets `row.num_draft` for adaptive rows each step, learns
    from each round (acceptance, TV̂, stage times into the cost model) and predicts round times.

    Rows are read duck-typed: `adaptive`, `num_draft`, `needs_q`, `estimate`, `prior_weight`,
    `policy.kind`, `draft_lag`. Plans are cached per (rounded β, needs_q, fixed, lag) signature
    and cost-model epoch, so steady batches do not re-run the search every step. `profile` is the
    start-up cost model, kept unchanged to report how well it alone predicts rounds."""

    def __init__(self, cost, max_n: int, margin: float = MARGIN):
        self.cost = cost
        self.profile = cost.copy()
        self.max_n = max_n
        self.margin = margin
        self.agreement = PairAgreement()
        self._plans: dict[tuple, list[int]] = {}

    def row_choice(self, row) -> RowChoice:
        w = row.prior_weight if row.policy.kind == PolicyKind.ENSEMBLE else 1.0
        prior = 1.0 - w * self.agreement.tv
        fixed = None if row.adaptive else row.num_draft
        return RowChoice(row.estimate.beta(prior), row.needs_q, fixed, row.draft_lag)

    def assign(self, rows: Sequence) -> None:
        if not any(row.adaptive for row in rows):
            return
        choices = [self.row_choice(row) for row in rows]
        key = (
            tuple((c.fixed, c.needs_q, round(c.beta * 40), min(c.lag, 3)) for c in choices),
            self.cost.updates // 64,
        )
        plan = self._plans.get(key)
        if plan is None:
            step = self.cost.time("draft", 1, 1)
            plan = choose(choices, self.cost.round_time, self.max_n, self.margin, step)
            if len(self._plans) > 512:
                self._plans.clear()
            self._plans[key] = plan
        for row, n in zip(rows, plan, strict=True):
            if row.adaptive:
                row.num_draft = n

    def predict(self, rows: Sequence, n: int) -> tuple[float, float]:
        """(live model, start-up profile) predictions of one round of `rows` at draft length n."""
        bonus = _bonus_steps([self.row_choice(row) for row in rows], n)
        return self.cost.round_time(len(rows), n, bonus), self.profile.round_time(len(rows), n, bonus)

    def learn(self, batch, out, seconds: dict) -> None:
        """After a round: the rows' acceptance, the pair's TV̂, and the stage times."""
        for row, accept, tv in zip(batch.rows, out.accept_probs, out.tv, strict=True):
            row.estimate.observe(accept)
            self.agreement.observe(tv)
        r, n, cost = batch.size, batch.n, self.cost
        forward = seconds.get("verify_forward" if n else "target_forward", 0.0)
        if n and not batch.caught_up:
            cost.observe("draft", r, 1, seconds["draft"] / n)
        if out.bonus_rows:
            cost.observe("draft", len(out.bonus_rows), 1, seconds["bonus"])
        cost.observe("score", r, n + 1, forward)
        cost.observe("check", r, n, seconds["verify_call"])
        staged = sum(v for k, v in seconds.items() if k != "round")
        cost.observe("other", r, 0, max(seconds["round"] - staged, 0.0))
