"""SpecCascade's α-family as a dial-conditioned ensemble-weight rule: targets, distillation, anchor.

Terms
    deferral score  `u_α = max p − max q − α·TV(p, q)` at one position. SpecCascade defers to the
                    target (π = p) where `u_α > 0`, else it takes the draft (π = q): exactly the
                    ensemble ν with w = 1 or w = 0. Because `|max p − max q| ≤ TV`, α ≥ 1 never
                    defers (all draft) and α ≤ −1 defers wherever p and q differ, except where
                    they share the mode and the draft is the more confident of the two.
    dial → α        `α(d) = 1 − 2d`: d = 0 is all draft (α = 1, static w = 0), d = 0.5 is
                    SpecCascade at α = 0 (defer iff the target is the more confident), and d → 1
                    tightens the margin to −1; d = 1 itself is exact (w = 1 everywhere). The
                    cascade's useful α ∈ [0, 0.5] is d ∈ [0.25, 0.5]; α(d) is decreasing, so the
                    head's acceptance falls as d rises, as the dial promises.
    cascade weight  `c_t(d) = 1[u_α(d) > 0]` (1 everywhere at d = 1): the weight SpecCascade at
                    α(d) would use at position t. It reads only max p, max q and TV — context
                    statistics (verifier.head.position_stats), never the sampled draft token.
    distillation    fit the head's w_t to c_t(d) over a grid of dials by binary cross-entropy
                    weighted by TV_t: how much w_t matters at t (acceptance `1 − w·TV`, bias
                    `(1 − w)·TV`); where p = q the rule is a tie and w has no effect.
    cascade gap     `mean_t w_t·TV_t − mean_t c_t(d)·TV_t` per rollout: how much less acceptance
                    the head buys than the cascade at α(d) would on the same positions — the RL
                    anchor (`TrainConfig.budget = "cascade"`), so RL trades score at the
                    cascade's acceptance instead of drifting along the frontier.
"""

from __future__ import annotations

import torch

from training.rollout import Forced

STAT_MAX_P, STAT_MAX_Q, STAT_TV = 0, 1, 4  # columns of verifier.head.position_stats


def cascade_alpha(dial: torch.Tensor) -> torch.Tensor:
    """α(d) = 1 − 2d `[B]` (see the module docstring)."""
    return 1.0 - 2.0 * dial.float()


def deferral_score(stats: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """`u_α = max p − max q − α·TV` `[B, T]` from position stats `[B, T, 5]` and α `[B]`."""
    s = stats.float()
    return s[..., STAT_MAX_P] - s[..., STAT_MAX_Q] - alpha.view(-1, 1) * s[..., STAT_TV]


def cascade_weights(stats: torch.Tensor, dial: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`c_t(d)` `[B, T]` in {0, 1}: SpecCascade's w at α(d) for per-rollout dials `[B]`
    (1 at d = 1, 0 at padding)."""
    defer = deferral_score(stats, cascade_alpha(dial)) > 0  # [B, T]
    defer = defer | (dial.view(-1, 1) >= 1.0)
    return (defer & mask).float()


def cascade_gap(w: torch.Tensor, forced: Forced, dial: torch.Tensor) -> torch.Tensor:
    """Per-rollout `mean_t (w_t − c_t(d))·TV_t` `[B]` for head weights `w` `[B, T]` (differentiable in w)."""
    c = cascade_weights(forced.stats, dial, forced.mask)  # [B, T]
    count = forced.mask.sum(1).clamp_min(1)  # [B]
    return ((w - c) * forced.tv * forced.mask).sum(1) / count


def _on_grid(forced: Forced, grid: tuple[float, ...]) -> tuple[Forced, torch.Tensor]:
    """`forced` repeated once per dial of `grid`, and the matching dials `[G·B]`."""
    b = forced.mask.shape[0]
    dial = torch.tensor(grid, dtype=torch.float32).repeat_interleave(b)  # [G·B]
    return Forced.cat([forced] * len(grid)), dial


@torch.no_grad()
def _solve_linear_rule(head, rep: Forced, dial: torch.Tensor, sharpness: float) -> None:
    """Set a linear head's output unit so its logit is `sharpness·u_α(d)` (least squares over the
    positions of dials d < 1). The rule is linear in the head's features (stats and d·stats), so the
    fit is exact up to rounding; BCE alone gets there only slowly, its targets being separable."""
    rows = dial < 1.0  # [G·B]; d = 1 ("defer everywhere") is no single α: BCE handles it
    keep = rep.mask & rows.view(-1, 1)  # [G·B, T]
    x = head.features(rep.h_draft, rep.h_target, dial, rep.stats)[keep].double()  # [M, F]
    y = sharpness * deferral_score(rep.stats, cascade_alpha(dial))[keep].double()  # [M]
    a = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)  # [M, F + 1]
    sol = torch.linalg.lstsq(a, y.unsqueeze(1), driver="gelsd").solution[:, 0]  # [F + 1]
    head.out.weight.copy_(sol[:-1].float().view_as(head.out.weight))
    head.out.bias.copy_(sol[-1:].float())


def distil_cascade(
    head, forced: Forced, grid: tuple[float, ...], steps: int, lr: float, sharpness: float = 300.0
) -> float:
    """Fit `head` (one that reads position stats) to `c_t(d)` on every dial of `grid`: a linear head
    starts from the least-squares solution of logit = sharpness·u_α(d) (with dial interactions,
    the rule itself); then TV-weighted BCE with Adam, full batch. Returns the final weighted BCE."""
    rep, dial = _on_grid(forced, grid)
    if head.hidden is None:
        _solve_linear_rule(head, rep, dial, sharpness)
    target = cascade_weights(rep.stats, dial, rep.mask)  # [G·B, T]
    weight = rep.tv * rep.mask  # [G·B, T]
    total = weight.sum().clamp_min(1e-12)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    value = torch.zeros(())
    for _ in range(steps):
        logit = head.logit(rep.h_draft, rep.h_target, dial, rep.stats)  # [G·B, T]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, target, reduction="none")
        value = (bce * weight).sum() / total
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
    return float(value.detach())


@torch.no_grad()
def rule_agreement(head, forced: Forced, grid: tuple[float, ...]) -> dict[float, float]:
    """Per dial: TV-weighted mean of `1 − |w_t − c_t(d)|`, how closely the head follows the
    cascade at α(d) where it matters (1 = the cascade's own weights)."""
    rep, dial = _on_grid(forced, grid)
    w = head(rep.h_draft, rep.h_target, dial, rep.stats)  # [G·B, T]
    target = cascade_weights(rep.stats, dial, rep.mask)  # [G·B, T]
    weight = rep.tv * rep.mask  # [G·B, T]
    b = forced.mask.shape[0]
    out = {}
    for i, d in enumerate(grid):
        rows = slice(i * b, (i + 1) * b)
        agree = ((1.0 - (w[rows] - target[rows]).abs()) * weight[rows]).sum()
        out[d] = float(agree / weight[rows].sum().clamp_min(1e-12))
    return out
