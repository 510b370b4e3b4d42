"""Closed-form quantities of ensemble verification (docs/algorithm.md).

Terms
    p, q    target and draft distributions `[..., V]` (rows sum to 1).
    w       ensemble weight on the target; `ν = w·p + (1−w)·q`.
    TV      total-variation distance, `½·Σ|p − q|`.
    β_i     acceptance probability at draft position i.
    N       draft length.

Facts used across dialspec: per-position acceptance is `1 − w·TV(p, q)` and the bias of the
output is `TV(ν, p) = (1 − w)·TV(p, q)`, so acceptance loss plus bias is TV(p, q) at every w.
"""

from __future__ import annotations

import torch


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`½·Σ_v |p_v − q_v|` over the last dim. `[..., V] -> [...]`."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def tv_estimates(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One-draw estimates of TV(p, q) from tokens x ~ q: `1 − min(1, p(x)/q(x))`, unbiased since
    `E_q[min(1, p/q)] = Σ min(p, q) = 1 − TV`. p, q `[B, N, V]`, x `[B, N]` -> `[B, N]`.

    Engines get them from the drafts they verify anyway, at any w (the ensemble's own acceptance
    `1 − w·(1 − min(1, p/q))` hides TV when w = 0)."""
    px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, N]
    qx = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, N]
    return 1.0 - (px / qx.clamp_min(1e-20)).clamp(max=1.0)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor, w) -> torch.Tensor:
    """Probability a draft `x ~ q` is accepted against `ν`: `1 − w·TV(p, q)`. `[..., V] -> [...]`."""
    return 1.0 - torch.as_tensor(w, dtype=p.dtype, device=p.device) * tv_distance(p, q)


def ensemble_bias(p: torch.Tensor, q: torch.Tensor, w) -> torch.Tensor:
    """`TV(ν, p) = (1 − w)·TV(p, q)`. `[..., V] -> [...]`."""
    return (1.0 - torch.as_tensor(w, dtype=p.dtype, device=p.device)) * tv_distance(p, q)


def expected_accepted_length(beta: torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts per round, `Σ_{k=1..N} Π_{i≤k} β_i`, for independent positions.

    `beta`: `[..., N]` per-position acceptance probabilities -> `[...]`.
    """
    return beta.cumprod(dim=-1).sum(dim=-1)


def expected_accepted_length_constant(beta: float, n: int) -> float:
    """Same quantity for a constant β: `β(1 − β^N)/(1 − β)` (and N when β = 1)."""
    if beta >= 1.0:
        return float(n)
    return beta * (1.0 - beta**n) / (1.0 - beta)


def tokens_per_target_forward(expected_accepted: float) -> float:
    """Each verify round emits the accepted drafts plus one correction/bonus token: `1 + E`."""
    return 1.0 + expected_accepted


def acceptance_rate_from_length(expected_accepted: float, n: int) -> float:
    """Accepted draft tokens / proposed draft tokens (the paper's "acceptance rate")."""
    return expected_accepted / n


def cost_model_speedup(
    expected_accepted: float, n: int, t_draft: float, t_verify: float, t_target: float
) -> float:
    """Predicted speedup over target-only decoding.

    One round costs `N·t_draft + t_verify` (t_verify = one target forward over N+1 positions) and
    emits `1 + E` tokens; autoregressive decoding costs `t_target` per token.
    """
    round_time = n * t_draft + t_verify
    return tokens_per_target_forward(expected_accepted) * t_target / round_time
