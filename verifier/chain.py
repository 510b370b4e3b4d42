"""Batched chain verification of N draft tokens against a target — the heart of dialspec.

See `verify` for terms, shapes and the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier.dial import PolicyKind
from verifier.policies import (
    PolicyBatch,
    accept_probs,
    ensemble_mix,
    greedy_targets,
    kinds_present,
    residuals,
)
from verifier.sampling import pick_tokens, sample_inverse_cdf

PAD_TOKEN = -1
# Below this residual mass p and q agree to float precision; sampling the residual would amplify
# rounding noise, and the exact answer (p == q there) is to sample p.
_RESIDUAL_FLOOR = 1e-9


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [B] long, accepted drafts in [0, N]
    tokens: torch.Tensor  # [B, N+1] long: accepted drafts, then the correction/bonus, then PAD_TOKEN
    accept_probs: torch.Tensor  # [B, N] acceptance probability per position (0/1 for greedy rows)

    @property
    def num_emitted(self) -> torch.Tensor:  # [B]
        return self.num_accepted + 1


def _check_shapes(target_probs, draft_probs, draft_tokens, uniforms, bonus_probs):
    if target_probs.dim() != 3 or draft_probs.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(
            "expected target_probs [B, N+1, V], draft_probs [B, N, V], draft_tokens [B, N]; got "
            f"{tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, {tuple(draft_tokens.shape)}"
        )
    b, n, v = draft_probs.shape
    if tuple(target_probs.shape) != (b, n + 1, v):
        raise ValueError(
            f"target_probs must be [B, N+1, V] = {(b, n + 1, v)}, got {tuple(target_probs.shape)}"
        )
    if tuple(draft_tokens.shape) != (b, n):
        raise ValueError(f"draft_tokens must be [B, N] = {(b, n)}, got {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if uniforms is not None and tuple(uniforms.shape) != (b, n + 1):
        raise ValueError(f"uniforms must be [B, N+1] = {(b, n + 1)}, got {tuple(uniforms.shape)}")
    if bonus_probs is not None and tuple(bonus_probs.shape) != (b, v):
        raise ValueError(f"bonus_probs must be [B, V] = {(b, v)}, got {tuple(bonus_probs.shape)}")


def _broadcast(weights, greedy, b: int, n: int, like: torch.Tensor, bonus: bool):
    """weights -> `[B, N+1]` (column N: the bonus position), greedy -> `[B]` bool (shape errors
    only; no host sync). Per-token `[B, N]` weights have no bonus column, so they are refused when
    the bonus is drawn from ν (`bonus`); without it column N is never read."""
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device)
    if w.dim() == 0:
        w = w.expand(b, n + 1)
    elif w.dim() == 1 and w.shape[0] == b:
        w = w.unsqueeze(1).expand(b, n + 1)
    elif tuple(w.shape) == (b, n) and not bonus and n > 0:
        w = torch.cat([w, w[:, -1:]], dim=1)  # the copied column is never used
    elif tuple(w.shape) != (b, n + 1):
        shapes = f"[B, N+1]={(b, n + 1)}" if bonus else f"[B, N]={(b, n)} or [B, N+1]={(b, n + 1)}"
        raise ValueError(f"weights must be a float, [B]={b} or {shapes}, got {tuple(w.shape)}")
    g = torch.as_tensor(greedy, dtype=torch.bool, device=like.device)
    g = g.expand(b) if g.dim() == 0 else g
    if tuple(g.shape) != (b,):
        raise ValueError(f"greedy must be a bool or [B]={b} bools, got {tuple(g.shape)}")
    return w, g


def _check_values(draft_tokens: torch.Tensor, w: torch.Tensor, vocab: int) -> None:
    """Token range and weight range in one host sync (the checks run on every decoding round)."""
    bad_tokens = ((draft_tokens < 0) | (draft_tokens >= vocab)).any()
    bad_weights = (torch.isnan(w) | (w < 0) | (w > 1)).any()
    bad_tokens, bad_weights = torch.stack([bad_tokens, bad_weights]).tolist()
    if bad_tokens:
        raise ValueError(f"draft_tokens must lie in [0, {vocab})")
    if bad_weights:
        raise ValueError("weights must lie in [0, 1] (no NaN)")


def verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    weights=1.0,
    *,
    bonus_probs: torch.Tensor | None = None,
    policy: PolicyBatch | None = None,
    greedy=False,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    validate: bool = True,
) -> VerifyResult:
    """Verify a batch of draft chains against the ensemble ν = w·p + (1−w)·q (or a baseline policy).

    Terms (shapes on every tensor)
        B               rows in the batch (requests), N draft length, V vocabulary size.
        target_probs    `[B, N+1, V]` p: the target's distribution at each draft position and, at
                        index N, after the last draft (for the bonus token).
        draft_probs     `[B, N, V]`   q: the draft's distribution each draft token was sampled from.
        draft_tokens    `[B, N]`      x_i ~ q_i, the proposed tokens.
        weights         float, `[B]`, `[B, N]` or `[B, N+1]`: the ensemble weight w on the target (per
                        row, or per token when a learned head predicts w_t; column N is the bonus
                        position). Verification is against `ν = w·p + (1−w)·q`; w = 1 is exact
                        speculative decoding, w = 0 accepts every draft. Ignored by rows whose
                        policy is not ENSEMBLE.
        bonus_probs     optional `[B, V]` q at position N+1: the draft's distribution after its last
                        proposal (one more draft step). With it the bonus token is drawn from
                        `ν_{N+1} = w·p_N + (1−w)·q_bonus`, so *every* emitted position is exactly ν;
                        without it the bonus is drawn from p_N (exact only at w = 1, where both
                        agree bit for bit). Per-token weights must then be `[B, N+1]`. Rows whose
                        policy is not ENSEMBLE keep p_N (their output is not a ν).
        policy          optional `PolicyBatch` (per-row baseline policies); None = ensemble for all.
        greedy          bool or `[B]` bool: temperature-0 rows accept while `x_i == argmax ν_i`, emit
                        `argmax ν` at the first mismatch, and the argmax of the bonus distribution.
        uniforms        optional `[B, N+1]` in [0, 1): row b's coins for the N acceptance tests and
                        the final draw. Pass per-request streams here for batch-invariant seeding;
                        otherwise they are drawn from `generator`.
        validate        check token and weight ranges (one host sync). Engines that build their
                        inputs themselves may pass False on the hot path; shapes are always checked.

    Algorithm (sampling rows): accept x_i with probability `a_i` (policy-defined; for the ensemble
    `min(1, ν(x_i)/q(x_i))`) until the first rejection k; emit x_1..x_k, then one token from
    `norm(residual_k)` (`norm(max(0, p_k − q_k))` for the ensemble; p_k when that mass is ~0), or,
    if all N were accepted, the bonus: from `ν_{N+1} = w·p_N + (1−w)·bonus_probs` when
    `bonus_probs` is given, else from p_N, which is ν only where w = 1. Each accepted draft and
    correction is distributed exactly as ν; the bonus is too given `bonus_probs` (or w = 1).

    Returns `VerifyResult`: `num_accepted` `[B]` (accepted drafts, in [0, N]), `tokens` `[B, N+1]`
    (accepted drafts, then the one correction or bonus token, then PAD_TOKEN = -1) and
    `accept_probs` `[B, N]` (acceptance probability per position; 0/1 on greedy rows — for metrics
    and training). Raises ValueError naming the offending argument on bad shapes, tokens or weights.
    """
    _check_shapes(target_probs, draft_probs, draft_tokens, uniforms, bonus_probs)
    if policy is not None and policy.batch_size != draft_probs.shape[0]:
        raise ValueError(f"policy has {policy.batch_size} rows, batch has {draft_probs.shape[0]}")
    b, n, vocab = draft_probs.shape
    w_all, greedy_rows = _broadcast(weights, greedy, b, n, target_probs, bonus_probs is not None)
    if validate:
        _check_values(draft_tokens, w_all, vocab)
    p_bonus = target_probs[:, n]  # [B, V]
    if bonus_probs is not None:
        p_bonus = _bonus_dist(p_bonus, bonus_probs, w_all[:, n], policy)
    if n == 0:  # nothing to accept: one token from the bonus distribution (or its argmax)
        return _no_drafts(p_bonus, greedy, generator, uniforms)
    w = w_all[:, :n]  # [B, N]
    device = target_probs.device
    if uniforms is None:
        uniforms = torch.rand(b, n + 1, generator=generator, device=device)
    x = draft_tokens.long()
    p, q = target_probs[:, :n], draft_probs  # [B, N, V] each
    kinds = kinds_present(policy)
    # A Python bool needs no sync; a per-row mask is checked once, so all-sampling batches never
    # build the [B, N, V] greedy targets.
    num_greedy = int(greedy_rows.sum()) if isinstance(greedy, torch.Tensor) else b * bool(greedy)
    any_greedy, all_greedy = num_greedy > 0, num_greedy == b

    accept_prob = accept_probs(p, q, x, w, policy, kinds)  # [B, N]
    accepted = uniforms[:, :n] < accept_prob  # [B, N]
    if any_greedy:
        greedy_pick = greedy_targets(p, q, w, policy, kinds).argmax(-1)  # [B, N]
        accepted = torch.where(greedy_rows.unsqueeze(-1), x == greedy_pick, accepted)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    # The one extra token: the correction at the first rejection k, else the bonus (ν_{N+1} or p_N).
    all_accepted = num_accepted == n  # [B]
    rows = torch.arange(b, device=device)
    k = num_accepted.clamp(max=n - 1)  # [B]
    p_k, q_k, w_k = p[rows, k].unsqueeze(1), q[rows, k].unsqueeze(1), w[rows, k].unsqueeze(1)
    res_k = residuals(p_k, q_k, w_k, policy, kinds)[:, 0]  # [B, V]
    res_k = torch.where(res_k.sum(-1, keepdim=True) <= _RESIDUAL_FLOOR, p_k[:, 0], res_k)
    final_dist = torch.where(all_accepted.unsqueeze(-1), p_bonus, res_k)  # [B, V]
    greedy_final = torch.where(all_accepted, p_bonus.argmax(-1), greedy_pick[rows, k]) if any_greedy else None
    if all_greedy:
        final = greedy_final
    else:
        final = sample_inverse_cdf(final_dist, uniforms[:, n])  # [B]
        if any_greedy:
            final = torch.where(greedy_rows, greedy_final, final)

    positions = torch.arange(n + 1, device=device).unsqueeze(0)  # [1, N+1]
    padded_drafts = torch.cat([x, x.new_full((b, 1), PAD_TOKEN)], dim=1)  # [B, N+1]
    tokens = torch.where(positions < num_accepted.unsqueeze(-1), padded_drafts, PAD_TOKEN)
    tokens = torch.where(positions == num_accepted.unsqueeze(-1), final.unsqueeze(-1), tokens)
    if any_greedy:
        accept_prob = torch.where(greedy_rows.unsqueeze(-1), accepted.to(accept_prob.dtype), accept_prob)
    return VerifyResult(num_accepted=num_accepted, tokens=tokens, accept_probs=accept_prob)


def _bonus_dist(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor, policy: PolicyBatch | None):
    """ν at the bonus position `[B, V]` from p, q `[B, V]` and w `[B]`; rows of other policies keep
    p. At w = 1 this is `1·p + 0·q`, equal to p bit for bit."""
    nu = ensemble_mix(p, q, w.unsqueeze(-1))  # [B, V]
    if policy is None or policy.kinds == {PolicyKind.ENSEMBLE}:
        return nu
    return torch.where((policy.kind == PolicyKind.ENSEMBLE).unsqueeze(-1), nu, p)


def _no_drafts(p: torch.Tensor, greedy, generator, uniforms) -> VerifyResult:
    """N = 0: one token per row from `[B, V]` (p, or ν when the draft's q was given) with the row's
    first coin — what the general path computes when there is no draft, without its [B, N, V]
    machinery (it runs every AR step)."""
    b = p.shape[0]
    u = uniforms[:, 0] if uniforms is not None else torch.rand(b, generator=generator, device=p.device)
    if not isinstance(greedy, bool):
        greedy = torch.as_tensor(greedy, dtype=torch.bool, device=p.device).expand(b)
    token = pick_tokens(p, greedy, u)  # [B]
    return VerifyResult(
        num_accepted=torch.zeros(b, dtype=torch.long, device=p.device),
        tokens=token.unsqueeze(1),  # [B, 1]
        accept_probs=p.new_zeros(b, 0),  # [B, 0]
    )
