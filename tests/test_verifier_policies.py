"""Baseline policies and sampling transforms: each emits the law its acceptance rule implies.

For any policy with acceptance a(x) and residual r, the first emitted token has law
`q(x)·a(x) + (1 − Σ_y q(y)·a(y))·norm(r)`; we compute it in closed form and chi-square test it.
"""

from __future__ import annotations

import pytest
import torch

from tests.device import DEVICE, generator_like
from tests.stats import ALPHA, Z_BOUND, binomial_z, chi_square_pvalue
from verifier import (
    Policy,
    PolicyBatch,
    PolicyKind,
    cost_model_speedup,
    expected_accepted_length,
    expected_accepted_length_constant,
    logits_to_probs,
    tv_distance,
    verify,
)
from verifier.policies import RULES

TRIALS = 200_000


def implied_law(p, q, accept, residual):
    """Closed-form first-token law for acceptance `accept [V]` and residual `[V]`."""
    kept = q * accept
    rest = 1 - kept.sum()
    res = residual / residual.sum() if residual.sum() > 1e-12 else p
    return kept + rest * res


def all_token_verdict(policy: Policy, p, q):
    """Evaluate `policy` with every vocabulary token as the draft: returns accept [V], residual [V]."""
    v = p.numel()
    accept, residual, _ = RULES[policy.kind]
    params = PolicyBatch.from_policies([policy] * v)
    pp, qq, w = p.expand(v, 1, v), q.expand(v, 1, v), torch.ones(v, 1, dtype=p.dtype)
    acc = accept(pp, qq, torch.arange(v).view(v, 1), w, params)  # [V, 1]
    return acc[:, 0].to(p.dtype), residual(pp, qq, w, params)[0, 0]


@pytest.mark.parametrize(
    "policy",
    [
        Policy(kind=PolicyKind.LOSSY, lenience=0.5),
        Policy(kind=PolicyKind.LOSSY, lenience=0.2),
        Policy(kind=PolicyKind.CASCADE, alpha=0.0),
        Policy(kind=PolicyKind.CASCADE, alpha=2.0),
        Policy(kind=PolicyKind.TYPICAL, epsilon=0.09, delta=0.3),
    ],
)
def test_baseline_policy_emits_its_implied_law(policy):
    gen = torch.Generator().manual_seed(21)
    v = 12
    p = (torch.randn(v, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    q = (torch.randn(v, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    accept, residual = all_token_verdict(policy, p, q)
    law = implied_law(p, q, accept, residual)

    x = torch.multinomial(q, TRIALS, replacement=True, generator=gen).view(TRIALS, 1)
    r = verify(
        p.float().to(DEVICE).expand(TRIALS, 2, v),
        q.float().to(DEVICE).expand(TRIALS, 1, v),
        x.to(DEVICE),
        1.0,
        policy=PolicyBatch.from_policies([policy] * TRIALS, device=DEVICE),
        generator=generator_like(gen),
    )
    assert chi_square_pvalue(r.tokens[:, 0], law) > ALPHA
    rate = float((q * accept).sum())
    assert abs(binomial_z(float((r.num_accepted == 1).sum()), TRIALS, rate)) < Z_BOUND


def test_lossy_lenience_one_is_lossless_and_lower_lenience_accepts_more():
    gen = torch.Generator().manual_seed(22)
    p, q = torch.rand(10, generator=gen).softmax(-1), torch.rand(10, generator=gen).softmax(-1)
    a1, _ = all_token_verdict(Policy(kind=PolicyKind.LOSSY, lenience=1.0), p, q)
    assert torch.allclose(a1, (p / q).clamp(max=1))
    a_half, _ = all_token_verdict(Policy(kind=PolicyKind.LOSSY, lenience=0.5), p, q)
    assert bool((a_half >= a1).all()) and float((q * a_half).sum()) > float((q * a1).sum())


def test_cascade_defers_only_when_draft_is_less_confident():
    v = 6
    p = torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])
    q_unsure = torch.full((v,), 1 / v)
    q_sure = torch.tensor([0.02, 0.9, 0.02, 0.02, 0.02, 0.02])
    acc, _ = all_token_verdict(Policy(kind=PolicyKind.CASCADE, alpha=0.1), p, q_unsure)
    assert torch.allclose(acc, (p / q_unsure).clamp(max=1))  # deferred: π = p
    acc, _ = all_token_verdict(Policy(kind=PolicyKind.CASCADE, alpha=0.1), p, q_sure)
    assert torch.allclose(acc, torch.ones(v))  # kept: π = q accepts everything


def test_sampling_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 5.0]])
    probs = logits_to_probs(logits, temperature=torch.tensor([1.0, 0.5]), top_k=torch.tensor([2, 0]))
    assert float(probs[0, 2]) == 0 and float(probs[0, 3]) == 0
    assert torch.allclose(probs[0, :2], torch.tensor([2.0, 1.0]).softmax(-1))
    assert torch.allclose(probs[1], (logits[1] / 0.5).softmax(-1))
    nucleus = logits_to_probs(logits[:1], top_p=0.7)
    # softmax([2,1,0,-1]) = [.64, .24, .09, .03]: mass before token 1 is .64 < .7 -> kept; token 2 not.
    assert (nucleus[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(nucleus.sum(-1), torch.ones(1))
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(logits, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        logits_to_probs(logits, top_p=0.0)


def test_transforms_apply_to_p_and_q_consistently():
    """Per-row params broadcast over positions: a [B, N, V] tensor row uses its own settings."""
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(3, 4, 10, generator=gen)
    t = torch.tensor([0.5, 1.0, 2.0])
    k = torch.tensor([3, 0, 5])
    batched = logits_to_probs(logits, temperature=t, top_k=k, top_p=0.9)
    for i in range(3):
        single = logits_to_probs(logits[i : i + 1], temperature=float(t[i]), top_k=int(k[i]), top_p=0.9)
        assert torch.allclose(batched[i], single[0])


def test_theory_helpers():
    assert expected_accepted_length_constant(1.0, 5) == 5.0
    beta = 0.7
    closed = expected_accepted_length_constant(beta, 5)
    assert abs(closed - float(expected_accepted_length(torch.full((5,), beta, dtype=torch.float64)))) < 1e-9
    assert abs(float(tv_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) - 1.0) < 1e-9
    # Draft free and verify as costly as one target step: speedup = tokens per round.
    assert abs(cost_model_speedup(2.0, 5, 0.0, 1.0, 1.0) - 3.0) < 1e-9
    assert cost_model_speedup(2.0, 5, 0.1, 1.0, 1.0) < 3.0
