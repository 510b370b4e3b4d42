"""Exactly ν at the bonus position, and float precision at a real vocabulary size.

With the draft's q after its last proposal (`bonus_probs`), a chain whose N drafts are all
accepted emits its bonus from ν_{N+1} = w·p_{N+1} + (1−w)·q_{N+1}; without it (the lossless
shortcut) the bonus follows p_{N+1}. Each statistical case draws 200k seeded chains in one call
and applies a chi-square test at level ALPHA (tests/stats.py); the power checks show the same test
rejects the other law, so these checks can fail. w = 1 must not change by a single bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.stats import ALPHA, chi_square_pvalue
from verifier import Policy, PolicyBatch, PolicyKind, logits_to_probs, sample_inverse_cdf, verify

TRIALS = 200_000
VOCAB = 12
N = 2


def _laws(seed: int):
    """Position-specific p_1..p_3 and q_1..q_3 over a small vocabulary (float64, normalised)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(N + 1, VOCAB, generator=gen, dtype=torch.float64) ** 2
    q = torch.rand(N + 1, VOCAB, generator=gen, dtype=torch.float64) ** 2
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)  # [N+1, V] each


def _chains(p, q, w, seed, with_bonus_q=True):
    """Verify TRIALS stationary chains of N drafts x_i ~ q_i; returns (result, all_accepted)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([torch.multinomial(q[i].float(), TRIALS, True, generator=gen) for i in range(N)], 1)
    result = verify(
        p.float().expand(TRIALS, N + 1, VOCAB),
        q[:N].float().expand(TRIALS, N, VOCAB),
        x,
        w,
        bonus_probs=q[N].float().expand(TRIALS, VOCAB) if with_bonus_q else None,
        generator=gen,
    )
    return result, result.num_accepted == N


@pytest.mark.parametrize("w", [0.0, 0.5])
def test_bonus_token_is_nu(w):
    p, q = _laws(seed=int(10 * w) + 1)
    result, full = _chains(p, q, w, seed=3)
    assert int(full.sum()) > 20_000, "too few all-accepted chains for a meaningful test"
    if w == 0.0:
        assert bool(full.all()), "w = 0 accepts every draft"
    bonus = result.tokens[full, N]
    nu = w * p[N] + (1 - w) * q[N]
    assert chi_square_pvalue(bonus, nu) > ALPHA
    # Power: the same test rejects the target's law there (what the bonus followed before).
    assert chi_square_pvalue(bonus, p[N]) < 1e-12


def test_without_bonus_q_the_bonus_follows_p():
    """The lossless shortcut: exact at w = 1 only — at w = 0.5 the bonus is p, not ν."""
    p, q = _laws(seed=6)
    result, full = _chains(p, q, 0.5, seed=4, with_bonus_q=False)
    bonus = result.tokens[full, N]
    assert chi_square_pvalue(bonus, p[N]) > ALPHA
    assert chi_square_pvalue(bonus, 0.5 * p[N] + 0.5 * q[N]) < 1e-12


def test_no_drafts_with_q_draws_from_nu():
    """N = 0 with the draft's q: the one token is ν (rows with w < 1 that draft nothing)."""
    p, q = _laws(seed=7)
    gen = torch.Generator().manual_seed(5)
    w = 0.3
    r = verify(
        p[:1].float().expand(TRIALS, 1, VOCAB), torch.zeros(TRIALS, 0, VOCAB), torch.zeros(TRIALS, 0).long(),
        w, bonus_probs=q[0].float().expand(TRIALS, VOCAB), generator=gen,
    )  # fmt: skip
    assert chi_square_pvalue(r.tokens[:, 0], w * p[0] + (1 - w) * q[0]) > ALPHA


def test_w1_is_bit_identical_with_or_without_bonus_q():
    """Rows at w = 1 (any mix of greedy, sampling and baseline policies) emit the same tokens
    whether or not the draft's q at the bonus position is passed."""
    b, n, v = 64, 3, 50
    gen = torch.Generator().manual_seed(8)
    p = (2 * torch.randn(b, n + 1, v, generator=gen)).softmax(-1)  # [B, N+1, V]
    q = (2 * torch.randn(b, n + 1, v, generator=gen)).softmax(-1)  # [B, N+1, V]
    x = torch.multinomial(q[:, :n].reshape(-1, v), 1, generator=gen).view(b, n)  # [B, N]
    u = torch.rand(b, n + 1, generator=gen)  # [B, N+1]
    greedy = torch.arange(b) % 4 == 0
    policy = PolicyBatch.from_policies([Policy(kind=PolicyKind(i % 4)) for i in range(b)])
    for kw in ({}, {"policy": policy}):
        old = verify(p, q[:, :n], x, 1.0, greedy=greedy, uniforms=u, **kw)
        new = verify(p, q[:, :n], x, 1.0, bonus_probs=q[:, n], greedy=greedy, uniforms=u, **kw)
        assert torch.equal(old.tokens, new.tokens) and torch.equal(old.num_accepted, new.num_accepted)
    # Per-token weights: the w = 1 rows keep their tokens, the w < 1 rows may change.
    w = torch.where(torch.arange(b) % 2 == 0, 1.0, 0.2).view(-1, 1).expand(b, n + 1)  # [B, N+1]
    old = verify(p, q[:, :n], x, w[:, :n], uniforms=u)
    new = verify(p, q[:, :n], x, w, bonus_probs=q[:, n], uniforms=u)
    assert torch.equal(old.tokens[::2], new.tokens[::2])
    assert not torch.equal(old.tokens[1::2], new.tokens[1::2])


def test_per_token_weights_need_a_bonus_column():
    p = torch.full((2, 3, 4), 0.25)
    q = torch.full((2, 2, 4), 0.25)
    x = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[B, N\+1\]"):
        verify(p, q, x, torch.ones(2, 2), bonus_probs=torch.full((2, 4), 0.25))
    with pytest.raises(ValueError, match="bonus_probs"):
        verify(p, q, x, 1.0, bonus_probs=torch.full((2, 5), 0.2))


# -- precision at a real vocabulary ----------------------------------------------------------
V_REAL = 151_936


def _peaked_logits(seed: int) -> torch.Tensor:
    """A realistic LM row: a few likely tokens and a long tail (logits of std 3)."""
    gen = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(V_REAL, generator=gen)  # [V]


def test_top_p_one_keeps_every_token_next_to_a_row_that_cuts():
    """A top_p = 1 row batched with a top_p < 1 row gets the same probabilities as alone."""
    row = _peaked_logits(0)
    alone = logits_to_probs(row.unsqueeze(0), 1.0, 0, 1.0)[0]  # [V]
    batched = logits_to_probs(torch.stack([row, _peaked_logits(1)]), 1.0, 0, torch.tensor([1.0, 0.5]))[0]
    assert torch.equal(alone, batched)
    assert int((batched > 0).sum()) == V_REAL
    # Power: this row is one where a float32 running sum saturates, so the old rule cut its tail.
    sorted_probs = row.softmax(-1).sort(descending=True).values
    assert int(((sorted_probs.cumsum(-1) - sorted_probs) >= 1.0).sum()) > 0


def test_inverse_cdf_reaches_tail_tokens_a_float32_cdf_drops():
    """Tokens whose probability is below float32's resolution near 1 are still drawn where an
    exact CDF puts them (a float32 running sum gives them an empty interval)."""
    probs = _peaked_logits(2).softmax(-1).double()  # [V]
    cdf = probs.cumsum(-1)
    c32 = probs.float().cumsum(-1)
    empty = ((c32 - torch.cat([c32.new_zeros(1), c32[:-1]])) == 0) & (probs > 0)
    assert int(empty.sum()) > 100, "the case must exercise float32's resolution"
    tail = empty.nonzero().flatten()[:50]  # [K]
    u = ((cdf[tail] - probs[tail] / 2) / cdf[-1]).float()  # the middle of each token's exact interval
    # float32 coins cannot address intervals this narrow; the CDF must not lose them either.
    picked = sample_inverse_cdf(probs.float().expand(len(tail), V_REAL), u)
    exact = torch.searchsorted(cdf, (u.double() * cdf[-1]).unsqueeze(-1), right=True).squeeze(-1)
    assert torch.equal(picked, exact)
    assert bool((probs[picked] > 0).all())
