"""Ensemble substitution for SGLang's chain rejection sampler, plus a pure-torch reference of it.

Terms (shapes on every tensor)
    B             rows (requests) in the verify batch; N draft length (`--speculative-num-steps`);
                  V vocabulary size. SGLang calls the N+1 verified slots "draft tokens".
    target_probs  `[B, N+1, V]` p: SGLang's target distribution per slot after temperature,
                  top-k and top-p. Slot N scores the bonus token.
    draft_probs   `[B, N, V]` q: the distribution each draft token was sampled from
                  (`EagleVerifyInput.draft_probs`, temperature-scaled softmax of the draft).
    weights       `[B]` or `[B, N]` in [0, 1]: the ensemble weight w on the target, per row or
                  per draft position (learned head).
    candidates    `[B, N+1]`: slot 0 is the last committed token, slots 1..N the drafts.

SGLang's `chain_speculative_sampling_triton` accepts draft i when `coin·q_i(x) < p_i(x)`,
samples the correction from `norm(max(0, p_k − q_k))` at the first rejection k, and the bonus
from `p_N` when all N are accepted. Handing it `ν_i = w·p_i + (1−w)·q_i` for slots 0..N−1 (and
leaving slot N as p) makes the acceptance probability `min(1, ν/q)` and the residual
`norm(max(0, ν − q)) = norm(max(0, w·(p − q)))`, i.e. the DIVERSED rule, with no kernel change.

Greedy rows (SGLang rewrites temperature 0 to `top_k = 1`) see a one-hot p, so mixing there would
be wrong; instead the target logits at the draft slots are replaced by `log ν` computed from the
full softmax, so SGLang's argmax/top-1 machinery accepts while `x == argmax ν` and emits
`argmax ν` at the first mismatch (bonus stays `argmax p`).

No SGLang import here: this module is pure torch so it runs and is tested on CPU.
"""

from __future__ import annotations

import torch

from verifier.policies import ensemble_mix

# log(0) would give -inf rows that SGLang's NaN/inf probes flag; a tiny floor keeps argmax intact.
_LOG_FLOOR = 1e-30


def _weights_2d(weights: torch.Tensor, b: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """Broadcast `[B]` or `[B, N]` weights to `[B, N]` in `like`'s dtype and device."""
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device)
    if w.dim() == 1 and w.shape[0] == b:
        w = w.unsqueeze(1).expand(b, n)
    if tuple(w.shape) != (b, n):
        raise ValueError(f"weights must be [B]={b} or [B, N]={(b, n)}, got {tuple(w.shape)}")
    return w.clamp(0.0, 1.0)


def mix_target_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Return a new `[B, N+1, V]` with slots 0..N−1 replaced by ν = w·p + (1−w)·q; slot N kept.

    Rows with w = 1 come back bit-identical to the input (stock lossless SGLang).
    """
    b, n1, v = target_probs.shape
    n = n1 - 1
    if tuple(draft_probs.shape) != (b, n, v):
        raise ValueError(f"draft_probs must be [B, N, V]={(b, n, v)}, got {tuple(draft_probs.shape)}")
    w = _weights_2d(weights, b, n, target_probs)  # [B, N]
    p = target_probs[:, :n]  # [B, N, V]
    q = draft_probs.to(target_probs.dtype)
    nu = torch.where((w >= 1.0).unsqueeze(-1), p, ensemble_mix(p, q, w.unsqueeze(-1)))  # [B, N, V]
    return torch.cat([nu, target_probs[:, n:]], dim=1)


def greedy_nu_logits(
    target_logits: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """For greedy rows: `[B, N+1, V]` logits whose argmax at slots 0..N−1 is `argmax ν`.

    `target_logits` are raw target scores (greedy = temperature 1 after SGLang's rewrite). Slot N
    is returned unchanged so the bonus stays `argmax p`.
    """
    b, n1, v = target_logits.shape
    n = n1 - 1
    p = target_logits[:, :n].float().softmax(dim=-1)  # [B, N, V]
    w = _weights_2d(weights, b, n, p)  # [B, N]
    nu = ensemble_mix(p, draft_probs.float(), w.unsqueeze(-1))  # [B, N, V]
    mixed = nu.clamp_min(_LOG_FLOOR).log().to(target_logits.dtype)  # [B, N, V]
    return torch.cat([mixed, target_logits[:, n:]], dim=1)


def chain_rejection_reference(
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    coins: torch.Tensor,
    coins_final: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch restatement of SGLang 0.5.23's chain kernel (BLOCK_VERIFICATION off).

    `candidates [B, N+1]`, `target_probs [B, N+1, V]`, `draft_probs [B, N, V]`, `coins [B, N]`,
    `coins_final [B]`. Returns `(num_accepted [B], tokens [B, N+1])` where tokens holds the
    accepted drafts then the correction/bonus token, padded with -1. Semantics copied from the
    kernel's comments and control flow: draft i (slot i+1) is accepted iff `0 < q ≤ 1` and
    `coin_i·q_i(x) < p_i(x)`; the final token is drawn by inverse CDF with `coin_final` from
    `max(0, p_k − q_k)` (non-probability q treated as 0) at the first rejection k, or from `p_N`;
    a zero residual yields token V−1, as the kernel does.
    """
    b, n1 = candidates.shape
    n = n1 - 1
    v = target_probs.shape[-1]
    tokens = torch.full((b, n1), -1, dtype=torch.long)
    num_accepted = torch.zeros(b, dtype=torch.long)
    for r in range(b):
        k = 0
        while k < n:
            x = int(candidates[r, k + 1])
            p, q = float(target_probs[r, k, x]), float(draft_probs[r, k, x])
            if 0.0 < q <= 1.0 and float(coins[r, k]) * q < p:
                tokens[r, k] = x
                k += 1
            else:
                break
        num_accepted[r] = k
        if k == n:
            dist = target_probs[r, n].double()  # [V]
        else:
            q_row = draft_probs[r, k].double()
            q_row = torch.where((q_row >= 0) & (q_row <= 1), q_row, torch.zeros_like(q_row))
            dist = (target_probs[r, k].double() - q_row).clamp_min(0.0)
        cdf = dist.cumsum(0)
        target = float(coins_final[r]) * float(cdf[-1])
        hits = (cdf > target).nonzero()
        tokens[r, k] = int(hits[0]) if len(hits) else v - 1
    return num_accepted, tokens
