"""SpecCascade's α-family as a head target: the targets are SpecCascade's own rule, a stats head
with dial interactions learns the whole family, and the cascade anchor is zero exactly on it."""

from __future__ import annotations

import pytest
import torch

from training.distill import (
    cascade_alpha,
    cascade_gap,
    cascade_weights,
    deferral_score,
    distil_cascade,
    rule_agreement,
)
from training.rl import TrainConfig, regulariser, warm_start
from training.rollout import Forced
from verifier.dial import PolicyKind
from verifier.head import HeadConfig, WeightHead, position_stats
from verifier.policies import Policy, PolicyBatch, cascade_greedy
from verifier.theory import tv_distance

GRID = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


def _pq(b=8, t=40, v=16, seed=0):
    """Target and draft distributions `[B, T, V]`: the draft a noisy, differently sharp target."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * 3.0
    p = torch.softmax(logits, -1)
    sharp = torch.rand(b, t, 1, generator=g) * 1.5 + 0.25
    q = torch.softmax(logits * sharp + torch.randn(b, t, v, generator=g) * 1.5, -1)
    return p, q


def _forced(p, q, hd=4, ht=6, seed=0) -> Forced:
    g = torch.Generator().manual_seed(seed)
    b, t, _ = p.shape
    return Forced(
        p_tok=torch.rand(b, t, generator=g),
        q_tok=torch.rand(b, t, generator=g),
        tv=tv_distance(p, q),
        stats=position_stats(p, q),
        h_draft=torch.randn(b, t, hd, generator=g),
        h_target=torch.randn(b, t, ht, generator=g),
        mask=torch.ones(b, t, dtype=torch.bool),
    )


def test_cascade_weights_are_speccascades_deferrals_at_alpha_of_the_dial():
    p, q = _pq()
    stats, mask = position_stats(p, q), torch.ones(p.shape[:2], dtype=torch.bool)
    b = p.shape[0]
    for d in (0.0, 0.125, 0.25, 0.375, 0.5):  # α(d) = 1, 0.75, 0.5, 0.25, 0: SpecCascade's own range
        alpha = float(cascade_alpha(torch.tensor(d)))
        params = PolicyBatch.from_policies([Policy(PolicyKind.CASCADE, alpha=alpha)] * b)
        pi = cascade_greedy(p, q, 1.0, params)  # [B, T, V]: p where SpecCascade defers, else q
        defer = (pi == p).all(-1) & ~(pi == q).all(-1)  # [B, T]
        c = cascade_weights(stats, torch.full((b,), d), mask)
        assert torch.equal(c.bool(), defer), d
    assert 0 < float(cascade_weights(stats, torch.full((b,), 0.5), mask).mean()) < 1  # not trivial here
    assert float(cascade_weights(stats, torch.zeros(b), mask).sum()) == 0  # α = 1: never defers
    assert bool(cascade_weights(stats, torch.ones(b), mask).all())  # d = 1: exact
    # α < 0 (d > 0.5) defers at least wherever α = 0 does: acceptance falls as the dial rises
    means = [float(cascade_weights(stats, torch.full((b,), d), mask).mean()) for d in GRID]
    assert means == sorted(means) and means[-2] > means[4]
    u = deferral_score(stats, cascade_alpha(torch.full((b,), 0.75)))
    assert torch.equal(cascade_weights(stats, torch.full((b,), 0.75), mask).bool(), u > 0)


def test_a_stats_head_with_dial_interactions_distils_the_whole_family():
    torch.manual_seed(0)
    forced, fresh = _forced(*_pq(seed=1)), _forced(*_pq(seed=7), seed=7)
    heads = {}
    for interactions in (True, False):
        head = WeightHead(HeadConfig(4, 6, inputs="stats", dial_interactions=interactions))
        head.calibrate(forced.h_draft, forced.h_target, forced.stats)
        distil_cascade(head, forced, GRID, steps=200, lr=5e-2)
        heads[interactions] = head
    with_d, without = (rule_agreement(heads[i], forced, GRID) for i in (True, False))
    # The rule is linear in (max p, max q, TV, d·TV): the head reproduces it nearly everywhere it
    # matters (TV-weighted; the sigmoid's soft edge costs the rest), at every dial, on positions it
    # never saw too; without d·stats the dial can only shift one threshold.
    assert min(with_d.values()) > 0.97, with_d
    assert min(rule_agreement(heads[True], fresh, GRID).values()) > 0.95
    assert min(without.values()) < min(with_d.values()) - 0.05, without


def test_cascade_anchor_is_zero_on_the_cascade_and_warm_start_picks_distil():
    p, q = _pq(b=4, t=20, seed=2)
    forced, dial = _forced(p, q), torch.tensor([0.25, 0.5, 0.75, 1.0])
    c = cascade_weights(forced.stats, dial, forced.mask)
    assert torch.allclose(cascade_gap(c, forced, dial), torch.zeros(4))
    cfg = TrainConfig(budget="cascade", lambda_min=0.0, lambda_max=0.0)
    assert torch.allclose(regulariser(c, forced, dial, cfg), torch.zeros(4))
    assert bool((regulariser(torch.full_like(c, 0.5), forced, dial, cfg) < 0).all())
    head = WeightHead(HeadConfig(4, 6, inputs="both", dial_interactions=True))
    head.calibrate(forced.h_draft, forced.h_target, forced.stats)
    kind, _ = warm_start(head, forced, TrainConfig(dials=(0.25, 0.5), warm_start_steps=5))
    assert kind == "distil"
    with pytest.raises(ValueError, match="position stats"):
        warm_start(WeightHead(HeadConfig(4, 6)), forced, TrainConfig(warm_start="distil"))
    with pytest.raises(ValueError, match="dial_interactions"):
        HeadConfig(4, 6, inputs="states", dial_interactions=True)


def test_exact_at_full_dial_pins_w_to_one_only_at_the_top():
    forced = _forced(*_pq(b=3, t=5, seed=4))
    head = WeightHead(HeadConfig(4, 6, inputs="stats", dial_interactions=True, exact_at_full_dial=True))
    torch.nn.init.normal_(head.out.weight)
    w = head(forced.h_draft, forced.h_target, torch.tensor([0.5, 0.99, 1.0]), forced.stats)
    assert bool((w[2] == 1).all()) and not bool((w[:2] == 1).all())


def test_train_with_zero_updates_is_the_distilled_head(tiny_pair, tmp_path):
    from server.engine.head_store import load_head
    from training.trainer import Trainer

    target, draft = tiny_pair
    logs: list[str] = []
    cfg = TrainConfig(
        target_path=str(target), draft_path=str(draft), pair_name="tiny-pair", out_dir=str(tmp_path / "head"),
        run_dir=str(tmp_path / "run"), tasks=("math",), train_prompts=2, dev_prompts=1, dev_dials=(0.5,),
        updates=0, batch=2, group_size=1, max_tokens=8, dials=(0.25, 0.5, 1.0), warm_start_steps=20,
        head_inputs="stats", head_dial_interactions=True, head_exact_at_full_dial=True,
    )  # fmt: skip
    summary = Trainer(cfg, log=logs.append).train(progress=False)
    assert summary["updates"] == 0 and len(summary["dev"]) == 2  # before and after the warm start
    assert any(line.startswith("distil warm start") for line in logs)
    assert any("agreement with SpecCascade" in line for line in logs)
    head = load_head(cfg.out_dir, "tiny-pair", target_path=str(target), draft_path=str(draft))
    assert head.config.dial_interactions and head.config.exact_at_full_dial
    assert float(head.out.weight.detach().abs().sum()) > 0  # the output unit moved off its zero init
