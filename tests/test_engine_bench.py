"""`dialspec bench engine --quick` on the tiny pair writes the JSON and markdown with every row."""

from __future__ import annotations

import json

import pytest
import torch

from server.cli import main
from server.engine.embedded.bench.workload import request_lengths


def test_bench_engine_quick_writes_every_row(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "bench"
    argv = ["bench", "engine", "--quick", "--target", str(target), "--draft", str(draft)]
    argv += [
        "--concurrency",
        "1,2",
        "--waves",
        "1,2",
        "--tiers",
        "exact,lite",
        "--sweep",
        "--max-num-draft",
        "2",
    ]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "engine.json").read_text())
    md = (out / "engine.md").read_text()
    tiers = ["exact", "lite"]
    methods = ["hf_generate", "dialspec_ar", "dialspec_ar_control", "dialspec_ar_uniform"]
    methods += [f"dialspec_{t}" for t in tiers]
    methods += [f"dialspec_{t}_N{n}" for t in tiers for n in range(3)]
    got = {(r["method"], r["concurrency"]) for r in report["rows"]}
    # HF assisted generation is batch-1 only: measured once, at c = 1.
    expected = {(m, c) for m in methods for c in (1, 2)} | {("hf_assisted", 1), ("hf_assisted_w0.5", 1)}
    assert got == expected
    by = {(r["method"], r["concurrency"]): r for r in report["rows"]}
    # every method serves the same workload, twice over at c = 2 (--waves 1,2), lengths spread
    lengths = {c: request_lengths(2 * c, 8, 0.25) for c in (1, 2)}
    for m in methods:
        for c in (1, 2):
            uniform = m in ("hf_generate", "dialspec_ar_uniform")  # HF's workload: every request at the mean
            want = 2 * c * 8 if uniform else sum(lengths[c])
            assert by[(m, c)]["tokens"] == want, (m, c)
    assert len(set(lengths[2])) > 1
    for n in range(3):  # a pinned N is what ran
        assert abs(by[(f"dialspec_exact_N{n}", 1)]["mean_n"] - n) < 1e-9
    for r in report["rows"]:
        assert r["tokens_per_s"] > 0
        if r["method"].startswith("dialspec_"):
            assert r["round_error"] is not None and 0 <= r["verify_fraction"] <= 1
        assert f"| {r['method']} | {r['concurrency']} |" in md
    names = " ".join(report["targets"])
    parts = ("exact / AR, c=1", "adaptive / best fixed N", "AR / HF generate", "mean round time")
    assert all(part in names for part in parts) and "noise: AR control / AR, c=1" in names
    meta = report["meta"]
    assert meta["cost_model"]["target_ms"] and meta["bandwidth"]["limit_tokens_per_s"] > 0
    assert meta["dtype"] in ("float32", "bfloat16") and meta["dtype_choice"]["dtype"] == meta["dtype"]
    assert "## Cost model" in md and "x waves=1 at c=1, 2 at c=2" in md


def test_bench_engine_reports_the_grammar_cost_per_round(tiny_pair, tmp_path):
    """`--response-format json`: every engine request is constrained, and each row reports its
    masks' host time per round."""
    target, draft = tiny_pair
    out = tmp_path / "bench"
    argv = ["bench", "engine", "--quick", "--target", str(target), "--draft", str(draft), "--no-hf"]
    assert main([*argv, "--tiers", "exact,lite", "--response-format", "json", "--out", str(out)]) == 0
    report = json.loads((out / "engine.json").read_text())
    assert report["meta"]["response_format"] == "json"
    assert report["rows"] and all(r["grammar_ms"] > 0 for r in report["rows"])
    md = (out / "engine.md").read_text()
    assert "grammar ms" in md and "response_format json" in md


def test_request_lengths_spread_evenly_around_the_mean():
    """Bench requests differ in length (so rows do not finish in lockstep) with the mean kept."""
    lengths = request_lengths(64, 24, 0.25)
    assert min(lengths) >= 18 and max(lengths) <= 30 and len(set(lengths)) >= 10
    assert abs(sum(lengths) / 64 - 24) < 0.5
    assert lengths[:8] == request_lengths(8, 24, 0.25)  # a prefix of a longer run: the same requests
    assert request_lengths(8, 24, 0.0) == [24] * 8


def test_bench_engine_max_seconds_stops_starting_runs(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "bench"
    argv = ["bench", "engine", "--quick", "--target", str(target), "--draft", str(draft), "--no-hf"]
    assert main([*argv, "--tiers", "exact", "--max-seconds", "0.001", "--out", str(out)]) == 0
    report = json.loads((out / "engine.json").read_text())
    assert report["meta"]["stopped_early"] and report["rows"] == []


def test_bench_engine_user_mistakes_are_cli_errors(tmp_path, capsys):
    assert main(["bench", "engine", "--target", str(tmp_path)]) == 2
    assert main(["bench", "engine", "--target", str(tmp_path), "--draft", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["bench", "engine", "--tiers", "exact,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["bench", "engine", "--sweep", "0,x"]) == 2
    assert "--sweep takes Ns" in capsys.readouterr().err
    assert main(["bench", "engine", "--sweep", "2,9", "--max-num-draft", "8"]) == 2
    assert "0..--max-num-draft (8)" in capsys.readouterr().err
    assert main(["bench", "engine", "--concurrency", "1,8", "--waves", "1,2,4"]) == 2
    assert "one per --concurrency (2)" in capsys.readouterr().err
    assert main(["bench", "engine", "--waves", "x"]) == 2
    assert main(["bench", "engine", "--waves", "0"]) == 2
    assert main(["bench", "engine", "--length-spread", "1"]) == 2
    assert "--length-spread must be in [0, 1)" in capsys.readouterr().err


def test_bench_engine_device_mistakes_are_cli_errors(tiny_pair, capsys):
    target, draft = tiny_pair
    base = ["bench", "engine", "--quick", "--target", str(target), "--draft", str(draft)]
    assert main([*base, "--device", "gpu0"]) == 2
    assert "not a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_trials_start_at_different_rows_and_run_every_row_once():
    from server.engine.embedded.bench.runner import _rotated

    plan = list(range(7))
    orders = [_rotated(plan, k, 3) for k in range(3)]
    assert all(sorted(o) == plan for o in orders)
    assert len({o[0] for o in orders}) == 3 and orders[0] == plan


def test_round_predictions_are_judged_over_every_trial_not_the_fastest():
    """The row keeps its fastest trial's speed, but the cost model's round-time error is pooled over
    all trials: the fastest trial is picked by its measured time, so on its own it reads a bias
    that is only the selection (here +33 % on the kept trial, +0 % over both)."""
    from server.engine.embedded.bench.report import engine_row
    from server.engine.embedded.bench.runner import Best

    def timers(predicted: float, measured: float) -> dict:
        return {
            "predicted_round_s": predicted, "measured_predicted_round_s": measured,
            "abs_error_s": abs(predicted - measured), "profile_abs_error_s": abs(predicted - measured),
            "prefill_s": 0.0, "round_count": 10, "check_s": 0.1, "round_s": measured,
            "draft_tokens": 0, "row_rounds": 10, "plan_count": 0,
        }  # fmt: skip

    best = Best()
    best.keep(("m", 8), (100, 1.0, [], timers(1.0, 0.75)))  # fast host: rounds under the model
    best.keep(("m", 8), (100, 1.5, [], timers(1.0, 1.25)))  # slow host: over it
    tokens, seconds, stats, kept = best.runs[("m", 8)]
    assert seconds == 1.0  # the speed is the fastest trial's
    alone = engine_row("m", 8, tokens, seconds, stats, kept, None)
    pooled = engine_row("m", 8, tokens, seconds, stats, {**kept, **best.mean_predictions(("m", 8))}, None)
    assert abs(alone.round_bias - 1 / 3) < 1e-9
    assert abs(pooled.round_bias) < 1e-9 and abs(pooled.round_error - 0.25) < 1e-9
    assert abs(pooled.predicted_tokens_per_s - 100.0) < 1e-9  # per trial: tokens / one trial's rounds


def test_a_run_counts_every_round_it_predicted(tiny_pair, monkeypatch):
    """The last chunk reaches the client inside the last round, before the scheduler records that
    round's prediction (slowed here by 50 ms): the run's timers must still hold every round with
    its prediction, or a run of few rounds reads predicted speeds a round too fast."""
    import asyncio
    import time

    from server.engine.embedded.bench.runner import tier_verification
    from server.engine.embedded.bench.workload import engine_run
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from server.engine.embedded.timers import StepTimers

    record = StepTimers.record_prediction

    def late(self, *args):
        time.sleep(0.05)
        record(self, *args)

    monkeypatch.setattr(StepTimers, "record_prediction", late)
    eng = EmbeddedEngine(EmbeddedEngineConfig(*tiny_pair, max_batch=2, max_context=96, profile_budget_s=0.2))
    eng.start_sync()
    try:
        prompts = ("Tom has 12 apples", "Sum 2 and 3")
        ids = [eng.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        _, _, _, timers = engine_run(eng, ids, 8, 1.0, tier_verification("q0"), clients=2)
        assert timers["round_count"] > 0 and timers["predicted_rounds"] == timers["round_count"]
    finally:
        asyncio.run(eng.stop())


def _row(n, rates):
    from server.engine.embedded.bench.report import BenchRow

    best = max(rates)
    return BenchRow("m", 1, 1, 1.0, best, tier="exact", fixed_n=n, trial_tokens_per_s=list(rates))


def test_paired_ratio_is_the_median_of_same_trial_ratios():
    from server.engine.embedded.bench.report import paired_ratio

    tier, ar = _row(None, [90, 120, 100]), _row(None, [100, 100, 110])
    assert paired_ratio(tier, ar) == pytest.approx(100 / 110)  # of 0.9, 1.2, 0.909
    assert paired_ratio(_row(None, [90, 120]), _row(None, [100, 100])) == pytest.approx(1.05)
    assert paired_ratio(_row(None, [90]), _row(None, [100])) is None


def test_held_out_ratio_picks_n_on_the_other_trials():
    from server.engine.embedded.bench.report import held_out_ratio

    adaptive = _row(None, [100, 90, 110])
    fixed = [_row(2, [120, 80, 100]), _row(4, [100, 100, 100])]
    ratio, picks = held_out_ratio(adaptive, fixed)
    # t=0: others (80+100) < (100+100) -> N=4; t=1: (120+100) > 200 -> N=2; t=2: 200 = 200 -> first max, N=2
    assert picks == [4, 2, 2]
    assert ratio == pytest.approx((100 / 100 + 90 / 80 + 110 / 100) / 3)
    assert held_out_ratio(adaptive, [_row(2, [120])]) is None  # one trial: nothing to hold out


def test_held_out_ratio_removes_the_max_over_rows_bias():
    """A planner exactly as fast as every fixed N (4 of them), 3 trials with 7 % lognormal noise,
    400 simulated benches: the raw best-of-trials ratio reads ~0.78σ low (E[max of 12] − E[max of
    3] normal order statistics: 1.63 − 0.85), the held-out one is unbiased up to exp(σ²) ≈ 1.005.
    Tolerances: the mean of 400 ratios with SD ~0.1 has an SE of ~0.005; allow 3 SE."""
    import numpy as np

    from server.engine.embedded.bench.report import held_out_ratio

    rng = np.random.default_rng(0)
    raw, held = [], []
    for _ in range(400):
        noisy = lambda: list(100 * np.exp(0.07 * rng.standard_normal(3)))  # noqa: E731
        adaptive, fixed = _row(None, noisy()), [_row(n, noisy()) for n in (0, 2, 4, 6)]
        raw.append(adaptive.tokens_per_s / max(f.tokens_per_s for f in fixed))
        held.append(held_out_ratio(adaptive, fixed)[0])
    assert np.mean(raw) == pytest.approx(1 - 0.78 * 0.07, abs=0.015)
    assert np.mean(held) == pytest.approx(np.exp(0.07**2), abs=0.015)


def test_where_drafting_pays_counts_only_rows_that_draft():
    """The Qwen-shape bench once read its worst "measured / predicted where drafting pays" off lite,
    a row that decoded plainly (mean N 0) with a predicted 1.02 from noise: that is AR's path."""
    from server.engine.embedded.bench.report import BenchRow, check_targets

    def row(method, tier, tps, mean_n=None, predicted=None, measured=None):
        return BenchRow(method, 1, 100, 1.0, tps, tier=tier, mean_n=mean_n, predicted_speedup=predicted,
                        measured_speedup=measured)  # fmt: skip

    rows = [
        row("dialspec_ar", None, 100.0),
        row("dialspec_lite", "lite", 98.0, mean_n=0.0, predicted=1.02, measured=0.9),
        row("dialspec_pro", "pro", 130.0, mean_n=3.0, predicted=1.4, measured=1.3),
    ]
    line = check_targets(rows, {})
    key = "measured / predicted speedup where drafting pays (worst: pro), c=1"
    assert line[key]["value"] == pytest.approx(1.3 / 1.4)
    rows[2].mean_n = 0.0
    assert not any("where drafting pays" in k for k in check_targets(rows, {}))


def test_the_tier_order_line_holds_each_tier_to_the_next_higher_within_the_noise_floor():
    """Each tier >= the next higher tier, judged against the run's noise floor (AR control / AR
    folded below 1): one line per adjacent pair of adaptive rows, one per pinned N (its worst pair).
    The issue's measurement (standard 1.37x against exact 1.56x, noise 1.05) fails its line."""
    from server.engine.embedded.bench.report import BenchRow, check_targets

    def row(method, tier, weight, tps, n=None):
        return BenchRow(method, 1, 100, 1.0, tps, tier=tier, weight=weight, fixed_n=n)

    rows = [
        row("dialspec_ar", None, None, 100.0), row("dialspec_ar_control", None, None, 105.0),
        row("dialspec_exact", "exact", 1.0, 156.0), row("dialspec_standard", "standard", 0.5, 137.0),
        row("dialspec_lite", "lite", 0.25, 155.0),
        row("dialspec_exact_N4", "exact", 1.0, 150.0, 4),
        row("dialspec_standard_N4", "standard", 0.5, 146.0, 4),
        row("dialspec_lite_N4", "lite", 0.25, 160.0, 4),
    ]  # fmt: skip
    lines = check_targets(rows, {})
    floor = 1 / 1.05
    standard = lines["tier order adaptive: standard / exact, c=1"]
    assert standard["value"] == pytest.approx(137 / 156) and standard["target"] == round(floor, 3)
    assert standard["met"] is False
    assert lines["tier order adaptive: lite / standard, c=1"]["met"] is True
    pinned = lines["tier order N=4 (worst pair): standard / exact, c=1"]
    assert pinned["value"] == pytest.approx(146 / 150) and pinned["met"] is True  # within the noise
    assert sum(k.startswith("tier order") for k in lines) == 3


def test_forced_acceptance_runs_the_real_round_at_the_asked_acceptance(tiny_pair):
    """`forced_tv`: each draft accepted with probability 1 − w·TV on the row's coins, the verify
    and bonus steps still run. Pinned N = 3 at w = 0.5, TV = 0.4: β = 0.8 per position, so a round
    accepts E[k] = 0.8 + 0.64 + 0.512 = 1.952 of 3 (rate 0.651). 8 requests x 40 tokens run ~100
    rounds; k's SD is 1.21, so the mean rate's SE is 0.04: allow 4 SE (0.16; the law itself is
    checked tightly below). Strict rows (a fixed N) still draw their bonus from ν, so bonus steps
    run; quality 0 accepts everything."""
    import asyncio

    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from server.engine.protocol import GenerationRequest, SamplingOptions
    from verifier.dial import Verification

    target, draft = tiny_pair
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(target, draft, max_batch=4, max_context=96, forced_tv=0.4, profile_budget_s=0.2)
    )
    engine.start_sync()
    try:
        ids = tuple(engine.encode_chat([{"role": "user", "content": "Tom has 12 apples"}]))

        def run(weight):
            async def one(i):
                req = GenerationRequest(
                    f"r{i}", ids, SamplingOptions(max_tokens=40, seed=i, ignore_eos=True),
                    Verification(weight=weight, num_draft=3),
                )  # fmt: skip
                return [c async for c in engine.generate(req)][-1].stats

            async def all_of():
                return await asyncio.gather(*[one(i) for i in range(8)])

            return asyncio.run(all_of())

        timers = engine.scheduler.timers
        timers.reset()
        stats = run(0.5)
        rate = sum(s.accepted_tokens for s in stats) / sum(s.draft_tokens for s in stats)
        assert rate == pytest.approx((0.8 + 0.64 + 0.512) / 3, abs=0.16)
        assert timers.counts.get("bonus", 0) > 0 and timers.drafted_rounds > 0
        assert engine.info.runtime["forced_tv"] == 0.4
        assert all(s.acceptance_rate == 1.0 for s in run(0.0))
    finally:
        engine.scheduler.stop()
    with pytest.raises(ValueError, match="forced_tv"):
        EmbeddedEngineConfig(target, draft, forced_tv=1.5).resolve()


def test_forced_acceptance_accepts_each_draft_with_probability_one_minus_w_tv():
    """The forced verdict's law over 20,000 rows of one round (N = 3, w = 0.5 and a baseline
    policy's w = 1, TV = 0.4): P(k >= i) = β^i with β = 0.8 and 0.6. k's SD is <= 1.21, so the
    SE of mean k is <= 0.0086: allow 4 SE (0.035). The emitted tokens are the accepted drafts,
    then one token."""
    from types import SimpleNamespace

    from server.engine.embedded.forced import force_acceptance
    from server.engine.embedded.round import Drafts, Outcome, Scores
    from verifier import Policy, PolicyKind

    rows, n, vocab = 20000, 3, 7
    gen = torch.Generator().manual_seed(0)
    for policy, beta in ((Policy(), 0.8), (Policy(PolicyKind.LOSSY), 0.6)):
        batch = SimpleNamespace(
            rows=[SimpleNamespace(policy=policy, greedy=False)] * rows, n=n, size=rows,
            device=torch.device("cpu"), greedy=False, u_verify=torch.rand(rows, n + 1, generator=gen),
            column=torch.tensor,
        )  # fmt: skip
        drafts = Drafts(torch.randint(0, vocab, (rows, n), generator=gen), None, None)
        scores = Scores(torch.rand(rows, n + 1, vocab, generator=gen).softmax(-1), None)
        out = Outcome([0] * rows, [[]] * rows, [[]] * rows, [[]] * rows, [])
        force_acceptance(batch, drafts, scores, out, [[0.5] * n] * rows, 0.4)
        mean = sum(out.num_accepted) / rows
        assert mean == pytest.approx(beta + beta**2 + beta**3, abs=0.035)
        for k, toks, x in zip(out.num_accepted, out.tokens, drafts.tokens.tolist(), strict=True):
            assert toks[:k] == x[:k] and 0 <= toks[k] < vocab and toks[k + 1 :] == [-1] * (n - k)


def test_the_bench_runs_alone_without_the_gateways_packages():
    """`python -m server.engine.embedded.bench engine` is how a bare GPU node (no FastAPI) runs the
    bench (`scripts/bench_ab.py` too): it must not import the gateway, and a mistake is one line."""
    import subprocess
    import sys

    code = (
        "import runpy, sys\n"
        "sys.modules['fastapi'] = None  # any import of it raises\n"
        "sys.argv = ['bench', 'engine', '--concurrency', '0']\n"
        "runpy.run_module('server.engine.embedded.bench', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "python -m server.engine.embedded.bench: error: need concurrency >= 1, --max-tokens >= 1 "
        "and 1 <= --max-num-draft <= 16"
    ]
