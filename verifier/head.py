"""The learned ensemble-weight head (DIVERSED), conditioned on the quality dial.

Terms
    h_draft   `[R, N, Hd]` final-norm draft hidden states at the positions that produced each draft
              token (the draft's LM-head inputs).
    h_target  `[R, N, Ht]` final-norm target hidden states at the positions scoring each draft token.
    dial      `[R]` the request's dial d in [0, 1] (`VerifyOptions.dial`; see verifier/dial.py).
              Low d asks for speed (more acceptance), high d for fidelity to the target.
    w         `[R, N]` the per-token ensemble weight on the target, `ν_t = w_t·p_t + (1 − w_t)·q_t`.
    pair      the draft/target checkpoints a head was trained for; a head is only meaningful on the
              hidden states of that exact pair, so its config records the pair's name, hidden sizes
              and a fingerprint (sha256 over the pair's weight files) and loading checks them.

Model: `w = sigmoid(a·concat(z, φ(d)) + b)` — the paper's linear head plus dial features
`φ(d) = [d, d², 4d(1−d)]`, so one head serves the whole dial. `z` is `concat(h_draft, h_target)`
standardised per feature (`shift`/`scale` buffers, set once from rollout states by `calibrate`) and
divided by sqrt(Hd + Ht), so ||z|| ≈ 1 and one learning rate suits the hidden-state weights, the dial
weights and the bias alike. With `hidden > 0` a one-layer MLP (SiLU) precedes the output unit. The
output unit starts at zero weight and bias: w = 0.5 at init.

Saving, loading and the pair fingerprint live in `server/engine/head_store.py`: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verifier.dial import DEFAULT_AUTO_DIAL

NUM_DIAL_FEATURES = 3


@dataclass(frozen=True)
class HeadConfig:
    """Shape of a head and the pair it belongs to."""

    draft_hidden: int
    target_hidden: int
    hidden: int = 0  # 0: the paper's linear head; > 0: one SiLU hidden layer of this width
    dial_conditioned: bool = True
    pair_name: str = ""
    pair_fingerprint: str = ""  # sha256 over the pair's weight files ("" = unchecked)
    default_dial: float = DEFAULT_AUTO_DIAL  # the dial `quality: "auto"` uses (servers may override)


def dial_features(dial: torch.Tensor) -> torch.Tensor:
    """φ(d) `[R] -> [R, 3]`: [d, d², 4d(1−d)] — linear, convex and a bump peaking mid-dial."""
    d = dial.float().clamp(0.0, 1.0)
    return torch.stack([d, d * d, 4.0 * d * (1.0 - d)], dim=-1)


class WeightHead(nn.Module):
    """`head(h_draft [R,N,Hd], h_target [R,N,Ht], dial [R]) -> w [R,N]` in [0, 1]."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        states = config.draft_hidden + config.target_hidden
        width = states + (NUM_DIAL_FEATURES if config.dial_conditioned else 0)
        self.register_buffer("shift", torch.zeros(states))  # [Hd+Ht] per-feature mean
        self.register_buffer("scale", torch.ones(states))  # [Hd+Ht] per-feature std
        self.hidden = nn.Linear(width, config.hidden) if config.hidden > 0 else None
        self.out = nn.Linear(config.hidden if config.hidden > 0 else width, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @torch.no_grad()
    def calibrate(self, h_draft: torch.Tensor, h_target: torch.Tensor) -> None:
        """Set the standardisation from sample states `[..., Hd]`, `[..., Ht]` (w is unchanged)."""
        x = torch.cat([h_draft.float(), h_target.float()], dim=-1).flatten(0, -2)  # [M, Hd+Ht]
        self.shift.copy_(x.mean(0))
        self.scale.copy_(x.std(0).clamp_min(1e-3) if x.shape[0] > 1 else torch.ones_like(self.scale))

    def features(self, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor):
        """Inputs `[R, N, Hd + Ht (+3)]` in float32."""
        c = self.config
        if h_draft.shape[:2] != h_target.shape[:2]:
            shapes = f"{tuple(h_draft.shape)} and {tuple(h_target.shape)}"
            raise ValueError(f"h_draft and h_target differ in [R, N]: {shapes}")
        if h_draft.shape[-1] != c.draft_hidden or h_target.shape[-1] != c.target_hidden:
            raise ValueError(
                f"head expects hidden sizes (draft {c.draft_hidden}, target {c.target_hidden}), "
                f"got ({h_draft.shape[-1]}, {h_target.shape[-1]})"
            )
        x = torch.cat([h_draft.float(), h_target.float()], dim=-1)  # [R, N, Hd+Ht]
        x = (x - self.shift) / self.scale / float(x.shape[-1]) ** 0.5
        if not c.dial_conditioned:
            return x
        r, n = x.shape[:2]
        phi = dial_features(dial.to(x.device)).view(r, 1, NUM_DIAL_FEATURES).expand(r, n, -1)
        return torch.cat([x, phi], dim=-1)

    def logit(self, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid score `[R, N]` (log-odds of w)."""
        x = self.features(h_draft, h_target, dial)  # [R, N, F]
        if self.hidden is not None:
            x = nn.functional.silu(self.hidden(x))  # [R, N, hidden]
        return self.out(x).squeeze(-1)  # [R, N]

    def forward(self, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(h_draft, h_target, dial))  # [R, N]
