"""The chain bound (training/chain_bound.py): its two claims checked by brute force on random
replies, and the script on the shipped pair."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.chain_bound import chain_bound, policy_cost, success_probability

ROOT = Path(__file__).resolve().parents[1]


def _replies(seed: int, b: int = 6, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(b, t, generator=g, dtype=torch.float64) ** 2  # skewed: many small, a few large
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 3:] = False  # ragged replies
    return a, mask


def _chord(a, mask, cost):
    full = (a * mask).sum(-1)
    p0 = success_probability(torch.zeros_like(a), a, mask)
    return p0 + (1 - p0) * cost / full


def test_success_probability_is_the_product_over_real_positions():
    a = torch.tensor([[0.5, 0.2, 0.9]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    w = torch.tensor([[0.5, 0.0, 0.0]], dtype=torch.float64)
    assert success_probability(w, a, mask).item() == pytest.approx((1 - 0.25) * (1 - 0.2))
    assert policy_cost(w, a, mask).item() == pytest.approx(0.25)


@pytest.mark.parametrize("seed", range(4))
def test_no_policy_rises_above_its_replys_chord(seed):
    """Claim 1: every 0/1 policy (all 2^T of them) and 200 random fractional ones sit on or below
    the chord of their reply."""
    a, mask = _replies(seed)
    t = a.shape[1]
    subsets = torch.tensor(list(itertools.product((0.0, 1.0), repeat=t)), dtype=torch.float64)  # [2^T, T]
    g = torch.Generator().manual_seed(100 + seed)
    fractional = torch.rand(200, t, generator=g, dtype=torch.float64)
    for w in torch.cat([subsets, fractional]):
        w = w.expand_as(a)
        cost = policy_cost(w, a, mask)
        gap = success_probability(w, a, mask) - _chord(a, mask, cost)  # [B]
        assert float(gap.max()) <= 1e-12


def test_the_claim_needs_every_unit_of_tv_to_be_an_error():
    """If only some positions can break the reply (the others' TV is a harmless alternative), a
    policy that defers exactly there rises above the chord: the bound rests on the chain model's
    premise, which `gain_share` checks on real replies; the check above can fail."""
    a, mask = _replies(0)
    critical = torch.zeros_like(mask)
    critical[:, :2] = True  # only the first two positions of each reply can break it
    w = critical.double()
    p = success_probability(w, a, mask & critical)  # 1: the critical positions are exact
    p0 = success_probability(torch.zeros_like(a), a, mask & critical)
    chord = p0 + (1 - p0) * policy_cost(w, a, mask) / (a * mask).sum(-1)
    assert float((p - chord).min()) > 0.01


@pytest.mark.parametrize("seed", range(3))
def test_the_oracle_bounds_every_pooled_policy_and_tops_the_chord(seed):
    """Claim 2: pooled over replies, random per-position policies (any weights, different per
    reply) never beat the oracle at their total cost; the oracle is never below the chord and the
    two meet at both ends."""
    a, mask = _replies(seed, b=8)
    bound = chain_bound(a, mask)
    assert torch.all(bound.oracle >= bound.chord - 1e-12)
    assert float(bound.oracle[0]) == pytest.approx(float(bound.chord[0]))
    assert float(bound.oracle[-1]) == pytest.approx(1.0)
    assert bound.room > 0.0
    g = torch.Generator().manual_seed(seed)
    for _ in range(300):
        share = torch.rand(a.shape[0], 1, generator=g, dtype=torch.float64)  # [B, 1] per reply
        w = torch.rand(a.shape, generator=g, dtype=torch.float64) * share  # [B, T]
        frac = float(policy_cost(w, a, mask).sum()) / bound.total_cost
        score = float(success_probability(w, a, mask).mean())
        limit = float(np.interp(frac, bound.cost.numpy(), bound.oracle.numpy()))
        assert score <= limit + 1e-9


def test_identical_replies_leave_no_room():
    a, mask = _replies(1, b=1)
    bound = chain_bound(a.expand(5, -1), mask.expand(5, -1))
    assert bound.room == pytest.approx(0.0, abs=1e-12)
    assert bound.max_room == pytest.approx(0.0, abs=1e-12)


def test_the_script_on_the_shipped_pair():
    out = subprocess.run(
        [sys.executable, "scripts/chain_bound.py", "--tasks", "math", "--limit", "6", "--split", "dev"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (
        "math (6 references" in out.stdout
        and "gain share" in out.stdout
        and "oracle over chord" in out.stdout
    )


def test_the_script_refuses_bad_input_in_one_line():
    for args in (
        ["--tasks", "poetry"],
        ["--limit", "0"],
        ["--pair", "/nonexistent"],
        ["--results", "/nope.json"],
    ):
        out = subprocess.run(
            [sys.executable, "scripts/chain_bound.py", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, args
        assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def _row(policy, family, x, scores, accepted, proposed=10):
    n = len(scores)
    return {
        "policy": policy,
        "family": family,
        "x": x,
        "acceptance": sum(accepted) / (proposed * n),
        "score": sum(scores) / n,
        "norm_time": 1.0,
        "per_prompt": {"scores": scores, "accepted": accepted, "proposed": [proposed] * n},
    }


def test_the_script_realises_the_oracle_on_an_evals_rows(tmp_path):
    """With --results: the eval's prompts are forced (its split, seed, count), and the realised
    oracle takes SD's measured row on the top share of replies by slope, the draft's elsewhere."""
    n = 6
    rows = [
        _row("SD", "sd", 1.0, [1.0] * n, [7] * n),
        _row("static w=0", "static", 0.0, [0.0] * n, [10] * n),
        _row("SpecCascade a=0.5", "cascade", 0.5, [1.0, 0.0] * (n // 2), [8] * n),
    ]
    results = {"config": {"split": "dev", "limit": n, "seed": 0}, "tasks": {"math": {"policies": rows}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    out = subprocess.run(
        [sys.executable, "scripts/chain_bound.py", "--tasks", "math", "--results", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"math ({n} references" in out.stdout
    assert "w=1 1.000 (measured 1.000)" in out.stdout and "w=0 " in out.stdout
    # SD on the top half of 6 replies: 3 scored 1, acceptance (3·7 + 3·10) / 60
    assert "SD on top 50% 0.850 acc, 0.500" in out.stdout
    assert "oracle vs cascade:" in out.stdout


def test_the_script_forces_every_pooled_runs_prompts(tmp_path):
    """A `dialspec eval-pool` output names its seeds; the references are every run's, in order."""
    rows = [_row("SD", "sd", 1.0, [1.0] * 6, [7] * 6), _row("static w=0", "static", 0.0, [0.0] * 6, [10] * 6)]
    config = {"split": "dev", "limit": 3, "seed": None, "pooled_seeds": [0, 1]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": config, "tasks": {"math": {"policies": rows}}}))
    out = subprocess.run(
        [sys.executable, "scripts/chain_bound.py", "--tasks", "math", "--results", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "math (6 references" in out.stdout and "SD on top 50% 0.850 acc, 0.500" in out.stdout
