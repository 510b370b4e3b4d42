"""The bench's forced acceptance (`EmbeddedEngineConfig.forced_tv`), one stage after `round.check`:
random-weight pairs of real shapes accept almost nothing, so a timing engine replaces each round's
verdict by one at a real pair's acceptance (its arguments are the round's `RoundBatch`, `Drafts`,
`Scores` and `Outcome`, `round.py`)."""

from __future__ import annotations

import torch

from verifier import PolicyKind, pick_tokens


def force_acceptance(b, d, s, out, weights: list, tv: float) -> None:
    """The bench's forced acceptance (`EmbeddedEngineConfig.forced_tv`): the round's verdict,
    computed for real, is replaced by accepting draft i with probability 1 − w_i·TV (w = 1 for
    baseline policies) on the row's own verify coins; the token after the last accepted draft is
    drawn from p there. Random-weight pairs accept almost nothing, so the planner decodes plainly
    and the tiers' order at a real pair's acceptance (TV 0.1-0.3 for same-family pairs) stays
    hidden; with this every forward, the check and the bonus step still run at real size. The
    tokens follow neither p nor ν: for timing only, never for serving."""
    n = b.n
    if not n:
        return
    coins = b.u_verify[:, :n].tolist()  # [R][N]
    drafted = d.tokens.tolist()  # [R][N]
    ks, accept = [], []
    for row, u, w in zip(b.rows, coins, weights, strict=True):
        ensemble = row.policy.kind == PolicyKind.ENSEMBLE
        probs = [1.0 - (w[i] if ensemble else 1.0) * tv for i in range(n)]
        ks.append(next((i for i in range(n) if u[i] >= probs[i]), n))
        accept.append(probs)
    at = b.column(ks)  # [R]
    p = s.probs[torch.arange(b.size, device=b.device), at]  # [R, V] p after the accepted drafts
    last = pick_tokens(p, b.greedy, b.u_verify[:, n]).tolist()  # [R]
    for i, (row, k) in enumerate(zip(b.rows, ks, strict=True)):
        tested = min(k + 1, n)
        out.num_accepted[i] = k
        out.tokens[i] = drafted[i][:k] + [last[i]] + [-1] * (n - k)
        out.accept_probs[i] = accept[i][:tested]
        out.tv[i] = [] if row.greedy else [tv] * tested
