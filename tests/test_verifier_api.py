"""Verifier interface: greedy rule, batch invariance, per-token weights, edge cases, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier import PAD_TOKEN, Policy, PolicyBatch, PolicyKind, verify


def random_inputs(b, n, v, seed, sharp=1.0):
    gen = torch.Generator().manual_seed(seed)
    target = (sharp * torch.randn(b, n + 1, v, generator=gen)).softmax(-1)  # [B, N+1, V]
    draft = (sharp * torch.randn(b, n, v, generator=gen)).softmax(-1)  # [B, N, V]
    tokens = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).view(b, n)  # [B, N]
    return target, draft, tokens, gen


def test_greedy_accepts_while_draft_is_argmax_nu():
    target, draft, _, _ = random_inputs(64, 4, 12, seed=0, sharp=3.0)
    w = torch.linspace(0, 1, 64)
    nu = w.view(-1, 1, 1) * target[:, :4] + (1 - w.view(-1, 1, 1)) * draft  # [B, N, V]
    # Drafts that follow argmax nu for a random prefix, then deviate.
    best = nu.argmax(-1)  # [B, N]
    prefix = torch.arange(64) % 5
    tokens = torch.where(torch.arange(4) < prefix.unsqueeze(1), best, (best + 1) % 12)
    r = verify(target, draft, tokens, w, greedy=True)
    assert torch.equal(r.num_accepted, prefix)
    rows = torch.arange(64)
    full = prefix == 4
    expected_final = torch.where(full, target[:, 4].argmax(-1), best[rows, prefix.clamp(max=3)])
    assert torch.equal(r.tokens[rows, prefix], expected_final)


def test_greedy_w1_is_target_argmax():
    target, draft, _, _ = random_inputs(16, 3, 10, seed=1, sharp=3.0)
    tokens = draft.argmax(-1)
    r = verify(target, draft, tokens, 1.0, greedy=True)
    agree = (tokens == target[:, :3].argmax(-1)).long().cumprod(-1).sum(-1)
    assert torch.equal(r.num_accepted, agree)


def test_batched_equals_row_by_row_with_per_row_uniforms():
    b, n, v = 12, 4, 20
    target, draft, tokens, gen = random_inputs(b, n, v, seed=2)
    w = torch.rand(b, generator=gen)
    greedy = torch.arange(b) % 3 == 0
    policy = PolicyBatch.from_policies(
        [Policy(kind=PolicyKind(i % 4), lenience=0.4, alpha=0.7) for i in range(b)]
    )
    u = torch.rand(b, n + 1, generator=gen)
    batched = verify(target, draft, tokens, w, policy=policy, greedy=greedy, uniforms=u)
    for i in range(b):
        single = verify(
            target[i : i + 1],
            draft[i : i + 1],
            tokens[i : i + 1],
            w[i : i + 1],
            policy=PolicyBatch.from_policies([Policy(kind=PolicyKind(i % 4), lenience=0.4, alpha=0.7)]),
            greedy=greedy[i : i + 1],
            uniforms=u[i : i + 1],
        )
        assert torch.equal(single.tokens[0], batched.tokens[i])
        assert torch.allclose(single.accept_probs[0], batched.accept_probs[i])


def test_constant_per_position_weights_equal_static_weight():
    target, draft, tokens, gen = random_inputs(32, 5, 16, seed=3)
    u = torch.rand(32, 6, generator=gen)
    static = verify(target, draft, tokens, 0.4, uniforms=u)
    per_row = verify(target, draft, tokens, torch.full((32,), 0.4), uniforms=u)
    per_token = verify(target, draft, tokens, torch.full((32, 5), 0.4), uniforms=u)
    for other in (per_row, per_token):
        assert torch.equal(static.tokens, other.tokens)
        assert torch.equal(static.accept_probs, other.accept_probs)


def test_per_token_weights_apply_per_position():
    target, draft, tokens, _ = random_inputs(8, 3, 16, seed=4)
    w = torch.tensor([0.0, 1.0, 0.5]).expand(8, 3)
    r = verify(target, draft, tokens, w)
    assert torch.allclose(r.accept_probs[:, 0], torch.ones(8))  # w = 0 accepts every draft
    ratio = target[:, 1].gather(-1, tokens[:, 1:2]) / draft[:, 1].gather(-1, tokens[:, 1:2])
    assert torch.allclose(r.accept_probs[:, 1], ratio.squeeze(-1).clamp(max=1))


def test_identical_p_q_accepts_all_and_zero_residual_falls_back_to_p():
    target, draft, tokens, _ = random_inputs(4, 3, 10, seed=5)
    same = verify(torch.cat([draft, target[:, 3:]], 1), draft, tokens, 1.0)
    assert bool((same.num_accepted == 3).all())
    # p sits below q at the draft token by 1e-7: a forced rejection (coin ~ 1) samples the
    # residual, whose only mass is on token 1.
    v = 10
    q = torch.full((1, 1, v), 1.0 / v, dtype=torch.float64)
    p = q.clone()
    p[0, 0, 0] -= 1e-7
    p[0, 0, 1] += 1e-7
    u = torch.tensor([[1 - 1e-12, 0.55]], dtype=torch.float64)
    r = verify(torch.cat([p, q], 1), q, torch.tensor([[0]]), 1.0, uniforms=u)
    assert int(r.num_accepted) == 0 and int(r.tokens[0, 0]) == 1
    # With a gap of 1e-11 the residual mass is below the floor: the correction is drawn from p
    # itself (inverse CDF of the near-uniform p at 0.55 -> token 5), not from rounding noise.
    p2 = q.clone()
    p2[0, 0, 0] -= 1e-11
    p2[0, 0, 9] += 1e-11
    r2 = verify(torch.cat([p2, q], 1), q, torch.tensor([[0]]), 1.0, uniforms=u)
    assert int(r2.num_accepted) == 0 and int(r2.tokens[0, 0]) == 5


def test_tiny_draft_probability_is_finite():
    v = 8
    q = torch.full((1, 1, v), 1e-30)
    q[0, 0, 1] = 1 - 7e-30
    p = torch.full((1, 2, v), 1.0 / v)
    r = verify(p, q, torch.tensor([[0]]), 0.5, uniforms=torch.tensor([[0.9, 0.5]]))
    assert torch.isfinite(r.accept_probs).all()
    assert float(r.accept_probs[0, 0]) == 1.0


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_weights_out_of_range_name_the_argument(bad):
    target, draft, tokens, _ = random_inputs(2, 2, 5, seed=6)
    with pytest.raises(ValueError, match="weights"):
        verify(target, draft, tokens, bad)


@pytest.mark.parametrize(
    "change,name",
    [
        (lambda t, d, x: (t[:, :-1], d, x), "target_probs"),
        (lambda t, d, x: (t, d, x[:, :-1]), "draft_tokens"),
        (lambda t, d, x: (t, d, x.float()), "draft_tokens"),
        (lambda t, d, x: (t, d, x + 100), "draft_tokens"),
        (lambda t, d, x: (t, d[0], x), "draft_probs"),
    ],
)
def test_shape_and_token_errors_are_clear(change, name):
    target, draft, tokens, _ = random_inputs(2, 3, 5, seed=7)
    with pytest.raises(ValueError, match=name):
        verify(*change(target, draft, tokens))


def test_weights_shape_mismatch():
    target, draft, tokens, _ = random_inputs(2, 3, 5, seed=8)
    with pytest.raises(ValueError, match="weights"):
        verify(target, draft, tokens, torch.ones(3))


def test_bad_policy_parameters_rejected():
    with pytest.raises(ValueError, match="lenience"):
        Policy(kind=PolicyKind.LOSSY, lenience=0.0)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 6),
    n=st.integers(0, 6),
    v=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
    greedy=st.booleans(),
    kind=st.sampled_from(list(PolicyKind)),
    w=st.floats(0.0, 1.0),
)
def test_properties(b, n, v, seed, greedy, kind, w):
    target, draft, tokens, gen = random_inputs(b, n, v, seed, sharp=2.0)
    policy = PolicyBatch.from_policies([Policy(kind=kind)] * b)
    r = verify(target, draft, tokens, w, policy=policy, greedy=greedy, generator=gen)
    assert r.tokens.shape == (b, n + 1)
    assert bool(((r.num_accepted >= 0) & (r.num_accepted <= n)).all())
    for i in range(b):
        k = int(r.num_accepted[i])
        assert torch.equal(r.tokens[i, :k], tokens[i, :k])
        assert 0 <= int(r.tokens[i, k]) < v
        assert bool((r.tokens[i, k + 1 :] == PAD_TOKEN).all())
    assert bool(((r.accept_probs >= 0) & (r.accept_probs <= 1)).all())


def test_zero_drafts_is_plain_sampling_from_p():
    """N = 0 (autoregressive rows): the token is p's inverse-CDF draw with the row's first coin,
    or argmax p for greedy rows — the same answer the general path gives."""
    from verifier.sampling import sample_inverse_cdf

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 1, 10, generator=g), -1)  # [B, 1, V]
    u = torch.rand(64, 1, generator=g)
    empty_q, empty_x = torch.zeros(64, 0, 10), torch.zeros(64, 0, dtype=torch.long)
    res = verify(p, empty_q, empty_x, 1.0, uniforms=u)
    assert torch.equal(res.tokens[:, 0], sample_inverse_cdf(p[:, 0], u[:, 0]))
    assert res.tokens.shape == (64, 1) and int(res.num_accepted.sum()) == 0
    mask = torch.arange(64) % 2 == 0
    mixed = verify(p, empty_q, empty_x, 1.0, greedy=mask, uniforms=u)
    assert torch.equal(mixed.tokens[mask, 0], p[mask, 0].argmax(-1))
    assert torch.equal(mixed.tokens[~mask, 0], res.tokens[~mask, 0])
