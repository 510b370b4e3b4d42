"""ν substitution + SGLang's chain-kernel semantics reproduce the DIVERSED rule (CPU, pure torch).

`chain_rejection_reference` restates `chain_speculative_sampling_triton` (SGLang 0.5.23) in torch;
feeding it `mix_target_probs(p, q, w)` must emit, at every draft position it reaches, a token
distributed as ν = w·p + (1−w)·q, the bonus from p_N, and the same accept-count law as
`verifier.verify`. Checked by chi-square tests at α = 1e-4 each (seeded, so deterministic; the
family of ~10 tests has a false-alarm rate below 1e-3 by the union bound).
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from server.sglang_plugin.ensemble import (
    chain_rejection_reference,
    mix_target_probs,
    nu_into_target_probs_,
    slot_blocks,
)
from verifier.chain import verify

ALPHA = 1e-4
V, N, TRIALS = 6, 3, 20_000


def _dists(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(N + 1, V, generator=g) * 1.5, dim=-1)  # [N+1, V]
    q = torch.softmax(torch.randn(N, V, generator=g) * 1.5, dim=-1)  # [N, V]
    return p, q, g


def _gof(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value; bins with expected < 5 are merged into one."""
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep].double(), counts[~keep].double().sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] < 5:  # merged tail too small: fold it into the largest bin
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmax()] += counts[~keep].sum()
        exp[exp.argmax()] += expected[~keep].sum()
    return float(stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def _run_reference(p, q, w, g):
    x = torch.multinomial(q, TRIALS, replacement=True, generator=g).T  # [T, N], x_i ~ q_i
    cand = torch.cat([torch.zeros(TRIALS, 1, dtype=torch.long), x], dim=1)  # slot 0: last token
    tp = p.expand(TRIALS, N + 1, V)
    dp = q.expand(TRIALS, N, V)
    nu_tp = mix_target_probs(tp, dp, torch.full((TRIALS,), w))
    coins = torch.rand(TRIALS, N, generator=g)
    final = torch.rand(TRIALS, generator=g)
    acc, toks = chain_rejection_reference(cand, nu_tp, dp, coins, final)
    return x, acc, toks


@pytest.mark.slow
@pytest.mark.parametrize("w", [1.0, 0.6, 0.2])
def test_reference_with_nu_emits_nu_at_every_position(w):
    p, q, g = _dists(seed=int(w * 100))
    _, acc, toks = _run_reference(p, q, w, g)
    nu = w * p[:N] + (1 - w) * q  # [N, V]
    for j in range(N):
        reached = acc >= j  # token j is emitted iff drafts 0..j-1 were accepted
        counts = torch.bincount(toks[reached, j], minlength=V)
        assert _gof(counts, nu[j]) > ALPHA, f"position {j}: emitted tokens do not follow ν"
    bonus = toks[acc == N, N]
    if len(bonus) > 200:
        assert _gof(torch.bincount(bonus, minlength=V), p[N]) > ALPHA, "bonus token does not follow p_N"


@pytest.mark.slow
@pytest.mark.parametrize("w", [1.0, 0.5, 0.0])
def test_accept_counts_match_verifier_and_theory(w):
    p, q, g = _dists(seed=7)
    x, acc, _ = _run_reference(p, q, w, g)
    # The project's verifier on the same drafts (its own coins).
    res = verify(p.expand(TRIALS, N + 1, V), q.expand(TRIALS, N, V), x, weights=w, generator=g)
    ours = torch.bincount(acc, minlength=N + 1)
    theirs = torch.bincount(res.num_accepted, minlength=N + 1)
    # Theory: per-position acceptance β_i = 1 − w·TV(p_i, q_i), independent across positions here.
    beta = 1 - w * 0.5 * (p[:N] - q).abs().sum(-1)  # [N]
    law = torch.stack([beta[:k].prod() * ((1 - beta[k]) if k < N else 1) for k in range(N + 1)])
    if w == 0.0:
        assert int(ours[N]) == TRIALS == int(theirs[N])  # every draft accepted, by both
    else:
        assert _gof(ours, law) > ALPHA
        table = torch.stack([ours, theirs]).numpy()
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > ALPHA


def test_mix_target_probs_shapes_and_identity():
    p, q, _ = _dists(seed=3)
    tp, dp = p.expand(2, N + 1, V).clone(), q.expand(2, N, V).clone()
    out = mix_target_probs(tp, dp, torch.tensor([1.0, 0.25]))
    assert out.shape == tp.shape
    assert torch.equal(out[0], tp[0])  # w = 1: bit-identical to stock SGLang
    assert torch.allclose(out[1, :N], 0.25 * p[:N] + 0.75 * q)
    assert torch.equal(out[1, N], p[N])  # bonus slot untouched
    per_token = mix_target_probs(tp, dp, torch.tensor([[1.0, 0.0, 0.5], [0.5, 0.5, 0.5]]))
    assert torch.allclose(per_token[0, 1], q[1]) and torch.equal(per_token[0, 0], p[0])
    with pytest.raises(ValueError):
        mix_target_probs(tp, dp[:, :2], torch.ones(2))


def _greedy_expected(p, q, x, w):
    """verifier.verify's greedy rule on one row: accept while x == argmax ν, then argmax ν/p_N."""
    return verify(p.unsqueeze(0), q.unsqueeze(0), x.unsqueeze(0), weights=w, greedy=True)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("w", [1.0, 0.5, 0.1])
def test_greedy_rows_follow_argmax_nu_through_the_chain_kernel(seed, w):
    """A greedy row reaches the kernel one-hot at argmax p (SGLang's top-1 renorm); the hook makes
    it one-hot at argmax ν from the full softmax of the logits, and the kernel then accepts while
    x == argmax ν and emits argmax ν at the first mismatch, as `verifier.verify`'s greedy rule."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N + 1, V, generator=g) * 2  # target
    q = torch.softmax(torch.randn(N, V, generator=g) * 2, dim=-1)
    x = q.argmax(-1)  # a greedy draft proposes argmax q
    p = logits.softmax(-1)
    expected = _greedy_expected(p, q, x, w)
    k = int(expected.num_accepted)
    tp = torch.nn.functional.one_hot(logits.argmax(-1), V).float().unsqueeze(0)  # [1, N+1, V]
    nu_into_target_probs_(
        tp, q.unsqueeze(0), torch.tensor([w]), logits=logits.unsqueeze(0), greedy=torch.tensor([True]),
        any_greedy=True,
    )  # fmt: skip
    cand = torch.cat([torch.zeros(1, dtype=torch.long), x]).unsqueeze(0)  # [1, N+1]
    coins = torch.rand(1, N, generator=g)
    acc, toks = chain_rejection_reference(cand, tp, q.unsqueeze(0), coins, torch.rand(1))
    assert int(acc) == k and torch.equal(toks[0, : k + 1], expected.tokens[0, : k + 1])


@pytest.mark.parametrize("b, n", [(1, 1), (1, 5), (2, 3), (48, 5), (7, 2)])
def test_slot_blocks_cover_every_slot_once_in_a_quarter_or_less(b, n):
    seen = torch.zeros(b, n, dtype=torch.long)
    for rows, slots in slot_blocks(b, n):
        seen[rows, slots] += 1
        assert seen[rows, slots].numel() <= max(1, b * n // 4)
    assert bool((seen == 1).all())


def test_in_place_nu_equals_the_reference_mix_and_leaves_w1_rows_alone():
    g = torch.Generator().manual_seed(11)
    b = 7
    p = torch.softmax(torch.randn(b, N + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(b, N, V, generator=g), -1)
    w = torch.tensor([1.0, 0.0, 0.3, 1.0, 0.9, 0.5, 0.05])
    out = p.clone()
    nu_into_target_probs_(out, q, w)
    ref = mix_target_probs(p, q, w)
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.equal(out[[0, 3]], p[[0, 3]]) and torch.equal(out[:, N], p[:, N])  # bit-identical
