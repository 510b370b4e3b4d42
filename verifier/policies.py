"""Acceptance policies: how a draft token `x ~ q` is judged against the target `p`.

Every policy answers the same three questions for each draft position, as tensors:
    accept    `[B, N]`     probability of accepting the draft token there;
    residual  `[B, N, V]`  distribution to sample the correction from on the first rejection
                          (unnormalised is fine; rows with no mass fall back to p);
    greedy    `[B, N, V]`  distribution whose argmax is the verdict at temperature 0.

Policies (docs/algorithm.md; one `RULES` entry each; `PolicyKind` is owned by `verifier.dial`):
    ENSEMBLE  (DIVERSED) `ν = w·p + (1−w)·q`; accept `min(1, ν(x)/q(x)) = min(1, 1 − w + w·p/q)`;
              residual `max(0, ν − q) = w·max(0, p − q)`, i.e. the ordinary SD residual. w = 1 is
              lossless SD; a `[B, N]` weight tensor gives per-token weights from a learned head.
    LOSSY     Leviathan lenience `l ∈ (0, 1]`: accept `min(1, p/(l·q))`, residual `max(0, p − q)`.
    CASCADE   SpecCascade [OPT]: per position, defer to the target (π = p) if
              `max q < max p − α·TV(p, q)`, else π = q; accept `min(1, π/q)`, residual `max(0, π−q)`.
    TYPICAL   Medusa typical acceptance: accept iff `p(x) > min(ε, δ·exp(−H(p)))`; residual p.

A batch may mix policies row by row (`PolicyBatch.kind`); each kind present (known on the host
from construction, so no device sync) is evaluated over the whole batch and selected with
`torch.where`: a few element-wise passes, no Python loop over rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifier.dial import PolicyKind, Verification, check_policy_params
from verifier.theory import tv_distance

# Guards divisions by q(x); q(x) of a sampled draft token is > 0 unless the caller lied.
_TINY = 1e-20


@dataclass(frozen=True)
class Policy:
    """One request's verification policy. The ensemble weight w travels separately (see verify).
    Defaults and ranges are the dial's (`verifier.dial.Verification`, `check_policy_params`)."""

    kind: PolicyKind = PolicyKind.ENSEMBLE
    lenience: float = Verification.lenience  # LOSSY: l in (0, 1]; 1 is lossless
    alpha: float = Verification.alpha  # CASCADE: deferral margin scale (>= 0)
    epsilon: float = Verification.epsilon  # TYPICAL: hard threshold (Medusa's posterior_threshold)
    delta: float = Verification.delta  # TYPICAL: entropy-scaled threshold (Medusa's posterior_alpha)

    def __post_init__(self):
        check_policy_params(self.lenience, self.alpha, self.epsilon, self.delta)

    @classmethod
    def of(cls, v: Verification) -> Policy:
        """The policy a request's `Verification` asks for (the one place one is built from it)."""
        return cls(v.policy, v.lenience, v.alpha, v.epsilon, v.delta)


@dataclass(frozen=True)
class PolicyBatch:
    """Per-row policy parameters as tensors. All tensor fields `[B]`; `kinds` is the set of kinds
    present, kept on the host so choosing rules never reads the device."""

    kind: torch.Tensor  # long
    lenience: torch.Tensor
    alpha: torch.Tensor
    epsilon: torch.Tensor
    delta: torch.Tensor
    kinds: frozenset = frozenset(PolicyKind)

    @staticmethod
    def from_policies(policies: Sequence[Policy], device=None) -> PolicyBatch:
        def col(name, dtype=torch.float32):
            return torch.tensor([getattr(p, name) for p in policies], dtype=dtype, device=device)

        return PolicyBatch(
            kind=col("kind", torch.long),
            lenience=col("lenience"),
            alpha=col("alpha"),
            epsilon=col("epsilon"),
            delta=col("delta"),
            kinds=frozenset(p.kind for p in policies),
        )

    @property
    def batch_size(self) -> int:
        return self.kind.shape[0]


def _token_prob(dist: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`dist[b, i, tokens[b, i]]`: `[B, N, V], [B, N] -> [B, N]`."""
    return dist.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _col(values: torch.Tensor) -> torch.Tensor:
    """Per-row parameter `[B]` -> `[B, 1]`, broadcasting over positions."""
    return values.unsqueeze(-1)


# Each policy is three pure functions over p, q `[B, M, V]` and per-row parameters `[B]`
# (M = N at the draft positions, or 1 when only the rejection position is needed):
#   accept(p, q, x, w, params) -> [B, M]      probability of accepting draft x
#   residual(p, q, w, params)  -> [B, M, V]   where a rejection's correction is drawn from
#   greedy(p, q, w, params)    -> [B, M, V]   whose argmax is the temperature-0 verdict
# Splitting them lets `verify` evaluate the [.., V] distributions only where it needs them.


def ensemble_accept(p, q, x, w, params=None):
    """`min(1, ν(x)/q(x)) = min(1, 1 − w + w·p(x)/q(x))`; w `[B, M]`."""
    px, qx = _token_prob(p, x), _token_prob(q, x)  # [B, M]
    return (1.0 - w + w * px / qx.clamp_min(_TINY)).clamp(max=1.0)


def ensemble_residual(p, q, w, params=None):
    """`max(0, ν − q) = w·max(0, p − q)`: the SD residual (w only rescales it)."""
    return (p - q).clamp_min(0.0)


def ensemble_mix(p: torch.Tensor, q: torch.Tensor, w) -> torch.Tensor:
    """ν = w·p + (1−w)·q — the one place the ensemble is written. Mixes probabilities (not
    logits); `w` (a float or a tensor) broadcasts against p and q, so callers mixing `[..., V]`
    rows with per-row weights `[...]` pass `w.unsqueeze(-1)`."""
    return w * p + (1.0 - w) * q


def ensemble_greedy(p, q, w, params=None):
    return ensemble_mix(p, q, w.unsqueeze(-1))  # [B, M, V]: argmax ν is the greedy verdict


def lossy_accept(p, q, x, w, params):
    """`min(1, p(x)/(l·q(x)))`."""
    px, qx = _token_prob(p, x), _token_prob(q, x)
    return (px / (_col(params.lenience) * qx).clamp_min(_TINY)).clamp(max=1.0)


def target_greedy(p, q, w, params):
    return p


def _cascade_pi(p, q, params):
    """π = p where the draft is less confident than the target by more than α·TV, else q."""
    defer = q.amax(-1) < p.amax(-1) - _col(params.alpha) * tv_distance(p, q)  # [B, M]
    return torch.where(defer.unsqueeze(-1), p, q)  # [B, M, V]


def cascade_accept(p, q, x, w, params):
    pi = _cascade_pi(p, q, params)
    return (_token_prob(pi, x) / _token_prob(q, x).clamp_min(_TINY)).clamp(max=1.0)


def cascade_residual(p, q, w, params):
    return (_cascade_pi(p, q, params) - q).clamp_min(0.0)


def cascade_greedy(p, q, w, params):
    return _cascade_pi(p, q, params)


def typical_accept(p, q, x, w, params):
    """Deterministic: accept iff `p(x) > min(ε, δ·exp(−H(p)))`."""
    entropy = -(p * p.clamp_min(_TINY).log()).sum(-1)  # [B, M]
    threshold = torch.minimum(_col(params.epsilon), _col(params.delta) * torch.exp(-entropy))
    return (_token_prob(p, x) > threshold).to(p.dtype)


def typical_residual(p, q, w, params):
    return p  # Medusa resamples from the target on rejection


RULES = {
    PolicyKind.ENSEMBLE: (ensemble_accept, ensemble_residual, ensemble_greedy),
    PolicyKind.LOSSY: (lossy_accept, ensemble_residual, target_greedy),
    PolicyKind.CASCADE: (cascade_accept, cascade_residual, cascade_greedy),
    PolicyKind.TYPICAL: (typical_accept, typical_residual, target_greedy),
}
_ACCEPT, _RESIDUAL, _GREEDY = 0, 1, 2


def kinds_present(policy: PolicyBatch | None) -> frozenset:
    """Policy kinds among the rows; ENSEMBLE only when `policy` is None."""
    return frozenset({PolicyKind.ENSEMBLE}) if policy is None else policy.kinds


def _per_row(which: int, policy, kinds, *args):
    """Evaluate rule `which` for every kind present and select each row's own result."""
    if policy is None or len(kinds) == 1:
        (kind,) = kinds
        return RULES[kind][which](*args, policy)
    out = None
    for kind in sorted(kinds):
        value = RULES[kind][which](*args, policy)
        if out is None:
            out = value
            continue
        rows = (policy.kind == kind).view(-1, *([1] * (value.dim() - 1)))  # [B, 1(, 1)]
        out = torch.where(rows, value, out)
    return out


def accept_probs(p, q, x, w, policy: PolicyBatch | None, kinds) -> torch.Tensor:
    """Acceptance probability of each draft token under its row's policy. `[B, M]`."""
    return _per_row(_ACCEPT, policy, kinds, p, q, x, w)


def residuals(p, q, w, policy: PolicyBatch | None, kinds) -> torch.Tensor:
    """Unnormalised correction distributions. `[B, M, V]`."""
    return _per_row(_RESIDUAL, policy, kinds, p, q, w)


def greedy_targets(p, q, w, policy: PolicyBatch | None, kinds) -> torch.Tensor:
    """Distributions whose argmax is each row's temperature-0 verdict. `[B, M, V]`."""
    return _per_row(_GREEDY, policy, kinds, p, q, w)
