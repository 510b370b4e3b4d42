"""The verifier emits exactly ν = w·p + (1−w)·q, and accepts at rate 1 − w·TV(p, q).

Each case draws >= 200k seeded trials in one batched call (the batch dimension *is* the trials)
and applies a chi-square test at level ALPHA; `test_power` shows the same test rejects p when ν
is the truth, so these checks can fail. Verification runs on `tests.device.DEVICE` (CUDA under
`scripts/gpu_smoke.sh`); the laws and drafts are built on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.device import DEVICE, generator_like
from tests.stats import ALPHA, Z_BOUND, binomial_z, chi_square_pvalue
from verifier import expected_acceptance, verify

TRIALS = 200_000


def _normalise(x):
    return x / x.sum()


def make_case(kind: str, vocab: int, gen: torch.Generator):
    """(p, q) pairs covering the supports the issue names."""
    rand = lambda: torch.rand(vocab, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "overlapping":
        return _normalise(rand() ** 2), _normalise(rand() ** 2)
    if kind == "near_identical":
        p = _normalise(rand())
        return p, _normalise(p * (1 + 0.01 * rand()))
    if kind == "disjoint":
        half = vocab // 2
        p, q = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
        p[:half], q[half:] = rand()[:half], rand()[half:]
        return _normalise(p), _normalise(q)
    if kind == "one_hot_target":
        p = torch.zeros(vocab, dtype=torch.float64)
        p[3] = 1.0
        return p, _normalise(rand())
    if kind == "one_hot_both":
        p, q = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
        p[1], q[2] = 1.0, 1.0
        return p, q
    raise ValueError(kind)


def run_first_token(p, q, w, trials, seed, n=1):
    """Verify `trials` independent chains with stationary p, q; returns (VerifyResult, drafts)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    target = p.float().to(DEVICE).expand(trials, n + 1, vocab)  # [T, N+1, V]
    draft = q.float().to(DEVICE).expand(trials, n, vocab)  # [T, N, V]
    drafts = torch.multinomial(q.float(), trials * n, replacement=True, generator=gen).view(trials, n)
    drafts = drafts.to(DEVICE)
    return verify(target, draft, drafts, w, generator=generator_like(gen)), drafts


CASES = [
    ("overlapping", 8, 0.5),
    ("overlapping", 32, 0.3),
    ("overlapping", 16, 1.0),
    ("overlapping", 16, 0.0),
    ("near_identical", 16, 0.5),
    ("disjoint", 8, 0.7),
    ("disjoint", 32, 1.0),
    ("one_hot_target", 8, 0.4),
    ("one_hot_both", 8, 0.6),
    ("one_hot_both", 8, 1.0),
]


@pytest.mark.parametrize("kind,vocab,w", CASES)
def test_first_token_is_nu(kind, vocab, w):
    gen = torch.Generator().manual_seed(vocab * 1000 + int(w * 100))
    p, q = make_case(kind, vocab, gen)
    result, _ = run_first_token(p, q, w, TRIALS, seed=7)
    nu = w * p + (1 - w) * q
    assert chi_square_pvalue(result.tokens[:, 0], nu) > ALPHA


@pytest.mark.parametrize("kind,vocab,w", CASES)
def test_acceptance_is_one_minus_w_tv(kind, vocab, w):
    gen = torch.Generator().manual_seed(vocab * 1000 + int(w * 100) + 1)
    p, q = make_case(kind, vocab, gen)
    result, _ = run_first_token(p, q, w, TRIALS, seed=11)
    expected = float(expected_acceptance(p, q, w))
    accepted = float((result.num_accepted >= 1).sum())
    assert abs(binomial_z(accepted, TRIALS, expected)) < Z_BOUND
    # accept_probs are the exact per-draw probabilities: their mean is an unbiased estimate too.
    assert abs(float(result.accept_probs[:, 0].double().mean()) - expected) < 5 * (0.5 / TRIALS**0.5)


def test_w1_gives_p_and_w0_gives_q():
    gen = torch.Generator().manual_seed(3)
    p, q = make_case("overlapping", 16, gen)
    exact, _ = run_first_token(p, q, 1.0, TRIALS, seed=5)
    assert chi_square_pvalue(exact.tokens[:, 0], p) > ALPHA
    draft_only, drafts = run_first_token(p, q, 0.0, TRIALS, seed=6)
    assert bool((draft_only.num_accepted == 1).all())
    assert torch.equal(draft_only.tokens[:, 0], drafts[:, 0])
    assert chi_square_pvalue(draft_only.tokens[:, 0], q) > ALPHA


def test_power_rejects_the_wrong_law():
    """The chi-square check has power: ν at w = 0.5 is clearly not p, and the test says so."""
    gen = torch.Generator().manual_seed(4)
    p, q = make_case("overlapping", 16, gen)
    result, _ = run_first_token(p, q, 0.5, TRIALS, seed=9)
    assert chi_square_pvalue(result.tokens[:, 0], p) < 1e-12
    accepted = float((result.num_accepted >= 1).sum())
    assert abs(binomial_z(accepted, TRIALS, float(expected_acceptance(p, q, 1.0)))) > Z_BOUND


@pytest.mark.parametrize("w", [0.3, 0.8])
def test_joint_law_of_two_tokens_is_nu_times_nu(w):
    """N = 2 with position-specific (p_i, q_i): (y_1, y_2) ~ ν_1 ⊗ ν_2.

    When the first round stops after one token, the second token comes from the next round, whose
    first position is scored by (p_2, q_2) — exactly what an engine does in a context-free chain.
    """
    vocab, gen = 8, torch.Generator().manual_seed(int(w * 10))
    (p1, q1), (p2, q2) = make_case("overlapping", vocab, gen), make_case("overlapping", vocab, gen)
    p3 = _normalise(torch.rand(vocab, generator=gen, dtype=torch.float64))
    trials = TRIALS
    target = torch.stack([p1, p2, p3]).float().to(DEVICE).expand(trials, 3, vocab)  # [T, 3, V]
    draft = torch.stack([q1, q2]).float().to(DEVICE).expand(trials, 2, vocab)  # [T, 2, V]
    x = torch.stack(
        [torch.multinomial(q.float(), trials, replacement=True, generator=gen) for q in (q1, q2)], dim=1
    ).to(DEVICE)  # [T, 2]
    first = verify(target, draft, x, w, generator=generator_like(gen))
    second_round = verify(
        torch.stack([p2, p3]).float().to(DEVICE).expand(trials, 2, vocab),
        q2.float().to(DEVICE).expand(trials, 1, vocab),
        torch.multinomial(q2.float(), trials, replacement=True, generator=gen).view(trials, 1).to(DEVICE),
        w,
        generator=generator_like(gen),
    )
    y2 = torch.where(first.num_emitted >= 2, first.tokens[:, 1], second_round.tokens[:, 0])
    joint = first.tokens[:, 0] * vocab + y2
    nu1, nu2 = w * p1 + (1 - w) * q1, w * p2 + (1 - w) * q2
    assert chi_square_pvalue(joint, torch.outer(nu1, nu2).flatten()) > ALPHA


def test_mean_accepted_length_matches_product_form():
    from verifier import expected_accepted_length

    gen = torch.Generator().manual_seed(12)
    p, q = make_case("overlapping", 16, gen)
    n, w = 4, 0.6
    result, _ = run_first_token(p, q, w, TRIALS, seed=13, n=n)
    beta = expected_acceptance(p, q, w).expand(n)
    expected = float(expected_accepted_length(beta))
    counts = result.num_accepted.double()
    sd = float(counts.std())
    assert abs(float(counts.mean()) - expected) < Z_BOUND * sd / TRIALS**0.5
