"""The learned ensemble-weight head (DIVERSED), conditioned on the quality dial.

Terms
    h_draft   `[R, N, Hd]` final-norm draft hidden states at the positions that produced each draft
              token (the draft's LM-head inputs).
    h_target  `[R, N, Ht]` final-norm target hidden states at the positions scoring each draft token.
    stats     `[R, N, 5]` `position_stats(p, q)`: the cheap confidence statistics the verifier has
              at every draft position anyway — max p, max q, H(p), H(q), TV(p, q).
    dial      `[R]` the request's dial d in [0, 1] (`Verification.dial`; see verifier/dial.py).
              Low d asks for speed (more acceptance), high d for fidelity to the target.
    w         `[R, N]` the per-token ensemble weight on the target, `ν_t = w_t·p_t + (1 − w_t)·q_t`.
    inputs    what a head reads: "states" (the paper's head), "stats", or "both".
    dial_interactions  whether a stats-reading head also reads `d · stats` (each standardised
              statistic times the dial), so the dial can rescale how the statistics are weighed,
              not only shift the threshold (see "Why interactions" below).
    pair      the draft/target checkpoints a head was trained for; a head is only meaningful on the
              hidden states of that exact pair, so its config records the pair's name, hidden sizes
              and a fingerprint (sha256 over the pair's weight files) and loading checks them.

Model: `w = sigmoid(a·concat(z, φ(d)) + b)` — the paper's linear head plus dial features
`φ(d) = [d, d², 4d(1−d)]`, so one head serves the whole dial. `z` holds the chosen inputs, each
block (states; stats) standardised per feature (`shift`/`scale` buffers, set once from rollouts by
`calibrate`) and divided by the square root of its width, so every block has norm ≈ 1 and one
learning rate suits the state weights, the stats weights, the dial weights and the bias alike.
With `hidden > 0` a one-layer MLP (SiLU) precedes the output unit. The output unit starts at zero
weight and bias: w = 0.5 at init.

Why stats: SpecCascade's rule is a per-token w ∈ {0, 1} from the models' confidences (defer to the
target when `max q < max p − α·TV`); a head with these statistics can represent that rule (and the
dial's threshold on it) linearly, which hidden states alone make hard to find in a few RL updates.
Why interactions: SpecCascade's margin α multiplies TV, so a family of cascades indexed by the dial,
`max p − max q − α(d)·TV > 0` with α linear in d, has a `d·TV` term. A linear head over
`[stats, φ(d)]` can only move the threshold with d; with `d · stats` it represents the family exactly
(training/distill.py distils it).
Why nothing about the sampled draft token (q(x), p(x)): w must be a function of the context only.
If w depended on x, the emitted token would no longer follow the ν of its w, and `Σ_t log ν_t(y_t)`
would no longer be the policy's likelihood that training differentiates.

Saving, loading and the pair fingerprint live in `server/engine/head_store.py`: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verifier.dial import DEFAULT_AUTO_DIAL

NUM_DIAL_FEATURES = 3
STAT_NAMES = ("max_p", "max_q", "entropy_p", "entropy_q", "tv")
HEAD_INPUTS = ("states", "stats", "both")
_TINY = 1e-30


def position_stats(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Context-only statistics `[..., 5]` of target p and draft q `[..., V]` at one position:
    max p, max q, entropy of p and of q (nats), TV(p, q). See the module docstring for what is
    deliberately left out."""
    p, q = p.float(), q.float()
    entropy_p = -(p * p.clamp_min(_TINY).log()).sum(-1)
    entropy_q = -(q * q.clamp_min(_TINY).log()).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return torch.stack([p.amax(-1), q.amax(-1), entropy_p, entropy_q, tv], dim=-1)


@dataclass(frozen=True)
class HeadConfig:
    """Shape of a head and the pair it belongs to."""

    draft_hidden: int
    target_hidden: int
    hidden: int = 0  # 0: the paper's linear head; > 0: one SiLU hidden layer of this width
    dial_conditioned: bool = True
    inputs: str = "states"  # "states" (the paper's), "stats" or "both"
    pair_name: str = ""
    pair_fingerprint: str = ""  # sha256 over the pair's weight files ("" = unchecked)
    default_dial: float = DEFAULT_AUTO_DIAL  # the dial `quality: "auto"` uses (servers may override)
    dial_interactions: bool = False  # also read d · stats (needs stats and dial conditioning)
    exact_at_full_dial: bool = False  # w = 1 exactly at d >= 1 (the dial's top is lossless SD)

    def __post_init__(self):
        if self.inputs not in HEAD_INPUTS:
            raise ValueError(f"HeadConfig.inputs must be one of {HEAD_INPUTS}, got {self.inputs!r}")
        if self.dial_interactions and not (self.uses_stats and self.dial_conditioned):
            raise ValueError("HeadConfig.dial_interactions needs a dial-conditioned head that reads stats")

    @property
    def uses_states(self) -> bool:
        return self.inputs in ("states", "both")

    @property
    def uses_stats(self) -> bool:
        return self.inputs in ("stats", "both")

    @property
    def input_width(self) -> int:
        states = self.draft_hidden + self.target_hidden if self.uses_states else 0
        return states + (len(STAT_NAMES) if self.uses_stats else 0)


def dial_features(dial: torch.Tensor) -> torch.Tensor:
    """φ(d) `[R] -> [R, 3]`: [d, d², 4d(1−d)] — linear, convex and a bump peaking mid-dial."""
    d = dial.float().clamp(0.0, 1.0)
    return torch.stack([d, d * d, 4.0 * d * (1.0 - d)], dim=-1)


class WeightHead(nn.Module):
    """`head(h_draft [R,N,Hd], h_target [R,N,Ht], dial [R], stats [R,N,5] | None) -> w [R,N]` in
    [0, 1]. `stats` is required exactly when `config.uses_stats`."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        inputs = config.input_width
        width = inputs + (NUM_DIAL_FEATURES if config.dial_conditioned else 0)
        width += len(STAT_NAMES) if config.dial_interactions else 0
        self.register_buffer("shift", torch.zeros(inputs))  # [F] per-feature mean
        self.register_buffer("scale", torch.ones(inputs))  # [F] per-feature std
        self.hidden = nn.Linear(width, config.hidden) if config.hidden > 0 else None
        self.out = nn.Linear(config.hidden if config.hidden > 0 else width, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def _raw(self, h_draft, h_target, stats) -> torch.Tensor:
        """The chosen inputs concatenated, unstandardised: `[..., F]` float32. A head that does not
        read states may be handed None for them (the engine skips gathering what is not read)."""
        c = self.config
        if not c.uses_states and (h_draft is None or h_target is None):
            if stats is None:
                raise ValueError(f"this head reads position stats [R, N, {len(STAT_NAMES)}]; got None")
            return stats.float()
        if h_draft.shape[:-1] != h_target.shape[:-1]:
            shapes = f"{tuple(h_draft.shape)} and {tuple(h_target.shape)}"
            raise ValueError(f"h_draft and h_target differ in [R, N]: {shapes}")
        if h_draft.shape[-1] != c.draft_hidden or h_target.shape[-1] != c.target_hidden:
            raise ValueError(
                f"head expects hidden sizes (draft {c.draft_hidden}, target {c.target_hidden}), "
                f"got ({h_draft.shape[-1]}, {h_target.shape[-1]})"
            )
        parts = [h_draft.float(), h_target.float()] if c.uses_states else []
        if c.uses_stats:
            if stats is None or stats.shape[:-1] != h_draft.shape[:-1]:
                got = None if stats is None else tuple(stats.shape)
                raise ValueError(f"this head reads position stats [R, N, {len(STAT_NAMES)}]; got {got}")
            parts.append(stats.float())
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def calibrate(self, h_draft: torch.Tensor, h_target: torch.Tensor, stats=None) -> None:
        """Set the standardisation from sample inputs (w is unchanged: the output starts at zero)."""
        x = self._raw(h_draft, h_target, stats).flatten(0, -2)  # [M, F]
        self.shift.copy_(x.mean(0))
        self.scale.copy_(x.std(0).clamp_min(1e-3) if x.shape[0] > 1 else torch.ones_like(self.scale))

    def features(self, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor, stats=None):
        """Inputs `[R, N, F (+3) (+5)]` in float32: each block standardised and scaled to norm ≈ 1;
        then φ(d), then (with `dial_interactions`) d times the stats block."""
        c = self.config
        x = (self._raw(h_draft, h_target, stats) - self.shift) / self.scale  # [R, N, F]
        states = c.draft_hidden + c.target_hidden if c.uses_states else 0
        blocks = [x[..., :states] / states**0.5] if states else []
        if c.uses_stats:
            blocks.append(x[..., states:] / len(STAT_NAMES) ** 0.5)
        x = torch.cat(blocks, dim=-1)
        if not c.dial_conditioned:
            return x
        r, n = x.shape[:2]
        phi = dial_features(dial.to(x.device)).view(r, 1, NUM_DIAL_FEATURES).expand(r, n, -1)  # [R, N, 3]
        if not c.dial_interactions:
            return torch.cat([x, phi], dim=-1)
        scaled_stats = phi[..., :1] * blocks[-1]  # [R, N, 5] d · (standardised stats)
        return torch.cat([x, phi, scaled_stats], dim=-1)

    def logit(self, h_draft, h_target, dial, stats=None) -> torch.Tensor:
        """Pre-sigmoid score `[R, N]` (log-odds of w)."""
        x = self.features(h_draft, h_target, dial, stats)  # [R, N, F]
        if self.hidden is not None:
            x = nn.functional.silu(self.hidden(x))  # [R, N, hidden]
        return self.out(x).squeeze(-1)  # [R, N]

    def forward(self, h_draft, h_target, dial, stats=None) -> torch.Tensor:
        w = torch.sigmoid(self.logit(h_draft, h_target, dial, stats))  # [R, N]
        if self.config.exact_at_full_dial:  # a sigmoid never reaches 1: pin the top of the dial
            top = dial.to(w.device).view(-1, 1) >= 1.0  # [R, 1]
            w = torch.where(top, torch.ones_like(w), w)
        return w


def wants_states(head) -> bool:
    """Whether `head` (a WeightHead or any callable) must be handed hidden states (else None)."""
    return bool(getattr(getattr(head, "config", None), "uses_states", True))


def wants_stats(head) -> bool:
    """Whether `head` (a WeightHead or any callable) must be handed position stats."""
    return bool(getattr(getattr(head, "config", None), "uses_stats", False))
