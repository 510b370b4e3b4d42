"""REINFORCE++ training of the dial-conditioned weight head (docs/algorithm.md).

Terms
    policy      speculative decoding with the ensemble verifier and head weights w_t emits exactly
                `ν_t = w_t·p_t + (1 − w_t)·q_t` at each position, so a rollout y has log-likelihood
                `Σ_t log ν_t(y_t)` — differentiable in the head's parameters only (the pair is frozen;
                its per-position quantities come from `rollout.teacher_force`).
    dial d      sampled per rollout from `TrainConfig.dials`; the head sees it as an input and the
                reward's acceptance weight depends on it: `λ(d) = λ_min + (λ_max − λ_min)·(1 − d)`,
                so a low dial buys acceptance and a high dial buys task score.
    reward      `r = score(y) + λ(d)·acc(y) − μ·gap(y)²` with `acc(y) = mean_t(1 − w_t·TV(p_t, q_t))`
                (λ > 0: more acceptance is better).
    budget gap  `gap = mean_t(w_t·TV_t) − d·mean_t(TV_t)`: how much less acceptance the head buys
                than the static ensemble at w = d would on the same positions. The μ term anchors
                the dial (beyond the paper): at dial d the head spends the acceptance budget of
                static w = d, and the task reward decides *where* to spend it — so its points are
                directly comparable with the static frontier. μ = 0 gives the plain paper reward.
                `budget="weight"` anchors `mean_t w_t` to d instead: its gradient is the same at
                every position, so it leaves the choice of *where* to put w to the task reward.
                `budget="cascade"` anchors the acceptance to SpecCascade's at α(d) on the same
                positions (`training.distill.cascade_gap`), for heads distilled from that family.
    objective   `J = E[score] + E[λ(d)·acc − μ·gap²]` — the "regularised objective". Its gradient
                has a score-function part (REINFORCE on r, with PPO-style clipping) and, because
                acc and gap are explicit functions of w, a pathwise part added directly.
    group       `group_size` consecutive rollouts share one prompt and one dial (different seeds);
                with g > 1 each reward is first centred on its group's mean (the REINFORCE++-baseline
                variant: prompt difficulty no longer masquerades as a good or bad policy).
    REINFORCE++ advantages `A = (r − mean r)/std r` over the global batch, broadcast to tokens;
                clipped ratio `min(ρA, clip(ρ, 1±ε)A)` with `ρ = exp(log ν_θ − log ν_old)`, and a
                token-level KL penalty `β·KL(ν_θ ‖ ν_ref)` (k3 estimator) to the initial head.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from training.distill import cascade_gap, distil_cascade
from training.rollout import Forced, expected_acceptance, nu_log_prob
from verifier.head import WeightHead, wants_stats


@dataclass
class TrainConfig:
    """Settings (paper: N=5, lr 5e-4 AdamW, warmup + cosine, clip 5, batch 8, ~100 updates).

    Scaled for 2 CPU cores and a few-million-parameter pair: 100 updates of 32 rollouts (8 prompts
    x 4 samples), lr 2e-2 (the head's inputs are standardised, see verifier.head), 64 new tokens.
    """

    target_path: str = ""
    draft_path: str = ""
    pair_name: str = ""
    out_dir: str = "models/embedded/head"  # the exported head
    run_dir: str = "runs/train"  # checkpoints and the training log
    tasks: tuple[str, ...] = ("math", "summary", "code")
    train_prompts: int = 96  # per task (train split)
    dev_prompts: int = 6  # per task (dev split), per evaluation
    dev_dials: tuple[float, ...] = (0.25, 0.75)
    dials: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    updates: int = 100
    batch: int = 32  # rollouts per update
    group_size: int = 4  # rollouts per prompt (and dial) within a batch; divides batch
    ppo_epochs: int = 2  # optimiser steps per rollout batch
    num_draft: int = 5
    max_tokens: int = 64  # the suite's references are <= ~40 tokens
    temperature: float = 1.0
    lr: float = 2e-2
    weight_decay: float = 0.0
    warmup: int = 4
    grad_clip: float = 5.0
    clip_eps: float = 0.2
    kl_coef: float = 0.01
    lambda_min: float = 0.02
    lambda_max: float = 0.2
    budget_coef: float = 20.0  # μ; 0 = the paper's reward without the dial anchor
    budget: str = "weight"  # anchor mean_t w_t ("weight") or mean_t w_t·TV_t ("acceptance") to d,
    # or mean_t w_t·TV_t to the cascade's at α(d) ("cascade", training.distill)
    warm_start_steps: int = 200  # pathwise-only fit of the regulariser before RL (0 = off)
    warm_start_lr: float = 5e-2
    dial_conditioned: bool = True
    head_hidden: int = 0
    head_inputs: str = "states"  # "states" (the paper's head), "stats" or "both" (verifier.head)
    # "regulariser", "cascade" (budget-matched, one α), "distil" (the α(d) family, training.distill),
    # or "auto": distil for heads with dial interactions, cascade for other stats heads
    warm_start: str = "auto"
    head_dial_interactions: bool = False  # the head also reads d · stats (verifier.head)
    head_exact_at_full_dial: bool = False  # the head's w is exactly 1 at d = 1 (verifier.head)
    distil_sharpness: float = 300.0  # the distil warm start's logit scale k: logit = k·u_α(d)
    cascade_alpha: float = 0.5  # the cascade warm start ranks positions by max p − max q − α·TV
    default_dial: float = 0.5
    eval_every: int = 20
    ckpt_every: int = 10
    seed: int = 0
    max_batch: int = 8
    extra: dict = field(default_factory=dict)


def acceptance_weight(cfg: TrainConfig, dial: torch.Tensor) -> torch.Tensor:
    """λ(d) `[B]`: λ_max at d = 0 down to λ_min at d = 1 (always > 0)."""
    return cfg.lambda_min + (cfg.lambda_max - cfg.lambda_min) * (1.0 - dial)


def regulariser(w: torch.Tensor, forced: Forced, dial: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """Per-rollout `λ(d)·acc − μ·gap²` `[B]` for head weights `w` `[B, T]` (differentiable in w)."""
    acc = expected_acceptance(w, forced)  # [B]
    count = forced.mask.sum(1).clamp_min(1)  # [B]
    if cfg.budget == "weight":  # allocation-neutral anchor: mean_t w_t = d
        gap = (w * forced.mask).sum(1) / count - dial  # [B]
    elif cfg.budget == "cascade":  # the cascade's acceptance at α(d) on these positions
        gap = cascade_gap(w, forced, dial)  # [B]
    else:  # acceptance anchor: mean_t w_t·TV_t = d·mean_t TV_t
        spent = (w * forced.tv * forced.mask).sum(1) / count  # [B] mean_t w_t·TV_t
        gap = spent - dial * (forced.tv * forced.mask).sum(1) / count  # [B]
    return acceptance_weight(cfg, dial) * acc - cfg.budget_coef * gap.square()


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Linear warmup then cosine decay to 10% over `cfg.updates` updates."""
    if step < cfg.warmup:
        return (step + 1) / max(1, cfg.warmup)
    span = max(1, cfg.updates - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span)))


def head_weights(head: WeightHead, forced: Forced, dial: torch.Tensor) -> torch.Tensor:
    """w `[B, T]` for teacher-forced states (padding positions get arbitrary but masked values)."""
    return head(forced.h_draft, forced.h_target, dial, forced.stats if wants_stats(head) else None)


@dataclass
class LossParts:
    loss: torch.Tensor
    policy: float
    kl: float
    acceptance: float
    clip_frac: float


def reinforce_pp_loss(
    head: WeightHead,
    forced: Forced,
    dial: torch.Tensor,  # [B]
    advantages: torch.Tensor,  # [B]
    old_logp: torch.Tensor,  # [B, T]
    ref_logp: torch.Tensor,  # [B, T]
    cfg: TrainConfig,
) -> LossParts:
    """Clipped policy-gradient + token KL − pathwise regulariser (mean over rollouts)."""
    w = head_weights(head, forced, dial)  # [B, T]
    logp = nu_log_prob(w, forced)  # [B, T]
    mask = forced.mask.float()
    tokens = mask.sum().clamp_min(1.0)
    ratio = torch.exp(logp - old_logp)  # [B, T]
    adv = advantages.view(-1, 1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    policy = -(surrogate * mask).sum() / tokens
    log_r = ref_logp - logp  # k3: exp(x) − x − 1 >= 0, x = log ν_ref − log ν_θ
    kl = ((torch.exp(log_r) - log_r - 1.0) * mask).sum() / tokens
    acc = expected_acceptance(w, forced)  # [B]
    pathwise = regulariser(w, forced, dial, cfg).mean()
    loss = policy + cfg.kl_coef * kl - pathwise
    clipped = ((ratio - 1).abs() > cfg.clip_eps).float()
    return LossParts(
        loss,
        float(policy.detach()),
        float(kl.detach()),
        float(acc.detach().mean()),
        float((clipped * mask).sum() / tokens),
    )


def dial_warm_start(head: WeightHead, forced: Forced, cfg: TrainConfig) -> float:
    """Fit the head to the regulariser alone on one batch of states, every dial on the grid.

    No sampling and no task reward: this only teaches the head what the dial means (spend the
    acceptance budget of static w = d), so RL starts from a head whose dial already works instead
    of spending its few noisy updates on it. Returns the final mean regulariser. The reference
    policy of the KL penalty is the head *after* this step.
    """
    if cfg.warm_start_steps <= 0 or not cfg.dial_conditioned:
        return float("nan")
    b, grid = forced.mask.shape[0], torch.tensor(cfg.dials, dtype=torch.float32)
    rep = Forced.cat([forced] * len(grid))  # [G·B, T, ...]
    dial = grid.repeat_interleave(b)  # [G·B]
    opt = torch.optim.Adam(head.parameters(), lr=cfg.warm_start_lr)
    value = torch.zeros(())
    for _ in range(cfg.warm_start_steps):
        value = regulariser(head_weights(head, rep, dial), rep, dial, cfg).mean()
        opt.zero_grad(set_to_none=True)
        (-value).backward()
        opt.step()
    return float(value.detach())


def cascade_targets(forced: Forced, dial: torch.Tensor, alpha: float) -> torch.Tensor:
    """Budget-matched SpecCascade decisions `[B, T]` in {0, 1} for per-rollout dials `[B]`.

    SpecCascade defers to the target (w = 1) where `max p − max q − α·TV > 0`. Here the score
    `u = max p − max q − α·TV` ranks positions and the threshold is the (1 − d)-quantile of u
    over the batch's positions, so at dial d a fraction d of positions defer: the static-w = d
    weight budget (the RL anchor's), spent where SpecCascade would spend it.
    """
    s = forced.stats  # [B, T, 5]: max p, max q, H(p), H(q), TV
    u = s[..., 0] - s[..., 1] - alpha * s[..., 4]  # [B, T]
    values = u[forced.mask]  # [M]
    out = torch.zeros_like(u)
    for d in dial.unique().tolist():
        rows = dial == d
        if d >= 1.0:
            out[rows] = 1.0
        elif d > 0.0:
            tau = torch.quantile(values, 1.0 - d)
            out[rows] = (u[rows] > tau).float()
    return out * forced.mask


def cascade_warm_start(head: WeightHead, forced: Forced, cfg: TrainConfig) -> float:
    """Distil budget-matched SpecCascade into the head (binary cross-entropy, every dial on the
    grid), so RL starts from a head that already defers where a cascade would. Returns the final
    mean BCE. Needs a head that reads position stats (a linear rule in them can express it)."""
    b, grid = forced.mask.shape[0], torch.tensor(cfg.dials, dtype=torch.float32)
    rep = Forced.cat([forced] * len(grid))  # [G·B, T, ...]
    dial = grid.repeat_interleave(b)  # [G·B]
    target = cascade_targets(rep, dial, cfg.cascade_alpha)  # [G·B, T]
    mask = rep.mask.float()
    opt = torch.optim.Adam(head.parameters(), lr=cfg.warm_start_lr)
    value = torch.zeros(())
    for _ in range(cfg.warm_start_steps):
        logit = head.logit(rep.h_draft, rep.h_target, dial, rep.stats)  # [G·B, T]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, target, reduction="none")
        value = (bce * mask).sum() / mask.sum().clamp_min(1.0)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
    return float(value.detach())


def warm_start(head: WeightHead, forced: Forced, cfg: TrainConfig) -> tuple[str, float]:
    """The configured warm start: (its name, its final loss/regulariser value)."""
    kind = cfg.warm_start
    if kind == "auto":
        kind = "cascade" if wants_stats(head) else "regulariser"
        kind = "distil" if getattr(head.config, "dial_interactions", False) else kind
    if kind in ("cascade", "distil") and not wants_stats(head):
        raise ValueError(f"the {kind} warm start needs a head that reads position stats")
    if kind == "cascade":
        return kind, cascade_warm_start(head, forced, cfg)
    if kind == "distil":
        steps, lr = cfg.warm_start_steps, cfg.warm_start_lr
        return kind, distil_cascade(head, forced, cfg.dials, steps, lr, cfg.distil_sharpness)
    if kind != "regulariser":
        raise ValueError(f"warm_start must be auto, regulariser, cascade or distil, got {kind!r}")
    return kind, dial_warm_start(head, forced, cfg)


def normalised_advantages(rewards: torch.Tensor, group_size: int = 1) -> torch.Tensor:
    """REINFORCE++: `(r − baseline)/std` over the global batch (zero when all rewards tie).

    The baseline is the batch mean, or with `group_size` g > 1 the mean of each run of g rollouts.
    """
    if group_size > 1:
        groups = rewards.view(-1, group_size)  # [B/g, g]
        rewards = (groups - groups.mean(1, keepdim=True)).flatten()
    centred = rewards - rewards.mean()
    std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
    return centred / (std + 1e-6) if float(std) > 1e-8 else torch.zeros_like(rewards)


def update_step(
    head: WeightHead,
    ref_head: WeightHead,
    optimizer: torch.optim.Optimizer,
    forced: Forced,
    dial: torch.Tensor,  # [B]
    scores: torch.Tensor,  # [B]
    cfg: TrainConfig,
) -> dict:
    """One REINFORCE++ update on a finished rollout batch; returns its statistics."""
    with torch.no_grad():
        w_old = head_weights(head, forced, dial)
        old_logp = nu_log_prob(w_old, forced)
        ref_logp = nu_log_prob(head_weights(ref_head, forced, dial), forced)
        acc_old = expected_acceptance(w_old, forced)  # [B]
        rewards = scores + regulariser(w_old, forced, dial, cfg)
        adv = normalised_advantages(rewards, cfg.group_size)
        w_mean = float((w_old * forced.mask).sum() / forced.mask.sum().clamp_min(1))
    parts = None
    for _ in range(cfg.ppo_epochs):
        parts = reinforce_pp_loss(head, forced, dial, adv, old_logp, ref_logp, cfg)
        optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip))
        optimizer.step()
    return {
        "reward": float(rewards.mean()),
        "score": float(scores.mean()),
        "acceptance": float(acc_old.mean()),
        "objective": float(rewards.mean()),
        "mean_w": w_mean,
        "kl": parts.kl,
        "clip_frac": parts.clip_frac,
        "grad_norm": grad_norm,
    }


def sample_dials(cfg: TrainConfig, step: int, n: int) -> torch.Tensor:
    """Per-rollout dial values `[n]`, deterministic in (seed, step): a shuffled cycle of the grid,
    one value per group of `group_size` rollouts."""
    rng = random.Random(f"dials:{cfg.seed}:{step}")
    groups = -(-n // cfg.group_size)
    grid = list(cfg.dials) * (groups // len(cfg.dials) + 1)
    rng.shuffle(grid)
    return torch.tensor(grid[:groups], dtype=torch.float32).repeat_interleave(cfg.group_size)[:n]
