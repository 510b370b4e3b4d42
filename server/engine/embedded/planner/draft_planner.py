"""The engine's side of the draft-length policy (`draft_length.py`, which defines the terms): each
step it reads the rows into `RowChoice`s, asks `choose` for their draft lengths over a snapshot of
the cost model (`RoundTable`), and after each round it learns acceptance, TV̂ and stage times.

Reproducible rows (`RowMode.reproducible`: a seed was given, or greedy). A row's tokens are a
function of its prompt, its own random stream and its sequence of draft lengths: the same N
sequence draws the same coins and makes the same verdicts. The live plan is not a function of the
row alone: it reads measured stage times (the host's load), the batch it lands in (round times at
R rows, the other rows' choices), TV̂ and the calibration, which every row moves. So a reproducible
row is planned *alone*: from its own acceptance evidence, the prior TV̂ (`PairAgreement.prior_tv`,
a constant), no calibration, and the start-up cost profile at one row (`profile_table`, built once
and never updated); the joint search then takes its N as fixed. Its N sequence, and with it its
output, is then the same whatever the load, the batch and the timings.

Why not randomness keyed by output position, so that N could not change what is sampled? Because
no such coupling exists for this rule. A drafted position's token is the speculative outcome
`x = F_q⁻¹(u)`, kept if `u' < ν(x)/q(x)`, else a residual draw: a function of q as well as ν; an
undrafted one (an N = 0 round's token, a bonus) is drawn from ν (or from p, the default for adaptive
w < 1 rows: `RowMode.draws_nu`) with no q to couple to. For both to give the same token from the
same position-keyed uniforms, the undrafted draw would have to run the draft (a draft step per
undrafted token, the cost N = 0 rounds exist to avoid) and draw from ν, not p. A draft-invariant
coupling does exist (Gumbel-max on shared per-position noise: draft `argmax(log q + G)`, output
`argmax(log ν + G)`), but it accepts with probability about (1 − TV)/(1 + TV) instead of the optimal
1 − w·TV the planner, the DIVERSED analysis and the verifier are built on: a slower rule for every
request. Planning alone costs only the seeded rows some joint-search goodput.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

from server.engine.embedded.planner.draft_length import (
    EXPLORE_AFTER,
    MARGIN,
    AcceptanceCalibration,
    AcceptanceEstimate,
    PairAgreement,
    RowChoice,
    beta_grid,
    bonus_steps,
    catch_up_bucket,
    catch_up_size,
    choose,
    expected_tokens,
    explore,
    log_grid,
)
from verifier import Policy
from verifier.dial import PolicyKind


class PlannedMode(Protocol):
    """What the planner reads of a row's `row.RowMode`."""

    @property
    def adaptive(self) -> bool: ...
    @property
    def draft_only(self) -> bool: ...
    @property
    def draws_nu(self) -> bool: ...
    @property
    def reproducible(self) -> bool: ...


class PlannedRow(Protocol):
    """What the planner reads of a `row.Row` (it sits below rows and cannot import them), and
    `num_draft`, the one field it writes."""

    num_draft: int
    mode: PlannedMode
    estimate: AcceptanceEstimate
    policy: Policy

    @property
    def prior_weight(self) -> float: ...
    @property
    def draft_lag(self) -> int: ...
    @property
    def tokens_left(self) -> int: ...


class RoundTable:
    """`round_time` from a dense snapshot of a cost model (rows 1..max_batch, n 0..max_n): the
    search asks for hundreds of round times a step. The planner's predictions read it too: every
    observation invalidates its kind's fit in the live model, and refitting on each read cost 7
    fits and ~1.1 ms a step at 8 rows of the embedded pair, against rounds of ~12 ms. A rebuild
    (which also drops the cached plans) comes after `every` model updates (about 5 a round), or
    after `max_age` seconds once the model has changed at all: on a real-size pair a round takes
    0.2-3 s and a bench row runs ~8 of them, so an update count alone left predictions a whole
    row behind (Qwen2.5 shapes: round-time errors up to 16.6 % against 9.9 % before), while a
    rebuild costs ~3 ms there as here."""

    def __init__(self, cost, max_batch: int, max_n: int, every: int = 64, max_age: float = 0.5):
        self.cost, self.max_batch, self.max_n, self.every = cost, max_batch, max_n, every
        self.max_age = max_age
        self.epoch = -1  # rebuilds so far; plans are cached per epoch
        self.built_at, self.built_time = -1, -math.inf  # the model's updates and the clock then
        self._catch_up: dict[int, float] = {}
        self._rows: dict[int, tuple[list[float], float, float]] = {}

    def refresh(self) -> None:
        c = self.cost
        fresh = c.updates - self.built_at
        young = not fresh or time.perf_counter() - self.built_time < self.max_age
        if self.built_at >= 0 and fresh < self.every and young:
            return
        self.epoch += 1
        self.built_at, self.built_time = c.updates, time.perf_counter()
        # Filled per batch size on first use: a step of one row reads one of max_batch lines, and
        # a full rebuild every ~16 rounds cost ~30 µs a step, 3 % of the embedded pair's plain step
        # on a fast host.
        self._rows = {}
        self._catch_up = {}

    def _row(self, r: int) -> tuple[list[float], float, float]:
        """(round time for n = 0..max_n, a bonus step, the step's overhead) at r rows."""
        line = self._rows.get(r)
        if line is None:
            c = self.cost
            line = self._rows[r] = (
                c.round_times(r, self.max_n),
                c.time("first_draft", r, 1),  # a bonus step follows the target's forward
                c.time("step", r, 0),
            )
        return line

    def __call__(self, r: int, n: int, bonus: float = 0.0) -> float:
        if r > self.max_batch or n > self.max_n:
            return self.cost.round_time(r, n, bonus)
        base, bonus_step, _ = self._row(r)
        return base[n] + bonus * bonus_step

    def step(self, r: int) -> float:
        """The scheduler's seconds outside rounds in a step of r running rows."""
        return self._row(r)[2] if 1 <= r <= self.max_batch else self.cost.time("step", r, 0)

    def catch_up(self, m: int) -> float:
        """A lagging draft's catch-up forward over m tokens (read once per snapshot per m)."""
        if m not in self._catch_up:
            self._catch_up[m] = self.cost.time("catch_up", m, 1)
        return self._catch_up[m]


class DraftPlanner:
    """The engine's side of the policy: sets `row.num_draft` for adaptive rows each step, learns
    from each round (acceptance, TV̂, stage times into the cost model) and predicts round times.

    Rows are read as `PlannedRow`s. Plans are cached per
    batch signature (rounded β, draws_nu, fixed, catch-up per row; rows running) and cost-table
    epoch, so steady batches do not re-run the search every step; a row planned at n = 0 for long
    enough may draft for one round (`draft_length.explore`). `profile` is the
    start-up cost model, kept unchanged to report how well it alone predicts rounds and to plan
    reproducible rows from (module doc). `force` pins every adaptive row to one N (benchmarks
    sweep fixed N with it, N = 0 included)."""

    def __init__(self, cost, max_n: int, margin: float = MARGIN, max_batch: int = 8):
        self.cost = cost
        self.profile = cost.copy()
        self.max_n = max_n
        self.margin = margin
        self.force: int | None = None
        self.agreement = PairAgreement()
        self.calibration = AcceptanceCalibration()
        self.table = RoundTable(cost, max_batch, max_n)
        self.profile_table = RoundTable(self.profile, max_batch, max_n)  # never changes: built once
        self._plans: dict[tuple, list[int]] = {}
        self._plain: tuple[tuple, int] | None = None  # (rows, epoch) of a step planned all at n = 0
        self._choices: dict[int, RowChoice] = {}  # this step's, by row id (`predict` reads them)
        self._planned: dict[int, tuple[float, tuple]] = {}  # this step's `_estimate`s, by row id
        self._alone: dict[tuple[RowChoice, bool], int] = {}  # reproducible rows' plans

    def set_cost(self, cost) -> None:
        """Decide from another cost model from now on (tests and experiments pin one). It is then
        the start-up profile too: reproducible rows plan from it."""
        self.cost = cost
        self.table = RoundTable(cost, self.table.max_batch, self.max_n)
        self.profile = cost.copy()
        self.profile_table = RoundTable(self.profile, self.table.max_batch, self.max_n)
        self._plans.clear()
        self._alone.clear()
        self._plain = None

    def _estimate(self, row: PlannedRow) -> tuple[float, tuple]:
        """The row's acceptance estimate (uncalibrated) and its calibration key. Reproducible rows
        read the prior TV̂, a constant, not the running one that every row moves."""
        w = row.prior_weight if row.policy.kind == PolicyKind.ENSEMBLE else 1.0
        tv = self.agreement.prior_tv if row.mode.reproducible else self.agreement.tv
        return row.estimate.beta(1.0 - w * tv), (row.policy.kind, round(w, 2))

    def row_choice(self, row: PlannedRow, alone: bool = False) -> RowChoice:
        """What `choose` reads of the row. Reproducible rows: uncalibrated, catch-ups priced from
        the start-up profile; for the batch's search they are fixed at the N they were planned at
        alone (`_plan_alone`, which asks for its own choice with `alone`)."""
        fixed = None if row.mode.adaptive and (alone or not row.mode.reproducible) else row.num_draft
        alone = row.mode.reproducible
        raw, key = self._estimate(row)
        beta = min(raw * (1.0 if alone else self.calibration.factor(key)), 1.0)
        catchup = 0.0
        if row.draft_lag > 2:  # a forward over the lag, spread over the rounds left
            table = self.profile_table if alone else self.table
            rounds_left = max(1.0, row.tokens_left / expected_tokens(beta, max(self.max_n // 2, 1)))
            catchup = log_grid(table.catch_up(row.draft_lag - 1) / rounds_left)
        # Near its end a request cannot emit more than it has left; far from it, no cap, so that
        # rows of one tier form one class for the search (β on a grid for the same reason).
        cap = row.tokens_left - 1 if row.tokens_left <= self.max_n else None
        return RowChoice(beta_grid(beta), row.mode.draws_nu, fixed, catchup, cap)

    def _plan_alone(self, row: PlannedRow) -> None:
        """A reproducible row's N (module doc): `choose` and `explore` as for a batch of this row
        alone, on the start-up profile. A function of the row's own history (its evidence, lag,
        tokens left and plain rounds), so its N sequence is the same in any batch under any load."""
        choice = self.row_choice(row, alone=True)
        due = row.estimate.plain_rounds >= EXPLORE_AFTER
        key = (choice, due)
        n = self._alone.get(key)
        if n is None:
            table, step = self.profile_table, self.profile_table.step(1)
            (n,) = choose([choice], table, self.max_n, self.margin, step)
            if due and not n:
                m = catch_up_size([row.draft_lag])
                catch_up = table.catch_up(m) if m else 0.0
                n = (explore([choice], [0], [True], table, self.max_n, step, catch_up) or [0])[0]
            if len(self._alone) > 512:
                self._alone.clear()
            self._alone[key] = n
        row.num_draft = n
        # tried or not, an exploration's next look is EXPLORE_AFTER plain rounds away
        row.estimate.plain_rounds = 0 if n or due else row.estimate.plain_rounds + 1

    def assign(self, rows: Sequence[PlannedRow]) -> None:
        running = len(rows)
        self._choices, self._planned = {}, {}
        draft_only = [row for row in rows if row.mode.draft_only]
        for row in draft_only:  # the draft's own decoding (`draft_only.py`): no choice to make
            row.num_draft = max(1, min(self.max_n, row.tokens_left))
        if draft_only:
            rows = [row for row in rows if not row.mode.draft_only]
        if not any(row.mode.adaptive for row in rows):
            return
        if self.force is not None:
            for row in rows:
                if row.mode.adaptive:
                    row.num_draft = self.force
            return
        for row in rows:
            if row.mode.adaptive and row.mode.reproducible:
                self._plan_alone(row)
        if not any(_free(row) for row in rows):
            return
        self.table.refresh()
        if self._still_plain(rows):
            for row in rows:
                if _free(row):
                    row.num_draft = 0
                    row.estimate.plain_rounds += 1
            return
        choices = [self.row_choice(row) for row in rows]
        self._choices = {id(row): c for row, c in zip(rows, choices, strict=True)}
        self._planned = {id(row): self._estimate(row) for row in rows if _free(row)}
        key = (tuple(choices), running, self.table.epoch)
        plan = self._plans.get(key)
        if plan is None:
            plan = choose(choices, self.table, self.max_n, self.margin, self.table.step(running))
            if len(self._plans) > 512:
                self._plans.clear()
            self._plans[key] = plan
        due = [
            _free(r) and not n and r.estimate.plain_rounds >= EXPLORE_AFTER
            for r, n in zip(rows, plan, strict=True)
        ]
        if any(due):  # see `explore` in draft_length.py
            m = catch_up_size([row.draft_lag for row, d in zip(rows, due, strict=True) if d])
            catch_up = self.table.catch_up(m) if m else 0.0
            step = self.table.step(running)
            plan = explore(choices, plan, due, self.table, self.max_n, step, catch_up) or plan
            for row, d in zip(rows, due, strict=True):
                if d:  # tried or not, the next look is EXPLORE_AFTER plain rounds away
                    row.estimate.plain_rounds = 0
        for row, n in zip(rows, plan, strict=True):
            if _free(row):
                row.num_draft = n
                row.estimate.plain_rounds = 0 if n else row.estimate.plain_rounds + 1
        plain = not any(plan) and not any(row.mode.draws_nu for row in rows)
        self._plain = (tuple(rows), self.table.epoch) if plain else None

    def _still_plain(self, rows: Sequence[PlannedRow]) -> bool:
        """The last step planned these same rows, every one at n = 0, in this snapshot, and none
        is due to explore: then n = 0 stands without a search. With no drafts no estimate, TV̂ or
        calibration has moved; what does move, a lagging draft's catch-up (growing) and the
        tokens left (shrinking), only makes drafting dearer. (Rows that would draw from ν at
        n = 0 pay the catch-up there too, so they always search.) Choices and search at 8 plain rows
        cost ~0.15 ms a step, 5-10 % of the embedded pair's plain round (2.2 ms) on a fast host."""
        last = self._plain
        return (
            last is not None
            and last[1] == self.table.epoch
            and len(last[0]) == len(rows)
            and all(a is b for a, b in zip(last[0], rows, strict=True))
            and not any(_free(row) and row.estimate.plain_rounds >= EXPLORE_AFTER for row in rows)
            and not any(row.num_draft for row in rows if not _free(row))  # reproducible ones may move
        )

    def predict(self, rows: Sequence[PlannedRow], n: int) -> tuple[float, float]:
        """(live model, start-up profile) predictions of one round of `rows` at draft length n."""
        if rows[0].mode.draft_only:  # n draft steps and the round's fixed part; no target, no check
            r = len(rows)
            return self.cost.draft_only_round_time(r, n), self.profile.draft_only_round_time(r, n)
        self.table.refresh()
        self.profile_table.refresh()
        if n:
            # the choices this step's plan was made from (an earlier round of the step may have
            # moved TV̂ since, by one round's evidence: the plan's view is close, and it is free)
            choices = [self._choices.get(id(row)) or self.row_choice(row) for row in rows]
            bonus = bonus_steps([c.beta for c in choices if c.draws_nu], n)
        else:  # a bonus step iff some row draws from ν (at n = 0 always): no estimates needed
            bonus = float(any(row.mode.draws_nu for row in rows))
        m = catch_up_size([row.draft_lag for row in rows]) if n else 0  # lagging rows catch up first
        r = len(rows)
        live = self.table(r, n, bonus) + (self.table.catch_up(m) if m else 0.0)
        profile = self.profile_table(r, n, bonus) + (self.profile_table.catch_up(m) if m else 0.0)
        return live, profile

    def learn_step(self, running: int, seconds: float) -> None:
        """After a scheduler step of `running` (> 0) rows: its seconds outside rounds and prefills."""
        self.cost.observe("step", running, 0, max(seconds, 0.0))

    def learn_draft_only(self, batch, seconds: dict) -> None:
        """After a draft-only round: its draft steps and the rest into the cost model."""
        r, n = batch.size, batch.n
        caught_up = self._learn_catch_ups(batch)
        self.cost.observe("draft_only", r, 1, max(seconds["draft"] - caught_up, 0.0) / n)
        self.cost.observe("other", r, 0, max(seconds["round"] - seconds["draft"], 0.0))

    def _learn_catch_ups(self, batch) -> float:
        """The round's catch-up forwards into the cost model (kind `catch_up`, by tokens M);
        returns their seconds, which the phase that ran them (draft, or the bonus step at n = 0)
        must not count as draft steps."""
        for m, s in batch.catch_ups:
            self.cost.observe("catch_up", catch_up_bucket(m), 1, s)
        return sum(s for _, s in batch.catch_ups)

    def learn(self, batch, out, seconds: dict) -> None:
        """After a round: the rows' acceptance, the pair's TV̂, and the stage times."""
        r, n, cost = batch.size, batch.n, self.cost
        if n and self.force is None:  # the planner chose n for its adaptive rows: calibrate
            for row, k, accept in zip(batch.rows, out.num_accepted, out.accept_probs, strict=True):
                if _free(row):  # with what this round was planned with (the row has seen it since)
                    raw, key = self._planned.get(id(row)) or self._estimate(row)
                    self.calibration.observe(key, k, len(accept), raw)
        for tv in out.tv:  # (each row's own acceptance evidence is its own: `round.advance`)
            self.agreement.observe(tv)
        forward = seconds.get("verify_forward" if n else "target_forward", 0.0)
        caught_up = self._learn_catch_ups(batch)  # in the draft phase if n, else in the bonus step
        if out.bonus_rows:  # a draft step right after the target's forward, timed alone
            step = seconds["bonus"] - (0.0 if n else caught_up)
            cost.observe("first_draft", len(out.bonus_rows), 1, max(step, 0.0))
        if n:  # one first step, then n - 1 steps after draft steps
            phase = max(seconds["draft"] - caught_up, 0.0)
            if n == 1:
                cost.observe("first_draft", r, 1, phase)
            else:
                # Split the phase between the two in the model's proportion: a host that
                # speeds up or slows down moves both alike, while the first step's share is set by
                # the rounds that time it alone (bonus steps, n = 1) and the profile. Subtracting
                # the first step's estimate instead put all of a stale one's error on the later
                # steps: (phase − f̂)/(n − 1) read 0.79 ms for a 1.65 ms step at n = 4 once the host
                # had sped up, and moved the exact tier's choice of n with it.
                # (read live: this is a feedback loop, and a snapshot's lag slowed its convergence)
                first, later = cost.time("first_draft", r, 1), cost.time("draft", r, 1)
                total = first + (n - 1) * later
                if total > 0:
                    cost.observe("first_draft", r, 1, first * phase / total)
                    cost.observe("draft", r, 1, later * phase / total)
                else:  # nothing learned yet: an even split
                    cost.observe("draft", r, 1, phase / n)
        cost.observe("score", r, n + 1, forward)
        cost.observe("check", r, n, seconds["verify_call"])
        staged = sum(v for k, v in seconds.items() if k != "round")
        cost.observe("other", r, 0, max(seconds["round"] - staged, 0.0))


def _free(row: PlannedRow) -> bool:
    """An adaptive row the batch's search plans (reproducible rows are planned alone)."""
    return row.mode.adaptive and not row.mode.reproducible
