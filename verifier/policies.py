"""Acceptance policies: how a draft token `x ~ q` is judged against the target `p`.

Every policy answers the same three questions for each draft position, as tensors:
    accept_prob `[B, N]`     probability of accepting the draft token there;
    residual    `[B, N, V]`  distribution to sample the correction from on the first rejection
                            (unnormalised is fine; rows with no mass fall back to p);
    greedy      `[B, N, V]`  distribution whose argmax is the verdict at temperature 0.

Policies (DESIGN.md section 1):
    ENSEMBLE  (DIVERSED) `ν = w·p + (1−w)·q`; accept `min(1, ν(x)/q(x)) = min(1, 1 − w + w·p/q)`;
              residual `max(0, ν − q) = w·max(0, p − q)`, i.e. the ordinary SD residual. w = 1 is
              lossless SD; a `[B, N]` weight tensor gives per-token weights from a learned head.
    LOSSY     Leviathan lenience `l ∈ (0, 1]`: accept `min(1, p/(l·q))`, residual `max(0, p − q)`.
    CASCADE   SpecCascade [OPT]: per position, defer to the target (π = p) if
              `max q < max p − α·TV(p, q)`, else π = q; accept `min(1, π/q)`, residual `max(0, π−q)`.
    TYPICAL   Medusa typical acceptance: accept iff `p(x) > min(ε, δ·exp(−H(p)))`; residual p.

A batch may mix policies row by row (`PolicyBatch.kind`); each kind present is evaluated over the
whole batch and selected with `torch.where`, which costs a few `[B, N, V]` element-wise passes and
no Python loop over rows.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifier.theory import tv_distance

# Guards divisions by q(x); q(x) of a sampled draft token is > 0 unless the caller lied.
_TINY = 1e-20


class PolicyKind(enum.IntEnum):
    ENSEMBLE = 0
    LOSSY = 1
    CASCADE = 2
    TYPICAL = 3


@dataclass(frozen=True)
class Policy:
    """One request's verification policy. The ensemble weight w travels separately (see verify)."""

    kind: PolicyKind = PolicyKind.ENSEMBLE
    lenience: float = 0.5  # LOSSY: l in (0, 1]; 1 is lossless
    alpha: float = 0.5  # CASCADE: deferral margin scale (>= 0)
    epsilon: float = 0.09  # TYPICAL: hard threshold (Medusa's posterior_threshold)
    delta: float = 0.3  # TYPICAL: entropy-scaled threshold (Medusa's posterior_alpha)

    def __post_init__(self):
        checks = {
            "lenience": 0.0 < self.lenience <= 1.0,
            "alpha": self.alpha >= 0.0,
            "epsilon": 0.0 <= self.epsilon <= 1.0,
            "delta": self.delta >= 0.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"Policy.{name}={getattr(self, name)!r} is out of range")


@dataclass(frozen=True)
class PolicyBatch:
    """Per-row policy parameters as tensors. All fields `[B]`."""

    kind: torch.Tensor  # long
    lenience: torch.Tensor
    alpha: torch.Tensor
    epsilon: torch.Tensor
    delta: torch.Tensor

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
        )

    @property
    def batch_size(self) -> int:
        return self.kind.shape[0]


def _token_prob(dist: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`dist[b, i, tokens[b, i]]`: `[B, N, V], [B, N] -> [B, N]`."""
    return dist.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def ensemble_verdict(p, q, x, w):
    """p, q `[B, N, V]`; x `[B, N]`; w `[B, N]`. Returns (accept_prob, residual, greedy)."""
    px, qx = _token_prob(p, x), _token_prob(q, x)  # [B, N]
    accept = (1.0 - w + w * px / qx.clamp_min(_TINY)).clamp(max=1.0)
    nu = w.unsqueeze(-1) * p + (1.0 - w.unsqueeze(-1)) * q  # [B, N, V]
    return accept, (p - q).clamp_min(0.0), nu


def lossy_verdict(p, q, x, lenience):
    """lenience `[B]`. Accept `min(1, p/(l·q))`; residual and greedy target are those of SD."""
    px, qx = _token_prob(p, x), _token_prob(q, x)
    accept = (px / (lenience.unsqueeze(-1) * qx).clamp_min(_TINY)).clamp(max=1.0)
    return accept, (p - q).clamp_min(0.0), p


def cascade_verdict(p, q, x, alpha):
    """alpha `[B]`. π = p where the draft is not confident enough relative to the target."""
    defer = q.amax(-1) < p.amax(-1) - alpha.unsqueeze(-1) * tv_distance(p, q)  # [B, N]
    pi = torch.where(defer.unsqueeze(-1), p, q)  # [B, N, V]
    accept = (_token_prob(pi, x) / _token_prob(q, x).clamp_min(_TINY)).clamp(max=1.0)
    return accept, (pi - q).clamp_min(0.0), pi


def typical_verdict(p, q, x, epsilon, delta):
    """epsilon, delta `[B]`. Deterministic accept/reject; resample from p on rejection."""
    entropy = -(p * p.clamp_min(_TINY).log()).sum(-1)  # [B, N]
    threshold = torch.minimum(epsilon.unsqueeze(-1), delta.unsqueeze(-1) * torch.exp(-entropy))
    accept = (_token_prob(p, x) > threshold).to(p.dtype)
    return accept, p, p


def verdicts(p, q, x, w, policy: PolicyBatch | None):
    """Evaluate each row's policy. Returns accept_prob `[B, N]`, residual and greedy `[B, N, V]`."""
    accept, residual, greedy = ensemble_verdict(p, q, x, w)
    if policy is None:
        return accept, residual, greedy
    present = set(policy.kind.unique().tolist())
    others = {
        PolicyKind.LOSSY: lambda: lossy_verdict(p, q, x, policy.lenience),
        PolicyKind.CASCADE: lambda: cascade_verdict(p, q, x, policy.alpha),
        PolicyKind.TYPICAL: lambda: typical_verdict(p, q, x, policy.epsilon, policy.delta),
    }
    for kind, compute in others.items():
        if kind not in present:
            continue
        rows = (policy.kind == kind).view(-1, 1)  # [B, 1]
        a, r, g = compute()
        accept = torch.where(rows, a, accept)
        residual = torch.where(rows.unsqueeze(-1), r, residual)
        greedy = torch.where(rows.unsqueeze(-1), g, greedy)
    return accept, residual, greedy
