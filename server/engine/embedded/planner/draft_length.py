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
    E(β, n)   expected tokens a round emits: 1 + β + … + β^n (n capped at the tokens the request
              has left − 1: drafts past its end are never emitted).
    draws_nu  the row draws the tokens no draft proposed (the bonus, and at n = 0 its only token)
              from ν = w·p + (1−w)·q (`RowMode.draws_nu`: strict rows with w < 1), which needs the
              draft's q after the last proposal: one more draft step when all n drafts are
              accepted (probability β^n), always at n = 0. Every other row draws them from p:
              w = 1 rows (ν = p), baseline policies, and adaptive w < 1 rows unless the engine
              runs `--strict-nu` (ν there costs a draft step and buys no token, and p is the
              higher-quality law). Such a row costs what a w = 1 row costs at any n, so at the
              same acceptance a lower quality is never slower, and no tier is slower than plain
              decoding; the planner charges the bonus step to exactly the rows that take it.
    lag       tokens the draft cache is behind: rows at w = 1 feed their prompt to the draft only
              when they first draft, and fall behind while they decode without drafts. Drafting
              (or a bonus step) first feeds the lag to the draft: `catchup`, the cost of one draft
              forward over `lag` tokens (cost kind `catch_up`) spread over the rounds the request
              has left, is charged to the choices that need it; `predict` adds the whole forward
              to the round that runs it.
    goodput   a step's expected tokens per second, Σ_rows E(β_r, n_r) / (Σ_groups round(R_g, n_g)
              + step(R)), one round per distinct n (the scheduler groups rows by n;
              `cost_model.round_time`); step(R) is the scheduler's time outside rounds, paid once a
              step whatever n (cost kind `step`): leaving it out made plain decoding look
              cheaper than it is, by ~12 % on the embedded pair.
    calibrated  the β a plan uses: the estimate times the measured ratio of accepted drafts to
              planned acceptance over earlier drafting rounds of rows of the same policy and
              weight (`AcceptanceCalibration`): estimates the planner drafts on are those that
              read high, by chance as often as not.
    explore   a row's estimate learns only from rounds that draft. After one bad first round its β
              can sit just under the drafting threshold with no later round to correct it: a lone
              request then decoded plainly to its end ("2000000000000002212", N per round, on the
              embedded pair where drafting runs 1.35x). So an adaptive row planned at n = 0 for
              `EXPLORE_AFTER` rounds in a row drafts for one round if that round is predicted to
              lose at most `EXPLORE_LOSS` of the step's goodput (a lagging draft's catch-up counted
              whole): at most 10 % of one round in 9 where drafting is a near miss, never where it
              is far off (tests/test_draft_length.py's compute-bound pair, where drafting loses a
              quarter or more at any β < 0.8, never explores).

`choose` is the pure policy; `draft_planner.DraftPlanner` feeds it from rows and the engine's cost
model.
Choosing n never changes what is sampled: whatever n a round has, it emits tokens distributed
exactly as ν, and n is fixed from the past alone, so this is purely a speed decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from verifier.theory import expected_accepted_length_constant

PRIOR_STRENGTH = 8.0  # the prior β counts as this many observed positions
EXPLORE_AFTER = 8  # plain rounds without evidence before a row's drafting is tried once more
EXPLORE_LOSS = 0.1  # ... if that round is predicted to lose at most this share of the goodput
MARGIN = 0.03  # drafting must beat no drafting by this much (predictions err; n = 0 is the safe side)
# Plans are cached per batch signature, so the signature is coarse: β on a 0.05 grid (E(β, n)
# moves < 3 % per step of it at β <= 0.9, below the noise of the costs), catch-up on a 19 % log grid.
BETA_STEP = 0.05
CATCHUP_STEPS_PER_DOUBLING = 4

RoundTime = Callable[[int, int, float], float]  # (rows, n, expected bonus steps) -> seconds


def beta_grid(beta: float) -> float:
    return round(round(beta / BETA_STEP) * BETA_STEP, 4)


def log_grid(seconds: float) -> float:
    if seconds <= 0:
        return 0.0
    k = CATCHUP_STEPS_PER_DOUBLING
    return float(f"{2.0 ** (round(k * math.log2(seconds)) / k):.4g}")


def catch_up_size(lags: Sequence[int]) -> int:
    """M, the tokens of the catch-up forward a drafting round runs for rows whose draft is `lag` > 2
    tokens behind: one right-padded forward over all but each row's last pending token
    (`round._feed_pending`), so M = (rows behind) × (longest lag − 1); 0 if none is."""
    behind = [lag for lag in lags if lag > 2]
    return len(behind) * (max(behind) - 1) if behind else 0


def catch_up_bucket(m: int) -> int:
    """The M a catch-up of m tokens is learned at: m on a half-octave grid (.., 23, 32, 45, 64, ..).
    Exact M rarely repeats (prompt lengths vary), so without a grid one slow early catch-up would
    stay an entry of its own for good, and the fit over M (non-decreasing) would lift every larger
    M to it; on the grid later catch-ups average it away. M is off by at most 19 %."""
    return max(1, round(2.0 ** (round(2 * math.log2(max(m, 1))) / 2)))


def expected_tokens(beta: float, n: int) -> float:
    """E(β, n) = 1 + β + … + β^n: the accepted drafts plus the one correction or bonus token."""
    return 1.0 + expected_accepted_length_constant(min(max(beta, 0.0), 1.0), n)


class RowChoice(NamedTuple):
    """What the policy needs to know about one row (a tuple: the planner builds one per row and
    step and keys its plan cache on them, and a frozen dataclass cost ~3x as much to build)."""

    beta: float  # acceptance estimate
    draws_nu: bool = False  # the bonus (at n = 0 the token) from ν: a draft step (see the module doc)
    fixed: int | None = None  # a per-request num_draft (or 0 for autoregressive rows): not adapted
    catchup: float = 0.0  # seconds per round charged when the draft runs for this row (see lag)
    cap: int | None = None  # drafts past this many cannot be emitted (tokens left − 1): no gain


@dataclass
class AcceptanceEstimate:
    """A row's own acceptance evidence (see `estimate` in the module doc), and the rounds it has
    been planned without drafts since it last drafted or explored (see `explore`)."""

    accept_sum: float = 0.0
    tested: int = 0
    plain_rounds: int = 0

    def observe(self, accept_probs: Sequence[float]) -> None:
        self.accept_sum += float(sum(accept_probs))
        self.tested += len(accept_probs)

    def beta(self, prior: float) -> float:
        return (PRIOR_STRENGTH * prior + self.accept_sum) / (PRIOR_STRENGTH + self.tested)


@dataclass
class AcceptanceCalibration:
    """Realised over planned acceptance, per kind of row (policy, weight): the factor `choose`'s
    β is scaled by (see `calibrated` in the module doc).

    The planner drafts for a row when its estimate reads high, and an estimate that reads high is,
    on average, high by chance (the winner's curse): on the embedded pair at w = 1 and c = 8,
    rows drafted at estimates of 0.85-0.95 and accepted at 0.80 per position, and the tier ran at
    0.79x plain decoding. Each drafting row's tested positions (drafts up to and including the
    first rejection) count: accepted drafts against tested × the β it was planned with. The
    ratio starts at 1 with `prior` positions' weight and decays past `window` positions."""

    prior: float = 32.0
    window: float = 2048.0
    sums: dict = field(default_factory=dict)  # key -> [accepted, planned]

    def observe(self, key, accepted: int, tested: int, beta: float) -> None:
        s = self.sums.setdefault(key, [0.0, 0.0])
        s[0] += accepted
        s[1] += tested * beta
        if s[1] > self.window:
            scale = self.window / s[1]
            s[0], s[1] = s[0] * scale, self.window

    def factor(self, key) -> float:
        accepted, planned = self.sums.get(key, (0.0, 0.0))
        return min(max((accepted + self.prior) / (planned + self.prior), 0.5), 1.5)


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


def goodput(
    rows: Sequence[RowChoice], ns: Sequence[int], round_time: RoundTime, step: float = 0.0, extra: float = 0.0
) -> float:
    """Expected tokens per second of one step with draft lengths `ns` (see the module doc);
    `extra` seconds are added to the step's."""
    groups: dict[int, list[RowChoice]] = {}
    for row, n in zip(rows, ns, strict=True):
        groups.setdefault(n, []).append(row)
    seconds = step + extra
    for n, group in groups.items():
        seconds += round_time(len(group), n, bonus_steps([r.beta for r in group if r.draws_nu], n))
        seconds += sum(r.catchup for r in group if n or r.draws_nu)
    tokens = sum(expected_tokens(r.beta, _useful(r, n)) for r, n in zip(rows, ns, strict=True))
    return tokens / seconds if seconds > 0 else math.inf


def _useful(row: RowChoice, n: int) -> int:
    return n if row.cap is None else min(n, row.cap)


def bonus_steps(needy_betas: Sequence[float], n: int) -> float:
    """Expected bonus draft steps of a round: P(some row that draws from ν accepts all n drafts)."""
    if not needy_betas:
        return 0.0
    if n == 0:
        return 1.0
    none = 1.0
    for beta in needy_betas:
        none *= 1.0 - min(max(beta, 0.0), 1.0) ** n
    return 1.0 - none


class _Search:
    """Goodput of assignments over classes of identical rows (a batch of one tier is one class),
    with E(β, n) and each class's factor of P(no bonus step) precomputed: the search evaluates
    many assignments per step, each in one pass over the classes."""

    def __init__(self, rows: Sequence[RowChoice], round_time: RoundTime, max_n: int, step: float = 0.0):
        counts: dict[RowChoice, int] = {}
        self.row_class = []
        for row in rows:
            if row not in counts:
                counts[row] = 0
            counts[row] += 1
        index = {row: c for c, row in enumerate(counts)}
        self.row_class = [index[row] for row in rows]
        self.classes: list[tuple[RowChoice, int]] = list(counts.items())
        self.round_time, self.step = round_time, step
        ns = range(max_n + 1)
        self.tokens = [[k * expected_tokens(r.beta, _useful(r, n)) for n in ns] for r, k in self.classes]
        # P(none of the class's k rows accepts all n drafts) = (1 − β^n)^k; n = 0 always steps.
        self.no_bonus = [
            [(1.0 - min(max(r.beta, 0.0), 1.0) ** n) ** k if n else 0.0 for n in ns] for r, k in self.classes
        ]

    def _parts(self, ns: Sequence[int], skip: int = -1) -> tuple[float, float]:
        """(expected tokens, seconds) of a step with one n per class, class `skip` left out."""
        groups: dict[int, list] = {}  # n -> [rows, P(no bonus step), any row draws ν, catch-up s]
        tokens = 0.0
        for c, n in enumerate(ns):
            if c == skip:
                continue
            row, k = self.classes[c]
            tokens += self.tokens[c][n]
            g = groups.get(n)
            if g is None:
                g = groups[n] = [0, 1.0, False, 0.0]
            g[0] += k
            needy = row.draws_nu
            if needy:
                g[1] *= self.no_bonus[c][n]
                g[2] = True
            if n or needy:
                g[3] += k * row.catchup
        seconds = self.step
        for n, (size, none, needy, catchup) in groups.items():
            seconds += self.round_time(size, n, 1.0 - none if needy else 0.0) + catchup
        return tokens, seconds

    def goodput(self, ns: Sequence[int]) -> float:
        """ns: one n per class."""
        tokens, seconds = self._parts(ns)
        return tokens / seconds if seconds > 0 else math.inf

    def best_alone(self, ns: Sequence[int], c: int) -> int | None:
        """The best n for class c among those no other class uses (a round of its own), the rest
        as in `ns`: one pass over the rest, then one round time per n (a full scan of goodput
        over n re-reads every class for each)."""
        tokens, seconds = self._parts(ns, skip=c)
        row, k = self.classes[c]
        used = {n for d, n in enumerate(ns) if d != c}
        best, best_score = None, -math.inf
        for n in range(len(self.tokens[c])):
            if n in used:
                continue
            needy = row.draws_nu
            s = seconds + self.round_time(k, n, 1.0 - self.no_bonus[c][n] if needy else 0.0)
            s += k * row.catchup if n or needy else 0.0
            score = (tokens + self.tokens[c][n]) / s if s > 0 else math.inf
            if score > best_score:
                best, best_score = n, score
        return best


def choose(
    rows: Sequence[RowChoice],
    round_time: RoundTime,
    max_n: int,
    margin: float = MARGIN,
    step: float = 0.0,
) -> list[int]:
    """Draft lengths for `rows` maximising the step's goodput; fixed rows keep theirs.

    Identical rows move together. A common n for all adapted rows first (drafting only if it
    beats n = 0 by `margin`), then single-class moves while any improves goodput; the result
    falls back to n = 0 for all adapted rows unless it beats that by `margin`."""
    search = _Search(rows, round_time, max_n, step)
    fixed = [row.fixed for row, _ in search.classes]
    adaptive = [c for c, f in enumerate(fixed) if f is None]
    base = [0 if f is None else f for f in fixed]
    if adaptive:
        floor = search.goodput(base)
        best, best_score = base, floor
        for n in range(1, max_n + 1):
            ns = [n if f is None else f for f in fixed]
            score = search.goodput(ns)
            if score > best_score:
                best, best_score = ns, score
        if best_score < floor * (1 + margin):
            best, best_score = base, floor
        # Single-class moves; two passes settle a batch of mixed tiers. With one class to adapt
        # the common scan above was exhaustive (a third of the search's cost at one row).
        for _ in range(2 if len(adaptive) > 1 else 0):
            moved = False
            for c in adaptive:
                # The class's best n is either one another class uses (it joins that round) or
                # its best in a round of its own: trying those is a full scan's result at a
                # fraction of its cost (the planner's time at c = 8 was 6 % of the embedded
                # pair's rounds on a fast host, most of it here).
                alone = search.best_alone(best, c)
                for n in sorted({*best, *([] if alone is None else [alone])}):
                    if n == best[c]:
                        continue
                    trial = list(best)
                    trial[c] = n
                    score = search.goodput(trial)
                    if score > best_score * (1 + 1e-9):
                        best, best_score, moved = trial, score, True
            if not moved:
                break
        base = best if best_score >= floor * (1 + margin) else base
    return [base[c] for c in search.row_class]


def explore(
    rows: Sequence[RowChoice],
    plan: Sequence[int],
    due: Sequence[bool],
    round_time: RoundTime,
    max_n: int,
    step: float = 0.0,
    catch_up: float = 0.0,
    max_loss: float = EXPLORE_LOSS,
) -> list[int] | None:
    """The plan with the rows `due` (adaptive, planned at n = 0, `EXPLORE_AFTER` rounds without
    evidence) drafting at their best common n, if its goodput, with `catch_up` seconds (the whole
    forward their lagging draft needs first) added, is within `max_loss` of `plan`'s; else None."""
    floor = goodput(rows, plan, round_time, step)
    best, best_score = None, 0.0
    for n in range(1, max_n + 1):
        trial = [n if d else k for d, k in zip(due, plan, strict=True)]
        score = goodput(rows, trial, round_time, step, catch_up)
        if score > best_score:
            best, best_score = trial, score
    return best if best is not None and best_score >= (1 - max_loss) * floor else None
