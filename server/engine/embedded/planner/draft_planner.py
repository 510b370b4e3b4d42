"""The draft length N of each row and round (0 included): the most expected tokens per second.

Terms (β and its estimates: `acceptance.py`; round times: `cost_model.py`)
    E(β, n)   tokens a round emits in expectation: 1 + β + … + β^n, n capped at the tokens the
              request has left − 1 (drafts past its end are never emitted).
    draws_nu  the row draws the tokens no draft proposed (the bonus, and at n = 0 its only token)
              from ν (`RowMode.draws_nu`: strict rows with w < 1). That needs q after the last
              proposal: one more draft step when all n drafts are accepted (probability β^n),
              always at n = 0. Every other row draws them from p at no cost: w = 1 rows (ν = p),
              baselines, and adaptive w < 1 rows unless the engine runs `--strict-nu` (p is the
              higher-quality law). So at the same acceptance an adaptive lower quality costs what
              a higher one costs, and it accepts more (prior 1 − w·TV̂): by construction a lower
              quality is never slower, and no tier is slower than plain decoding (n = 0 is
              always a choice). The bonus step is priced for exactly the rows that take it.
    catch-up  a row whose draft is `lag` > 2 tokens behind (w = 1 rows feed the draft only when
              they draft) first feeds them in one draft forward: its cost, spread over the rounds
              the request has left, is charged to the choices that run the draft.
    goodput   Σ_rows E(β_r, n_r) / (step(R) + Σ_groups [round(R_g, n_g, bonus_g) + catch-ups]):
              one round per distinct n (the scheduler groups rows by n), and the scheduler's
              time outside rounds once a step (rounds that emit more spread it thinner).
    choose    argmax of goodput over one n per class of identical rows: the best common n, then
              the best move of one class at a time while one gains (moving one tier to its own
              round can pay only once another has left the shared one); drafting only if that
              beats n = 0 by `MARGIN` (predictions err, and n = 0 is the safe side).
    explore   a row learns acceptance only from rounds that draft. One planned at n = 0 for
              `EXPLORE_EVERY` rounds drafts for one round (at the next full plan, so after 8 to
              16 plain rounds) if that is predicted to lose at most
              `EXPLORE_LOSS` of the step's goodput (its catch-up counted whole): at most ~1 % of
              the tokens where drafting is a near miss, never where it is far off. It also
              re-times the draft where the profile overprices it.
    hold      a plan stands for `REPLAN_EVERY` steps; rows that join meanwhile, rows that just
              explored, and rows drafting past their end are planned with the others' N fixed,
              at one of their N or 0 (they join a round, never open one).
              Acceptance and costs move over many rounds, while a full search at 8 rows of
              several classes costs ~0.4 ms, a sixth of the embedded pair's step.

Reproducible rows (`RowMode.reproducible`: seeded or greedy). A row's tokens are a function of its
prompt, its own random stream and its sequence of N. The live plan reads measured costs (the
host's load), the batch, the pools; so a reproducible row is planned alone, at its kind's N: the
one that gains most over plain decoding both alone and in a full batch, at the kind's constant
prior (`acceptance.py`) on the frozen start-up profile (`_plan_alone`: a plan that cannot see its
batch must not cost it). Its N sequence, and with it its output, is the same in any batch under
any load.

Why not randomness keyed by position instead: docs/algorithm.md ("Choosing N").
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from server.engine.embedded.planner.acceptance import AcceptanceEstimate, AcceptancePool
from server.engine.embedded.planner.cost_model import CostModel, Stage
from verifier import Policy
from verifier.theory import expected_accepted_length_constant

MARGIN = 0.03
EXPLORE_EVERY = 8
EXPLORE_LOSS = 0.1
REPLAN_EVERY = 8
BETA_STEP = 0.05  # β on a grid, so that the rows of a tier form one class for the search

RoundTime = Callable[[int, int, float], float]  # (rows, n, expected bonus steps) -> seconds


class PlannedMode(Protocol):
    adaptive: bool
    draft_only: bool
    draws_nu: bool
    reproducible: bool


class PlannedRow(Protocol):
    """What the planner reads of a `row.Row` (it sits below rows), and `num_draft`, which it sets."""

    num_draft: int
    mode: PlannedMode
    estimate: AcceptanceEstimate
    policy: Policy
    prior_weight: float
    draft_lag: int
    tokens_left: int


class RowChoice(NamedTuple):
    beta: float
    draws_nu: bool = False  # the bonus (at n = 0 the token) from ν: a draft step
    fixed: int | None = None  # an N the search does not choose (per request, or planned alone)
    catchup: float = 0.0  # seconds per round charged when the draft runs for this row
    cap: int | None = None  # drafts past this many cannot be emitted (tokens left − 1)


def expected_tokens(beta: float, n: int) -> float:
    """E(β, n): the accepted drafts plus the one correction or bonus token."""
    return 1.0 + expected_accepted_length_constant(min(max(beta, 0.0), 1.0), n)


def bonus_steps(needy_betas: Sequence[float], n: int) -> float:
    """Expected bonus draft steps of a round: P(some row that draws from ν accepts all n)."""
    none = math.prod(1.0 - min(max(b, 0.0), 1.0) ** n for b in needy_betas)
    return 1.0 - none if needy_betas else 0.0


def catch_up_size(lags: Sequence[int]) -> int:
    """M of the catch-up forward a drafting round runs for rows `lag` > 2 behind: one padded
    forward over all but each row's last pending token (`round._feed_pending`)."""
    behind = [lag for lag in lags if lag > 2]
    return len(behind) * (max(behind) - 1) if behind else 0


def _scorer(classes: Sequence[tuple[RowChoice, int]], round_time: RoundTime, step: float):
    """goodput(ns), one n per class of `classes` [(choice, rows)] (module doc). A class's terms at
    an n (its tokens, P(none of its rows takes a bonus step), its catch-ups) are tabled on first
    use: a search scores up to hundreds of plans."""
    terms: dict[tuple[int, int], tuple[float, float, float]] = {}

    def term(c: int, n: int) -> tuple[float, float, float]:
        if (c, n) not in terms:
            row, k = classes[c]
            beta = min(max(row.beta, 0.0), 1.0)
            tokens = k * expected_tokens(beta, n if row.cap is None else min(n, row.cap))
            no_bonus = (1.0 - beta**n) ** k if row.draws_nu else 1.0
            terms[c, n] = (tokens, no_bonus, k * row.catchup if n or row.draws_nu else 0.0)
        return terms[c, n]

    def score(ns: Sequence[int]) -> float:
        groups: dict[int, list] = {}  # n -> [rows, P(no bonus step), any row draws ν, catch-up s]
        tokens = 0.0
        for c, n in enumerate(ns):
            t, no_bonus, catchup = term(c, n)
            tokens += t
            g = groups.setdefault(n, [0, 1.0, False, 0.0])
            g[0] += classes[c][1]
            g[1] *= no_bonus
            g[2] = g[2] or classes[c][0].draws_nu
            g[3] += catchup
        seconds = step + sum(
            round_time(size, n, 1.0 - none if needy else 0.0) + catchup
            for n, (size, none, needy, catchup) in groups.items()
        )
        return tokens / seconds if seconds > 0 else math.inf

    return score


def goodput(rows: Sequence[RowChoice], ns, round_time: RoundTime, step: float = 0.0, extra: float = 0.0):
    """Expected tokens per second of one step with draft lengths `ns`; `extra` seconds added."""
    return _scorer([(r, 1) for r in rows], round_time, step + extra)(ns)


def choose(
    rows: Sequence[RowChoice], round_time: RoundTime, max_n: int, step=0.0, margin=MARGIN, options=None
) -> list[int]:
    """Draft lengths for `rows` maximising the step's goodput (module doc); fixed rows keep theirs.
    `options`: the draft lengths allowed (default 0..max_n)."""
    options = range(max_n + 1) if options is None else options
    classes = list(Counter(rows).items())
    fixed = [row.fixed for row, _ in classes]
    base = [0 if f is None else f for f in fixed]
    free = [c for c, f in enumerate(fixed) if f is None]
    score = _scorer(classes, round_time, step)
    floor = score(base)
    best, best_score = base, floor
    for n in options:
        ns = [n if f is None else f for f in fixed]
        if (s := score(ns)) > best_score:
            best, best_score = ns, s
    for _ in range(2 * len(free) if len(free) > 1 else 0):  # steepest ascent over one-class moves
        moves = [[*best[:c], n, *best[c + 1 :]] for c in free for n in options if n != best[c]]
        s, top = max(((score(ns), ns) for ns in moves), default=(0.0, best))
        if s <= best_score * (1 + 1e-9):
            break
        best, best_score = top, s
    plan = best if best_score >= floor * (1 + margin) else base
    by_class = {row: n for (row, _), n in zip(classes, plan, strict=True)}
    return [by_class[row] for row in rows]


def explore(rows, plan, due, round_time, max_n: int, step=0.0, catch_up=0.0, max_loss=EXPLORE_LOSS):
    """`plan` with the rows `due` drafting at their best common n, if its goodput with `catch_up`
    seconds added is within `max_loss` of `plan`'s; else None."""
    classes = [(row, 1) for row in rows]
    floor, trial = _scorer(classes, round_time, step)(plan), _scorer(classes, round_time, step + catch_up)
    trials = [[n if d else k for d, k in zip(due, plan, strict=True)] for n in range(1, max_n + 1)]
    score, best = max(((trial(t), t) for t in trials), key=lambda st: st[0])
    return best if score >= (1 - max_loss) * floor else None


class _RoundTimes:
    """A cost model's round times, read once per (rows, model) for one plan."""

    def __init__(self, cost: CostModel, max_n: int):
        self.cost, self.max_n, self.lines = cost, max_n, {}

    def __call__(self, r: int, n: int, bonus: float = 0.0) -> float:
        if r not in self.lines:
            self.lines[r] = (self.cost.round_times(r, self.max_n), self.cost.time(Stage.DRAFT, r))
        times, draft = self.lines[r]
        return (times[n] if n <= self.max_n else self.cost.round_time(r, n)) + bonus * draft


def _grid(beta: float) -> float:
    return round(round(beta / BETA_STEP) * BETA_STEP, 4)


def _free(row: PlannedRow) -> bool:
    """An adaptive row the batch's search plans (reproducible rows are planned alone)."""
    return row.mode.adaptive and not row.mode.reproducible


def _counted(row: PlannedRow, n: int, due: bool = False) -> None:
    """Set N; an exploration's next look is `EXPLORE_EVERY` plain rounds away, tried or not."""
    row.num_draft = n
    row.estimate.plain_rounds = 0 if n or due else row.estimate.plain_rounds + 1


class DraftPlanner:
    """Sets `row.num_draft` for adaptive rows each step, learns from each round (acceptance into
    the pools, stage times into the cost model) and predicts round times. `profile` is the frozen
    start-up shape: reproducible rows are planned on it, and the bench reports how well it alone
    predicts rounds. `force` pins every adaptive row to one N (benchmarks sweep N with it)."""

    def __init__(self, cost: CostModel, max_n: int, margin: float = MARGIN, alone_batch: int = 1):
        self.max_n, self.margin, self.alone_batch = max_n, margin, alone_batch
        self.force: int | None = None
        self.acceptance = AcceptancePool()
        self.set_cost(cost)

    def set_cost(self, cost: CostModel) -> None:
        """Plan from this cost model (tests pin one); its shape is the start-up profile too."""
        self.cost, self.profile = cost, cost.frozen()
        self._alone: dict[RowChoice, int] = {}
        # the free rows planned, steps the plan stands, the rows that explore this step
        self._held: tuple[frozenset, int, frozenset] = (frozenset(), 0, frozenset())

    def row_choice(self, row: PlannedRow) -> RowChoice:
        """What `choose` reads of a row; a reproducible row's N is fixed (`_plan_alone`)."""
        reproducible = row.mode.reproducible
        beta = self.acceptance.beta(row, alone=reproducible)
        catchup = 0.0
        if row.draft_lag > 2:  # a forward over the lag, spread over the rounds left (on a log grid)
            model = self.profile if reproducible else self.cost
            rounds_left = max(1.0, row.tokens_left / expected_tokens(beta, max(self.max_n // 2, 1)))
            seconds = model.time(Stage.CATCH_UP, row.draft_lag - 1) / rounds_left
            catchup = float(f"{2.0 ** (round(4 * math.log2(seconds)) / 4):.4g}") if seconds > 0 else 0.0
        cap = row.tokens_left - 1 if row.tokens_left <= self.max_n else None
        fixed = None if _free(row) else row.num_draft
        return RowChoice(_grid(beta), row.mode.draws_nu, fixed, catchup, cap)

    def assign(self, rows: Sequence[PlannedRow]) -> None:
        draft_only = [row for row in rows if row.mode.draft_only]
        if draft_only:  # the draft's own decoding (`draft_only.py`): one round, as long as the most
            # any row has left. Rows with fewer left ride along: they emit what they have left, the
            # same tokens (a round's draws are the first of its row's stream), so one round a step
            # replaces one per distinct length (at batch 32 on CUDA, ~6 a step: 0.78x plain decoding).
            n = max(1, min(self.max_n, max(row.tokens_left for row in draft_only)))
            for row in draft_only:
                row.num_draft = n
        rows = [row for row in rows if not row.mode.draft_only]
        if self.force is not None:
            for row in rows:
                row.num_draft = self.force if row.mode.adaptive else row.num_draft
            return
        for row in rows:
            if row.mode.adaptive and row.mode.reproducible:
                self._plan_alone(row)
        free = [row for row in rows if _free(row)]
        if not free:
            return
        held, left, explored = self._held
        if left > 0:  # the plan stands but for newcomers, explorers, rows drafting past their end
            moving = [
                r for r in free if id(r) not in held or id(r) in explored or r.num_draft >= r.tokens_left
            ]
            left -= 1
        else:
            moving, left = free, REPLAN_EVERY - 1
        self._held = (frozenset(map(id, free)), left, self._plan(rows, moving, explore_due=moving is free))

    def _plan(self, rows: Sequence[PlannedRow], moving: Sequence[PlannedRow], explore_due: bool) -> frozenset:
        """N for the `moving` free rows, the other rows' N fixed: a partial plan lets them join one
        of the rounds the others run, or none. Rows due to explore do so in a full plan
        (`explore_due`). Returns the ids of the rows that explore."""
        moves = {id(row) for row in moving}
        for row in rows:
            if _free(row) and id(row) not in moves:
                _counted(row, row.num_draft)
        fixed = {row.num_draft for row in rows if _free(row) and id(row) not in moves}
        if not moves or fixed == {0}:  # nothing to plan, or nothing to join but plain rounds
            for row in moving:
                _counted(row, 0)
            return frozenset()
        table, step = _RoundTimes(self.cost, self.max_n), self.cost.time(Stage.STEP, len(rows))
        choices = [
            c if id(row) in moves else c._replace(fixed=row.num_draft)
            for row, c in ((row, self.row_choice(row)) for row in rows)
        ]
        options = sorted({0, *fixed}) if fixed else None
        plan = choose(choices, table, self.max_n, step, self.margin, options=options)
        due = [explore_due and _free(r) and r.estimate.plain_rounds >= EXPLORE_EVERY for r in rows]
        due = [d and not n for d, n in zip(due, plan, strict=True)]
        if any(due):
            m = catch_up_size([row.draft_lag for row, d in zip(rows, due, strict=True) if d])
            extra = self.cost.time(Stage.CATCH_UP, m) if m else 0.0
            plan = explore(choices, plan, due, table, self.max_n, step, extra) or plan
        for row, n, d in zip(rows, plan, due, strict=True):
            if id(row) in moves:
                _counted(row, n, d)
        return frozenset(id(row) for row, n, d in zip(rows, plan, due, strict=True) if d and n)

    def _plan_alone(self, row: PlannedRow) -> None:
        """A reproducible row's N: its kind's (memoised), the N whose gain over plain decoding is
        largest at the kind's constant prior on the profile, taking the smaller of its gains alone
        and in a full batch (`alone_batch`, the engine's max_batch); drafting only where that
        beats N = 0 by the margin. A plan that cannot see its batch must not cost it at either
        end, so nothing the row learns moves it either: rows of a kind share one round. Measured
        on the embedded pair, seeded, c = 8: planned for one row, 0.63-0.72x plain decoding; at
        an N of its own each, 0.75-0.81x; at the kind's N or 0 by its own evidence (and lag),
        lite 0.76x, split between the two, and at c = 1 on Qwen shapes no tier drafted (0.88-1.13x;
        now 1.15-1.49x: docs/bench/planner-ab.md, "Seeded requests")."""
        kind = RowChoice(_grid(self.acceptance.prior(row, alone=True)), row.mode.draws_nu)
        if kind not in self._alone:
            table, batches = _RoundTimes(self.profile, self.max_n), {1, self.alone_batch}
            rate = lambda n, b: goodput([kind] * b, [n] * b, table, self.profile.time(Stage.STEP, b))  # noqa: E731
            gain = lambda n: min(rate(n, b) / rate(0, b) for b in batches)  # noqa: E731
            best = max(range(1, self.max_n + 1), key=gain)
            self._alone[kind] = best if gain(best) >= 1 + self.margin else 0
        row.num_draft = self._alone[kind]

    def predict(self, rows: Sequence[PlannedRow], n: int) -> tuple[float, float]:
        """(live model, start-up profile) seconds of one round of `rows` at draft length n."""
        r = len(rows)
        if rows[0].mode.draft_only:  # n draft steps and the round's fixed part
            return self.cost.draft_only_round_time(r, n), self.profile.draft_only_round_time(r, n)
        needy = [self.acceptance.beta(row, row.mode.reproducible) for row in rows if row.mode.draws_nu]
        bonus = bonus_steps(needy, n)
        m = catch_up_size([row.draft_lag for row in rows]) if n else 0  # lagging rows catch up first
        live, profile = (
            model.round_time(r, n, bonus) + (model.time(Stage.CATCH_UP, m) if m else 0.0)
            for model in (self.cost, self.profile)
        )
        return live, profile

    def learn(self, batch, out, seconds: dict) -> None:
        """After a round: acceptance and TV̂ into the pools, its stage times into the cost model."""
        r, n, cost = batch.size, batch.n, self.cost
        for row, accept, tv in zip(batch.rows, out.accept_probs, out.tv, strict=True):
            self.acceptance.observe(row, accept, tv)
        cost.observe(Stage.SCORE, r, n + 1, seconds[Stage.SCORE])  # first: the base of the others
        caught_up = self._learn_catch_ups(batch)  # in the draft phase if n, else in the bonus step
        if n:
            cost.observe(Stage.DRAFT, r, n, (seconds[Stage.DRAFT] - caught_up) / n)
        if out.bonus_rows:
            step = seconds[Stage.BONUS] - (0.0 if n else caught_up)
            cost.observe(Stage.BONUS, len(out.bonus_rows), 1, step)
        cost.observe(Stage.CHECK, r, n, seconds[Stage.CHECK])
        self._learn_other(r, seconds)

    def learn_draft_only(self, batch, seconds: dict) -> None:
        caught_up = self._learn_catch_ups(batch)
        self.cost.observe(Stage.DRAFT_ONLY, batch.size, 1, (seconds[Stage.DRAFT_ONLY] - caught_up) / batch.n)
        self._learn_other(batch.size, seconds)

    def learn_step(self, running: int, seconds: float) -> None:
        """After a scheduler step of `running` (> 0) rows: its seconds outside rounds and prefills."""
        self.cost.observe(Stage.STEP, running, 0, seconds)

    def _learn_catch_ups(self, batch) -> float:
        for m, s in batch.catch_ups:
            self.cost.observe(Stage.CATCH_UP, m, 1, s)
        return sum(s for _, s in batch.catch_ups)

    def _learn_other(self, r: int, seconds: dict) -> None:
        staged = sum(v for k, v in seconds.items() if k != Stage.ROUND)
        self.cost.observe(Stage.OTHER, r, 0, seconds[Stage.ROUND] - staged)
