"""Ensemble substitution for SGLang's chain rejection sampler, plus a pure-torch reference of it.

Terms (shapes on every tensor)
    B             rows (requests) in the verify batch; N draft length (`--speculative-num-steps`);
                  V vocabulary size. SGLang calls the N+1 verified slots "draft tokens".
    target_probs  `[B, N+1, V]` p: SGLang's target distribution per slot after penalties,
                  logit_bias, the grammar mask, temperature, top-k and top-p. Slot N scores the bonus.
    draft_probs   `[B, N, V]` q: the distribution each draft token was sampled from
                  (`EagleVerifyInput.draft_probs`, temperature-scaled softmax of the draft).
    logits        `[B, N+1, V]` the target logits as SGLang left them after penalties, logit_bias
                  and the grammar mask (edited in place by `eagle_sample`): −inf marks a token the
                  grammar or `min_new_tokens` forbids.
    bias          `[B, V]` SGLang's `sampling_info.logit_bias` or None; a bias ≤ −100 is a ban
                  (OpenAI's meaning), although SGLang only adds it to the target's logits.
    weights       `[B]` or `[B, N]` in [0, 1]: the ensemble weight w on the target.
    candidates    `[B, N+1]`: slot 0 is the last committed token, slots 1..N the drafts.

SGLang's `chain_speculative_sampling_triton` accepts draft i when `coin·q_i(x) < p_i(x)`,
samples the correction from `norm(max(0, p_k − q_k))` at the first rejection k, and the bonus
from `p_N` when all N are accepted. Handing it `ν̃_i` in place of p for slots 0..N−1 makes the
acceptance `min(1, ν̃/q)` and the residual `norm(max(0, ν̃ − q))`: rejection sampling with
proposal q and target ν̃, whose output law is exactly ν̃ for any q. ν̃ is the constrained
ensemble (DESIGN.md, "Constraints"): with m the allowed tokens, p̃ = p·m/Σp·m, q̃ = q·m/Σq·m,
ν̃ = w·p̃ + (1−w)·q̃ (`verifier.policies.ensemble_mix` of the masked laws), so no forbidden token
is accepted, corrected to or drawn at any w (if q puts no mass on allowed tokens, ν̃ = p̃). The
kernel keeps the unmasked q: it is what the drafts were drawn from.

Greedy rows (SGLang rewrites temperature 0 to `top_k = 1`, T = 1) arrive one-hot at argmax p
(top-1 renorm); they get one-hot at `argmax ν̃` from the full softmax instead, so the kernel
accepts while `x == argmax ν̃` and emits `argmax ν̃` at the first mismatch (bonus stays argmax p).

Memory: the work runs over blocks of at most a quarter of the B·N draft slots; a block needs one
float32 scratch of its size, a bool mask and, for greedy rows or log-probs, one more float32
buffer (about 13 bytes per element at most), so the passes' own peak stays within one
`[B, N, V]` float32 buffer when B·N ≥ 4 (tests/plugin_memory.py measures it). Rows with w = 1
everywhere are never written.

No SGLang import here: this module is pure torch so it runs and is tested on CPU.
"""

from __future__ import annotations

import torch

from verifier.policies import ensemble_mix

BAN_BIAS = -100.0  # OpenAI's logit_bias: -100 bans the token
_TINY = 1e-30  # guards 0/0 where all mass of a row is banned (the row is then not used)


def _weights_2d(weights: torch.Tensor, b: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """Broadcast `[B]` or `[B, N]` weights to `[B, N]` in `like`'s dtype and device."""
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device)
    if w.dim() == 1 and w.shape[0] == b:
        w = w.unsqueeze(1).expand(b, n)
    if tuple(w.shape) != (b, n):
        raise ValueError(f"weights must be [B]={b} or [B, N]={(b, n)}, got {tuple(w.shape)}")
    return w.clamp(0.0, 1.0)


def slot_blocks(b: int, n: int) -> list[tuple[slice, slice]]:
    """`(rows, slots)` blocks covering the `[B, N]` draft slots, each at most a quarter of them.
    Depends on shapes only, so the sequence of device ops is fixed for a batch size."""
    size = max(1, (b * n) // 4)
    if size >= n:
        rows = size // n
        return [(slice(i, min(i + rows, b)), slice(0, n)) for i in range(0, b, rows)]
    return [(slice(i, i + 1), slice(j, min(j + size, n))) for i in range(b) for j in range(0, n, size)]


def _banned(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`[b, n, V]` bool: tokens SGLang set to −inf, or whose logit_bias (`[b, 1, V]`) bans them."""
    banned = torch.isneginf(logits)
    if bias is not None:
        banned |= bias <= BAN_BIAS
    return banned


def _softmax_copy(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """float32 softmax(logits / T) in one new buffer (torch.softmax would need a second)."""
    x = logits.to(torch.float32, copy=True)
    if temperatures is not None:
        x.div_(temperatures)
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def _masked_draft(
    draft: torch.Tensor, banned: torch.Tensor | None, w: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """Write (1−w)·q̃ into `scratch` (`[b, n, V]`); returns the weight left on p̃ (`[b, n, 1]`):
    w, or 1 where q has no mass on allowed tokens (then ν̃ = p̃)."""
    scratch.copy_(draft)
    if banned is None:
        scratch.mul_(1.0 - w)
        return w
    scratch.masked_fill_(banned, 0.0)
    mass = scratch.sum(-1, keepdim=True)  # [b, n, 1]
    w = torch.where(mass > 0, w, torch.ones_like(w))
    scratch.mul_((1.0 - w) / mass.clamp_min(_TINY))
    return w


def nu_into_target_probs_(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    weights: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    any_greedy: bool = False,
) -> None:
    """In place: `target_probs[:, :N]` := ν̃ for sampled slots with w < 1, one-hot argmax ν̃ for
    greedy rows' slots with w < 1; every other entry (w = 1, slot N) is left bit-identical.

    `logits` `[B, N+1, V]` (SGLang's masked logits) and `bias` `[B, V]` give the constraint mask;
    without them nothing is masked. `greedy` `[B]` bool marks top_k = 1 rows; `any_greedy` (a host
    flag) skips their work when the batch has none.
    """
    b, n1, v = target_probs.shape
    n = n1 - 1
    if tuple(draft_probs.shape) != (b, n, v):
        raise ValueError(f"draft_probs must be [B, N, V]={(b, n, v)}, got {tuple(draft_probs.shape)}")
    if any_greedy and logits is None:
        raise ValueError("greedy rows need the target logits (their p arrives one-hot)")
    w_all = _weights_2d(weights, b, n, target_probs)  # [B, N]
    for rows, slots in slot_blocks(b, n):
        p = target_probs[rows, slots]  # [b, n, V] view
        w = w_all[rows, slots].unsqueeze(-1)  # [b, n, 1]
        banned = None
        if logits is not None:
            banned = _banned(logits[rows, slots], None if bias is None else bias[rows].unsqueeze(1))
        if banned is None:
            scratch, mass_p = torch.empty_like(p), None
        else:
            scratch = torch.where(banned, 0.0, p)  # p·m: only its mass is needed
            mass_p = scratch.sum(-1, keepdim=True)  # [b, n, 1]
        w = _masked_draft(draft_probs[rows, slots], banned, w, scratch)  # scratch = (1−w)·q̃
        top = None
        if any_greedy:
            p_full = _softmax_copy(logits[rows, slots]).masked_fill_(banned, 0.0)  # greedy: T = 1
            p_full.div_(p_full.sum(-1, keepdim=True).clamp_min(_TINY))
            top = p_full.mul_(w).add_(scratch).argmax(-1, keepdim=True)  # [b, n, 1] argmax ν̃
            del p_full
        scale = w if mass_p is None else w / mass_p.clamp_min(_TINY)
        scratch.addcmul_(p, scale)  # ν̃ = w·p̃ + (1−w)·q̃
        if banned is not None:
            scratch.masked_fill_(banned, 0.0)
        mix = w_all[rows, slots].unsqueeze(-1) < 1.0  # [b, n, 1]
        is_greedy = greedy[rows].view(-1, 1, 1) if greedy is not None else torch.zeros_like(mix)
        torch.where(mix & ~is_greedy, scratch, p, out=p)
        if top is not None:
            onehot = mix & is_greedy  # [b, n, 1]
            p.masked_fill_(onehot, 0.0).scatter_add_(-1, top, onehot.to(p.dtype))


def nu_logprob_logits_(
    logits: torch.Tensor,
    draft_probs: torch.Tensor,
    weights: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
) -> None:
    """In place: draft slots with w < 1 of `logits` `[B, N+1, V]` := T·log ν̃, ν̃ built from
    p = softmax(logits / T) (SGLang's log-prob distribution: before top-k/top-p). SGLang's
    `compute_spec_logprobs` takes log_softmax(x / T), and log_softmax(log ν̃) = log ν̃ as ν̃ sums
    to 1; masked tokens get −inf, as stock. Slot N and w = 1 slots are left untouched.
    """
    b, n1, v = logits.shape
    n = n1 - 1
    w_all = _weights_2d(weights, b, n, draft_probs.float())  # [B, N]
    temps = temperatures.reshape(b).to(torch.float32)  # [B]
    for rows, slots in slot_blocks(b, n):
        z = logits[rows, slots]  # [b, n, V] view, rewritten below
        t = temps[rows].view(-1, 1, 1)
        w = w_all[rows, slots].unsqueeze(-1)  # [b, n, 1]
        banned = _banned(z, None if bias is None else bias[rows].unsqueeze(1))
        scratch = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        w_p = _masked_draft(draft_probs[rows, slots], banned, w, scratch)  # (1−w)·q̃
        nu = _softmax_copy(z, t).masked_fill_(banned, 0.0)
        nu.mul_(w_p / nu.sum(-1, keepdim=True).clamp_min(_TINY)).add_(scratch)
        del scratch
        nu.log_().mul_(t)
        torch.where(w < 1.0, nu.to(z.dtype), z, out=z)


def mix_target_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Reference (out of place, unmasked): a new `[B, N+1, V]` with slots 0..N−1 replaced by
    ν = w·p + (1−w)·q and slot N kept. Rows with w = 1 come back bit-identical."""
    b, n1, v = target_probs.shape
    n = n1 - 1
    if tuple(draft_probs.shape) != (b, n, v):
        raise ValueError(f"draft_probs must be [B, N, V]={(b, n, v)}, got {tuple(draft_probs.shape)}")
    w = _weights_2d(weights, b, n, target_probs)  # [B, N]
    p = target_probs[:, :n]  # [B, N, V]
    q = draft_probs.to(target_probs.dtype)
    nu = torch.where((w >= 1.0).unsqueeze(-1), p, ensemble_mix(p, q, w.unsqueeze(-1)))  # [B, N, V]
    return torch.cat([nu, target_probs[:, n:]], dim=1)


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
