"""REINFORCE++ training on the tiny pair: it improves the regularised objective, is deterministic
per seed, and a resumed run ends exactly where an uninterrupted one does."""

from __future__ import annotations

import pytest
import torch

from server.engine.head_store import load_head
from training.rl import (
    TrainConfig,
    cascade_targets,
    lr_factor,
    normalised_advantages,
    regulariser,
    sample_dials,
    update_step,
    warm_start,
)
from training.rollout import Forced
from training.trainer import Trainer
from verifier.head import HeadConfig, WeightHead


def _cfg(tiny_pair, tmp_path, **kw) -> TrainConfig:
    target, draft = tiny_pair
    base = dict(
        target_path=str(target),
        draft_path=str(draft),
        pair_name="tiny-pair",
        out_dir=str(tmp_path / "head"),
        run_dir=str(tmp_path / "run"),
        tasks=("math", "summary"),
        train_prompts=4,
        dev_prompts=1,
        dev_dials=(0.25, 0.75),
        updates=3,
        batch=4,
        group_size=2,
        warm_start_steps=20,
        max_tokens=12,
        warmup=1,
        eval_every=100,
        ckpt_every=1,
        lr=5e-2,
    )
    base.update(kw)
    return TrainConfig(**base)


def _state(head) -> dict:
    return {k: v.clone() for k, v in head.state_dict().items()}


def test_training_improves_objective_deterministically_and_resumes(tiny_pair, tmp_path):
    a = Trainer(_cfg(tiny_pair, tmp_path / "a"), log=lambda *_: None)
    summary = a.train(progress=False)
    first, last = summary["dev"][0], summary["dev"][-1]
    assert summary["updates"] == 3 and len(a.history) == 3
    assert last["objective"] > first["objective"]  # score + λ(d)·acc − μ·gap² on fixed dev rollouts
    assert last["d0.25"]["mean_w"] < last["d0.75"]["mean_w"]  # the dial already steers w
    exported = load_head(
        tmp_path / "a" / "head", "tiny-pair", target_path=tiny_pair[0], draft_path=tiny_pair[1]
    )
    for k, v in _state(a.head).items():
        assert torch.equal(exported.state_dict()[k], v)

    # Interrupted after 2 updates, then resumed to 3: same head as the uninterrupted run (same seed).
    b1 = Trainer(_cfg(tiny_pair, tmp_path / "b"), log=lambda *_: None)
    b1.train(progress=False, stop_after=2)
    b2 = Trainer(_cfg(tiny_pair, tmp_path / "b"), log=lambda *_: None)
    b2.train(resume=True, progress=False)
    assert b2.step == 3 and [h["step"] for h in b2.history] == [1, 2, 3]
    for k, v in _state(a.head).items():
        assert torch.allclose(b2.head.state_dict()[k], v, atol=1e-6), k


def _fake_batch(b=6, t=10, hd=4, ht=6, seed=0) -> Forced:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(b, t, generator=g)
    tv = torch.rand(b, t, generator=g) * 0.6
    stats = torch.stack(
        [
            torch.rand(b, t, generator=g),
            torch.rand(b, t, generator=g),
            torch.rand(b, t),
            torch.rand(b, t),
            tv,
        ],
        -1,
    )
    return Forced(
        p_tok=p,
        q_tok=torch.rand(b, t, generator=g),
        tv=tv,
        stats=stats,
        h_draft=torch.randn(b, t, hd, generator=g),
        h_target=torch.randn(b, t, ht, generator=g),
        mask=torch.ones(b, t, dtype=torch.bool),
    )


def test_update_step_raises_the_regularised_objective():
    torch.manual_seed(0)
    head = WeightHead(HeadConfig(4, 6))
    ref = WeightHead(HeadConfig(4, 6)).requires_grad_(False)
    cfg = TrainConfig(ppo_epochs=2, lr=5e-2, group_size=2)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr)
    forced, dial = _fake_batch(), torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    scores = torch.zeros(6)  # no task signal: only the acceptance and budget terms move w

    def objective():
        with torch.no_grad():
            w = head(forced.h_draft, forced.h_target, dial)
            return float(regulariser(w, forced, dial, cfg).mean())

    before = objective()
    for _ in range(3):
        stats = update_step(head, ref, opt, forced, dial, scores, cfg)
    assert objective() > before
    assert stats["kl"] >= 0 and 0 <= stats["clip_frac"] <= 1


def test_advantages_and_schedule():
    adv = normalised_advantages(torch.tensor([1.0, 2.0, 3.0]))
    assert abs(float(adv.mean())) < 1e-6 and abs(float(adv.std()) - 1) < 1e-4
    assert torch.equal(normalised_advantages(torch.ones(4)), torch.zeros(4))
    grouped = normalised_advantages(torch.tensor([1.0, 3.0, 10.0, 12.0]), group_size=2)
    assert torch.allclose(grouped, torch.tensor([-1.0, 1.0, -1.0, 1.0]) * grouped[1])  # baseline per group
    dials = sample_dials(TrainConfig(group_size=4, dials=(0.0, 0.5, 1.0)), step=3, n=12)
    assert dials.view(3, 4).unique(dim=1).shape[1] == 1  # one dial per group
    cfg = TrainConfig(updates=10, warmup=2)
    assert lr_factor(cfg, 0) == pytest.approx(0.5) and lr_factor(cfg, 1) == pytest.approx(1.0)
    assert lr_factor(cfg, 9) < lr_factor(cfg, 3) and lr_factor(cfg, 100) == pytest.approx(0.1)


def test_budget_anchors():
    forced, dial = _fake_batch(b=2), torch.tensor([0.3, 0.8])
    w = dial.view(-1, 1).expand_as(forced.tv)  # the static ensemble at w = d spends exactly its budget
    for budget in ("acceptance", "weight"):
        cfg = TrainConfig(budget=budget, lambda_min=0.0, lambda_max=0.0)
        assert torch.allclose(regulariser(w, forced, dial, cfg), torch.zeros(2), atol=1e-6)
        assert bool((regulariser(w * 0.5, forced, dial, cfg) < 0).all())


def test_cascade_targets_spend_the_dial_budget_where_a_cascade_would():
    forced = _fake_batch(b=8, t=50, seed=2)
    dial = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 0.25, 0.5, 0.75])
    target = cascade_targets(forced, dial, alpha=0.5)
    assert set(target.unique().tolist()) <= {0.0, 1.0}
    s = forced.stats
    u = s[..., 0] - s[..., 1] - 0.5 * s[..., 4]  # [B, T] the cascade's deferral score
    for d in dial.unique().tolist():
        rows = dial == d
        assert abs(float(target[rows].mean()) - d) <= 0.03  # budget: a fraction d of positions defer
        if 0 < d < 1:  # and they are the ones with the largest u
            assert float(u[rows][target[rows] == 1].min()) >= float(u[rows][target[rows] == 0].max())


def test_cascade_warm_start_teaches_a_stats_head_the_cascade_rule():
    torch.manual_seed(0)
    forced = _fake_batch(b=8, t=40, seed=3)
    head = WeightHead(HeadConfig(4, 6, inputs="stats"))
    head.calibrate(forced.h_draft, forced.h_target, forced.stats)
    cfg = TrainConfig(dials=(0.25, 0.5, 0.75), warm_start_steps=300, warm_start_lr=5e-2)
    assert warm_start(head, forced, cfg)[0] == "cascade"
    s = forced.stats
    u = (s[..., 0] - s[..., 1] - 0.5 * s[..., 4]).flatten()
    for d in cfg.dials:
        with torch.no_grad():
            w = head(forced.h_draft, forced.h_target, torch.full((8,), d), forced.stats).flatten()
        assert abs(float(w.mean()) - d) < 0.08  # the budget
        assert float(torch.corrcoef(torch.stack([w, u]))[0, 1]) > 0.8  # the ranking
    with pytest.raises(ValueError, match="position stats"):
        warm_start(WeightHead(HeadConfig(4, 6)), forced, TrainConfig(warm_start="cascade"))
