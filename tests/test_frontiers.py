"""Frontier math (`training.frontiers`): hulls, areas, and the paired dominance verdict's error rates."""

from __future__ import annotations

import numpy as np
import pytest

from training.frontiers import Point, analyse, frontier_at


def test_frontier_is_the_monotone_upper_hull():
    xs = np.array([0.2, 0.5, 0.6, 1.0])  # acceptance
    ys = np.array([0.9, 0.5, 0.8, 0.1])  # score; (0.5, 0.5) lies under the chord of its neighbours
    grid = np.array([0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.1])
    f = frontier_at(xs, ys, grid)
    assert f[0] == pytest.approx(0.9)  # left of every point: the best score there (flat)
    assert f[2] == pytest.approx(0.9 - (0.9 - 0.8) * (0.4 - 0.2) / 0.4)  # on the chord 0.2 -> 0.6
    assert f[3] == pytest.approx(0.8) and f[4] == pytest.approx(0.45)
    assert np.isnan(f[6])  # beyond the highest acceptance the method cannot go
    # A higher-acceptance point that scores more serves lower acceptance too (non-increasing).
    g = frontier_at(np.array([0.3, 0.7]), np.array([0.2, 0.6]), np.array([0.3, 0.5]))
    assert g == pytest.approx([0.6, 0.6])


def _method(family, shifts, rng, prompts=96):
    """Points along score = 0.9 − 0.6·acceptance + shift; per-prompt Bernoulli scores."""
    pts = []
    for i, acc in enumerate(np.linspace(0.6, 0.95, 5)):
        p = np.clip(0.9 - 0.6 * acc + shifts, 0, 1)
        scores = (rng.random(prompts) < p).astype(float)
        proposed = np.full(prompts, 50.0)
        pts.append(Point(family, f"{family}{i}", scores, np.round(proposed * acc), proposed, 1.0 - acc / 2))
    return pts


@pytest.mark.parametrize("seed", range(3))
def test_a_clearly_better_method_dominates_and_equal_methods_do_not(seed):
    rng = np.random.default_rng(seed)
    better = {"base": _method("base", 0.0, rng), "better": _method("better", 0.25, rng)}
    pair = analyse(better, boot=200, seed=seed)["pairs"]["base vs better"]
    assert pair["verdict"] == "better dominates" and pair["mean_diff"] < -2 * pair["se"]
    same = {"a": _method("a", 0.0, rng), "b": _method("b", 0.0, rng)}
    assert analyse(same, boot=200, seed=seed)["pairs"]["a vs b"]["verdict"] == "neither dominates"


def test_false_dominance_rate_is_small_for_identical_methods():
    """Two methods with the same law: the 2-SE rule should rarely call a winner (about 2.5% per
    side if the bootstrap SE is right; 40 trials, allow up to 6 calls: P(Binom(40, 0.05) > 6) ≈ 1%)."""
    rng = np.random.default_rng(7)
    calls = 0
    for trial in range(40):
        groups = {"a": _method("a", 0.0, rng, 64), "b": _method("b", 0.0, rng, 64)}
        calls += analyse(groups, boot=100, seed=trial)["pairs"]["a vs b"]["verdict"] != "neither dominates"
    assert calls <= 6


def test_areas_share_one_range_and_time_axis_uses_norm_time():
    rng = np.random.default_rng(3)
    groups = {"a": _method("a", 0.0, rng), "b": _method("b", 0.1, rng)}
    out = analyse(groups, boot=50)
    assert out["range"] == pytest.approx((0.6, 0.95), abs=0.02)
    assert out["areas"]["b"]["area"] > out["areas"]["a"]["area"]
    timed = analyse(groups, axis="time", boot=50)
    assert timed["range"][0] < timed["range"][1] < 0  # stored as −norm_time


def test_areas_leave_out_methods_whose_frontiers_end_before_the_others_begin():
    """On math and code, lossy and typical acceptance sits a point above SD's and no higher, so no
    range was shared by every method and the areas table was empty. Now the methods that end too
    early are left out (and named, with where they end), and the rest are compared."""
    rng = np.random.default_rng(4)
    groups = {"a": _method("a", 0.0, rng), "b": _method("b", 0.1, rng)}
    narrow = _method("narrow", 0.0, rng)[:1]  # one point at acceptance 0.6: a range of zero width
    out = analyse({**groups, "narrow": narrow}, boot=20)
    assert set(out["areas"]) == {"a", "b"} and out["left_out"] == {"narrow": pytest.approx(0.6, abs=0.01)}
    full = analyse(groups, boot=20)
    assert out["range"] == full["range"] and out["areas"]["b"]["area"] == pytest.approx(
        full["areas"]["b"]["area"]
    )
    assert "a vs narrow" in out["pairs"]  # pairwise verdicts still cover every method
    assert full["left_out"] == {}


def test_prompt_oracle_matches_brute_force_over_every_per_prompt_choice():
    """Five prompts, three settings with unequal draft counts: every one of the 3^5 per-prompt
    choices gives a (pooled acceptance, mean score) point; the oracle's frontier is their hull."""
    import itertools

    from training.frontiers import prompt_oracle

    rng = np.random.default_rng(3)
    prompts, pts = 5, []
    for k, acc in enumerate((0.7, 0.85, 1.0)):
        proposed = rng.integers(20, 60, prompts).astype(float)
        accepted = np.round(proposed * np.clip(acc + rng.normal(0, 0.05, prompts), 0, 1))
        scores = np.clip(1.0 - 0.8 * (acc - 0.7) / 0.3 + rng.normal(0, 0.3, prompts), 0, 1)  # ROUGE-like
        pts.append(Point("m", f"m{k}", scores, accepted, proposed, 1.0))
    cols = np.arange(prompts)
    acc_k, prop_k, score_k = (
        np.stack([getattr(p, f) for p in pts]) for f in ("accepted", "proposed", "scores")
    )
    xs, ys = [], []
    for pick in itertools.product(range(3), repeat=prompts):
        pick = np.array(pick)  # [P] the setting each prompt takes
        xs.append(acc_k[pick, cols].sum() / prop_k[pick, cols].sum())
        ys.append(score_k[pick, cols].mean())
    ox, oy = prompt_oracle(pts)
    grid = np.linspace(min(xs), max(xs), 25)  # every acceptance some choice reaches
    # the Lagrangian grid finds the hull's vertices up to ~1e-4 (a vertex almost on a chord)
    assert frontier_at(ox, oy, grid) == pytest.approx(frontier_at(np.array(xs), np.array(ys), grid), abs=1e-3)
    # and it is never below any single setting's own frontier
    own = frontier_at(
        np.array([p.accepted.sum() / p.proposed.sum() for p in pts]),
        np.array([p.scores.mean() for p in pts]),
        grid,
    )
    assert np.all(frontier_at(ox, oy, grid) >= np.nan_to_num(own, nan=-1) - 1e-12)


def test_prompt_oracle_script_reads_an_eval_and_explains_a_missing_file(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "prompt_oracle", Path(__file__).parents[1] / "scripts/prompt_oracle.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = np.random.default_rng(0)
    policies = [{"policy": "AR", "family": "ar", "acceptance": None}]
    for fam, shift in (("static", 0.0), ("cascade", 0.1)):
        for p in _method(fam, shift, rng):
            pp = {
                "scores": p.scores.tolist(),
                "accepted": p.accepted.tolist(),
                "proposed": p.proposed.tolist(),
            }
            acc = p.accepted.sum() / p.proposed.sum()
            policies.append(
                {
                    "policy": p.name,
                    "family": fam,
                    "acceptance": acc,
                    "per_prompt": pp,
                    "norm_time": p.norm_time,
                }
            )
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"tasks": {"math": {"policies": policies}}}))
    assert script.main([str(path), "--methods", "static,cascade"]) == 0
    out = capsys.readouterr().out
    assert "math (10 points" in out and "oracle - static" in out and "oracle - cascade" in out
    lead = {
        m: float(out.split(f"oracle - {m}")[1].split("mean")[1].split()[0]) for m in ("static", "cascade")
    }
    assert lead["static"] > lead["cascade"] >= 0  # the oracle can take the better method's points
    assert script.main([str(tmp_path / "missing.json")]) == 2
    assert "dialspec eval --out" in capsys.readouterr().err


def _timed_method(family, rng, drift, ar, chunked, sigma, shift=0.0, prompts=384):
    """`_method`'s points with C chunk times: true time (1 − acc/2)·(1 − shift) times the chunk's
    host speed `drift` (shared by every policy: they ran that chunk in the same minutes) and
    lognormal noise of its own (σ per chunk)."""
    pts = []
    for i, acc in enumerate(np.linspace(0.6, 0.95, 5)):
        scores = (rng.random(prompts) < 0.9 - 0.6 * acc).astype(float)
        proposed = np.full(prompts, 50.0)
        secs = (1 - acc / 2) * (1 - shift) * drift * np.exp(sigma * rng.standard_normal(len(drift)))  # [C]
        chunks = np.stack([secs, np.full(len(drift), 100.0)], 1)  # [C, 2] (seconds, tokens)
        norm = (secs.sum() / chunks[:, 1].sum()) / (ar[:, 0].sum() / ar[:, 1].sum())
        pt = Point(family, f"{family}{i}", scores, np.round(proposed * acc), proposed, norm,
                   chunks if chunked else None, ar if chunked else None)  # fmt: skip
        pts.append(pt)
    return pts


def _host(rng, chunks=12, ar_sigma=0.15):
    drift = np.exp(0.5 * rng.standard_normal(chunks))  # [C] the host's speed, chunk by chunk
    ar_secs = drift * np.exp(ar_sigma * rng.standard_normal(chunks))  # [C]
    ar = np.stack([ar_secs, np.full(chunks, 100.0)], 1)  # [C, 2]
    return drift, ar


def test_norm_time_on_chunks_recomputes_the_ratio_of_sums():
    drift, ar = _host(np.random.default_rng(0), 4)
    p = _timed_method("a", np.random.default_rng(1), drift, ar, True, 0.3)[0]
    assert p.norm_time_on(None) == p.norm_time  # as measured
    assert p.norm_time_on(np.arange(4)) == pytest.approx(p.norm_time)  # every chunk once: the same
    pick = np.array([0, 0, 3, 3])
    own, base = p.chunk_time[pick].sum(0), ar[pick].sum(0)
    assert p.norm_time_on(pick) == pytest.approx((own[0] / own[1]) / (base[0] / base[1]))
    assert Point("a", "a", p.scores, p.accepted, p.proposed, 0.7).norm_time_on(pick) == 0.7  # no chunks


def test_chunk_resampling_puts_the_hosts_timing_noise_into_the_time_verdict():
    """Two methods with one law, 384 prompts (score noise small) and 30 % timing noise per chunk
    over 12 chunks (time noise large). With chunk times the 2-SE rule should call a winner in
    about 5 % of trials (measured 8 % over 100 trials: 12 clusters make the bootstrap SE a little
    small); 40 trials, allow up to 8 (P(Binom(40, 0.08) > 8) < 1 %). Without them the bootstrap
    sees no timing noise and calls one far more often (measured 24 %; require at least 5:
    P(Binom(40, 0.24) < 5) ≈ 1.5 %). A drift shared by every policy of a chunk (what interleaving
    leaves) cancels in the normalised time: alone, it adds nothing to the SE."""
    calls = {True: 0, False: 0}
    for trial in range(40):
        for chunked in (True, False):
            rng = np.random.default_rng(100 + trial)  # the same data either way
            drift, ar = _host(rng)
            groups = {k: _timed_method(k, rng, drift, ar, chunked, 0.3) for k in ("a", "b")}
            verdict = analyse(groups, axis="time", boot=100, seed=trial)["pairs"]["a vs b"]["verdict"]
            calls[chunked] += verdict != "neither dominates"
    assert calls[True] <= 8 and calls[False] >= 5
    se = {}
    for chunked in (True, False):
        rng = np.random.default_rng(9)
        drift, ar = _host(rng, ar_sigma=0.0)
        groups = {k: _timed_method(k, rng, drift, ar, chunked, 0.0, shift=0.1 * (k == "b")) for k in "ab"}
        se[chunked] = analyse(groups, axis="time", boot=100)["pairs"]["a vs b"]["se"]
    assert se[True] == pytest.approx(se[False], rel=1e-6)
