"""What the planner believes about acceptance: β, a row's per-position acceptance probability
(taken constant along the chain).

Terms
    a_t       the verifier's acceptance probability at a tested position t (drafts up to and
              including the first rejection): the conditional mean of the 0/1 outcome, the same
              expectation with less noise.
    TV̂        the pair's disagreement: a running mean of one-draw estimates 1 − min(1, p(x)/q(x))
              (x ~ q; `verifier.theory.tv_estimates`) over drafted positions of sampling rows,
              from an optimistic prior (`PRIOR_TV`) so that a fresh engine tries drafting.
    prior     1 − w·TV̂, w the row's weight (its running mean w_t for learned rows; 1 for other
              policies): the acceptance DIVERSED's analysis gives a row of weight w.
    kind      rows of one policy and weight (to 0.05). Its β pools the a_t of every row of the
              kind, decayed past `WINDOW` positions, over the prior counting `PRIOR_POSITIONS`.
    row       a row's own a_t as a light update of its kind's: (S·β_kind + Σ a_t)/(S + #t).

Why pooled: a row's own few positions are noisy, and the planner drafts for the rows whose β reads
high, which on average read high by chance (the winner's curse: on the embedded pair, rows drafted
at estimates of 0.85-0.95 accepted 0.80, and the exact tier ran 0.79x plain decoding). A kind's
pool is what its rows realised, over thousands of positions. Reproducible rows (seeded, greedy)
read neither the pool nor the running TV̂, which other rows move: their kind's β is the prior at
`PRIOR_TV` (`draft_planner.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from verifier.dial import PolicyKind

PRIOR_TV = 0.3
PRIOR_POSITIONS = 16.0  # the prior counts as this many positions (for the pool and for TV̂)
WINDOW = 2048.0  # positions a pool (and TV̂) remembers
ROW_STRENGTH = 32.0  # a row's kind counts as this many of its own positions


@dataclass
class AcceptanceEstimate:
    """A row's own evidence, and the rounds it has been planned without drafts since it last
    drafted (`draft_planner.py`: explore)."""

    accept_sum: float = 0.0
    tested: int = 0
    plain_rounds: int = 0

    def observe(self, accept_probs: Sequence[float]) -> None:
        self.accept_sum += float(sum(accept_probs))
        self.tested += len(accept_probs)

    def beta(self, prior: float) -> float:
        return (ROW_STRENGTH * prior + self.accept_sum) / (ROW_STRENGTH + self.tested)


def _decayed(sums: list[float], values: Sequence[float]) -> None:
    """[Σ, count] += values, scaled down to `WINDOW` positions."""
    sums[0] += float(sum(values))
    sums[1] += len(values)
    if sums[1] > WINDOW:
        sums[0], sums[1] = sums[0] * WINDOW / sums[1], WINDOW


@dataclass
class AcceptancePool:
    """TV̂ and each kind's pooled acceptance (module doc)."""

    tv_sums: list = field(default_factory=lambda: [0.0, 0.0])
    kinds: dict = field(default_factory=dict)  # (policy, w) -> [Σ a_t, positions]

    @property
    def tv(self) -> float:
        total, count = self.tv_sums
        return (PRIOR_TV * PRIOR_POSITIONS + total) / (PRIOR_POSITIONS + count)

    @staticmethod
    def weight(row) -> float:
        return row.prior_weight if row.policy.kind == PolicyKind.ENSEMBLE else 1.0

    def kind(self, row) -> tuple:
        return row.policy.kind, round(self.weight(row) * 20) / 20

    def observe(self, row, accept_probs: Sequence[float], tv: Sequence[float]) -> None:
        if accept_probs:
            _decayed(self.kinds.setdefault(self.kind(row), [0.0, 0.0]), accept_probs)
        if tv:
            _decayed(self.tv_sums, tv)

    def prior(self, row, alone: bool = False) -> float:
        """The row's kind's β: its pool over 1 − w·TV̂, or the constant 1 − w·`PRIOR_TV` if `alone`."""
        if alone:
            return 1.0 - self.weight(row) * PRIOR_TV
        total, count = self.kinds.get(self.kind(row), (0.0, 0.0))
        prior = 1.0 - self.weight(row) * self.tv
        return (PRIOR_POSITIONS * prior + total) / (PRIOR_POSITIONS + count)

    def beta(self, row, alone: bool = False) -> float:
        """The row's β: its own evidence over its kind's (`prior`)."""
        return row.estimate.beta(self.prior(row, alone))
