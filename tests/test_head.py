"""The learned weight head: shapes, w = 0.5 at init, dial conditioning, save/load, pair checks,
and that training gradients reach the head and never the frozen pair."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from server.engine.embedded.model.llama import load_model
from server.engine.head_store import CONFIG_FILE, head_for_pair, load_head, pair_fingerprint, save_head
from training.rl import TrainConfig, reinforce_pp_loss
from training.rollout import Rollout, teacher_force
from verifier.head import HeadConfig, WeightHead, position_stats, wants_stats


def _inputs(r=3, n=5, hd=8, ht=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, n, hd, generator=g), torch.randn(r, n, ht, generator=g), torch.rand(r, generator=g)


@pytest.mark.parametrize("hidden", [0, 16])
def test_shapes_range_and_initial_half(hidden):
    head = WeightHead(HeadConfig(8, 12, hidden=hidden))
    hd, ht, dial = _inputs()
    w = head(hd, ht, dial)
    assert w.shape == (3, 5)
    assert torch.allclose(w, torch.full_like(w, 0.5))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    w = head(hd * 10, ht * 10, dial)
    assert w.shape == (3, 5) and bool(((w >= 0) & (w <= 1)).all())


def test_dial_is_an_input():
    head = WeightHead(HeadConfig(8, 12))
    with torch.no_grad():
        head.out.weight[0, -3] = 4.0  # the linear dial feature
    hd, ht, _ = _inputs(r=2)
    with torch.no_grad():
        w = head(hd, ht, torch.tensor([0.0, 1.0]))
    assert float(w[1].mean()) > float(w[0].mean()) + 0.3
    assert WeightHead(HeadConfig(8, 12, dial_conditioned=False))(hd, ht, torch.zeros(2)).shape == (2, 5)


def test_wrong_hidden_size_is_a_clear_error():
    head = WeightHead(HeadConfig(8, 12))
    hd, ht, dial = _inputs(ht=10)
    with pytest.raises(ValueError, match="hidden sizes"):
        head(hd, ht, dial)


def test_calibration_keeps_w_and_round_trips(tmp_path):
    head = WeightHead(HeadConfig(8, 12, hidden=4, pair_name="p"))
    hd, ht, dial = _inputs()
    head.calibrate(hd * 3 + 1, ht - 2)
    assert torch.allclose(head(hd, ht, dial), torch.full((3, 5), 0.5))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    save_head(head, tmp_path / "h", extra={"note": "x"})
    meta = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    assert meta["config"]["pair_name"] == "p" and meta["training"] == {"note": "x"}
    loaded = load_head(tmp_path / "h", "p")
    assert loaded.config == head.config
    assert torch.equal(loaded(hd, ht, dial), head(hd, ht, dial))


def test_pair_mismatch_is_refused(tmp_path, tiny_pair):
    target, draft = tiny_pair
    head = head_for_pair(target, draft, "tiny-pair")
    assert head.config.pair_fingerprint == pair_fingerprint(target, draft)
    save_head(head, tmp_path / "h")
    assert load_head(tmp_path / "h", "tiny-pair", target_path=target, draft_path=draft) is not None
    with pytest.raises(ValueError, match="trained for pair 'tiny-pair', not 'other'"):
        load_head(tmp_path / "h", "other")
    with pytest.raises(ValueError, match="hidden sizes"):  # target and draft swapped
        load_head(tmp_path / "h", target_path=draft, draft_path=target)
    # Same shapes, different weights: the fingerprint catches it.
    other = tmp_path / "other"
    shutil.copytree(target.parent, other)
    weights = other / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="weights differ"):
        load_head(tmp_path / "h", target_path=other / "target", draft_path=other / "draft")
    with pytest.raises(FileNotFoundError):
        load_head(tmp_path / "missing")


def test_gradients_reach_only_the_head(tiny_pair):
    target_path, draft_path = tiny_pair
    target, draft = load_model(target_path), load_model(draft_path)
    g = torch.Generator().manual_seed(0)
    rollouts = [
        Rollout(
            torch.randint(0, 300, (7,), generator=g).tolist(),
            torch.randint(0, 300, (k,), generator=g).tolist(),
        )
        for k in (5, 3)
    ]
    forced = teacher_force(target, draft, rollouts)
    assert forced.mask.sum(1).tolist() == [5, 3]
    assert not forced.p_tok.requires_grad and not forced.h_target.requires_grad
    head = head_for_pair(target_path, draft_path, "tiny-pair", hidden=4)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(std=0.1)
    dial = torch.tensor([0.2, 0.8])
    zeros = torch.zeros_like(forced.p_tok)
    adv = torch.tensor([1.0, -1.0])
    parts = reinforce_pp_loss(head, forced, dial, adv, zeros, zeros, TrainConfig())
    parts.loss.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in head.parameters())
    for model in (target, draft):
        assert all(p.grad is None and not p.requires_grad for p in model.parameters())


def test_position_stats_are_the_confidence_statistics():
    p = torch.tensor([[0.7, 0.2, 0.1, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    s = position_stats(p, q)[0]
    entropy_p = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert s.tolist() == pytest.approx([0.7, 0.25, entropy_p, math.log(4), 0.45], abs=1e-6)


@pytest.mark.parametrize("inputs", ["stats", "both"])
def test_stats_heads_need_stats_and_start_at_half(inputs):
    head = WeightHead(HeadConfig(8, 12, inputs=inputs))
    assert wants_stats(head) and head.config.input_width == (5 if inputs == "stats" else 25)
    hd, ht, dial = _inputs()
    with pytest.raises(ValueError, match="position stats"):
        head(hd, ht, dial)
    stats = torch.rand(3, 5, 5)
    head.calibrate(hd, ht, stats)
    assert torch.allclose(head(hd, ht, dial, stats), torch.full((3, 5), 0.5))
    with torch.no_grad():  # a weight on max p (the first stat) moves w with it
        head.out.weight[0, head.config.input_width - 5] = 5.0
    hi, lo = stats.clone(), stats.clone()
    hi[..., 0], lo[..., 0] = 1.0, 0.0
    assert bool((head(hd, ht, dial, hi) > head(hd, ht, dial, lo)).all())
    assert not wants_stats(WeightHead(HeadConfig(8, 12))) and not wants_stats(lambda *a: None)
    with pytest.raises(ValueError, match="inputs"):
        HeadConfig(8, 12, inputs="logits")
