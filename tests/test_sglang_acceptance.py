"""The GPU acceptance suite's logic on CPU: statistics, verdicts, and whole runs against fake servers.

No GPU with SGLang is available here, so the suite (scripts/sglang_acceptance*.py) runs end to end
against tests/fake_sglang_pair.py: a correct fake runtime must pass every check, and each way a
runtime can be wrong (hooks not live, a hook-failure log line, requests not batched, a server that
does not start) must fail the check written for it, and only where expected. Fixed seeds make
every run reproducible; the statistical checks' levels are their documented alphas.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import sglang_acceptance as cli  # noqa: E402
import sglang_acceptance_checks as checks  # noqa: E402
from sglang_acceptance_client import Generation, gauge_max  # noqa: E402
from sglang_acceptance_stats import OTHER, bootstrap_increase, goodness_of_fit, two_sample  # noqa: E402
from sglang_acceptance_suite import DRAFT_PATHS, Handle, Suite, SuiteOptions  # noqa: E402

from tests.fake_sglang_pair import FakePairServer, p_law, q_law  # noqa: E402

N = 3


# ---------------------------------------------------------------------------- statistics


def _draws(law, n, seed):
    rng = random.Random(seed)
    return rng.choices(range(len(law)), weights=law, k=n)


def test_two_sample_false_alarms_at_its_level_and_has_power():
    law = [0.4, 0.3, 0.2, 0.05, 0.03, 0.02]
    pvalues = [two_sample(_draws(law, 400, s), _draws(law, 500, 1000 + s)).pvalue for s in range(200)]
    assert sum(p < 0.05 for p in pvalues) <= 20  # ~10 expected at 5 %; binomial tail 1e-3
    other = [0.3, 0.3, 0.25, 0.05, 0.05, 0.05]  # TV 0.1 away
    assert two_sample(_draws(law, 2000, 1), _draws(other, 2000, 2)).pvalue < 1e-6


def test_goodness_of_fit_matches_scipy_and_pools_small_cells():
    law = {0: 0.5, 1: 0.3, 2: 0.15, 3: 0.049}  # token 4.. is OTHER with mass 0.001
    sample = _draws([0.5, 0.3, 0.15, 0.049, 0.001], 1000, 3)
    got = goodness_of_fit(sample, law)
    obs = [sample.count(t) for t in range(4)]
    exp = [1000 * law[t] for t in range(4)]
    obs[3] += sample.count(4)  # OTHER's expected count 1 < 5: pooled into the smallest cell
    exp[3] += 1000 * 0.001
    ref = stats.chisquare(obs, exp)
    assert got.cells == 4 and got.pvalue == pytest.approx(ref.pvalue, rel=1e-9)
    assert goodness_of_fit([0] * 50, {0: 0.5, 1: 0.5}).pvalue < 1e-9
    assert goodness_of_fit([], law) is None and two_sample([1], []) is None


def test_bootstrap_bound_tracks_a_real_increase():
    lo = [(8, 10)] * 30 + [(6, 10)] * 30  # 0.7
    hi = [(5, 10)] * 30 + [(7, 10)] * 30  # 0.6
    up = bootstrap_increase(lo, hi, level=0.01, draws=500, seed=0)
    assert up.difference == pytest.approx(0.1) and 0 < up.lower < 0.1
    assert bootstrap_increase(hi, hi, level=0.01, draws=500, seed=0).lower < 0  # no increase: not > 0


# ---------------------------------------------------------------------------- verdicts


def _gen(tokens, rounds, accepted, n=N, **meta):
    m = {
        "spec_verify_ct": rounds,
        "spec_num_proposed_drafts": rounds * n,
        "spec_num_correct_drafts": accepted,
        "completion_tokens": len(tokens),
        "spec_accept_length": len(tokens) / rounds if rounds else None,
    }
    return Generation(list(tokens), {**m, **meta})


def test_counter_consistency_catches_each_inconsistency():
    good = _gen(range(9), rounds=3, accepted=5)
    assert checks.check_counters([good], N, "c").passed
    bad = [
        _gen(range(9), 3, 5, spec_num_proposed_drafts=10),
        _gen(range(9), 3, 10),  # more accepted than proposed
        _gen(range(20), 3, 5),  # 20 tokens from 3 rounds of at most N+1 plus the prefill token
        _gen(range(9), 3, 5, spec_accept_length=2.0),
    ]
    result = checks.check_counters(bad, N, "c")
    assert not result.passed and len(result.details) == 4


def test_probe_and_greedy_thresholds():
    assert checks.check_all_accepted([_gen(range(9), 2, 6)], "c").passed
    assert not checks.check_all_accepted([_gen(range(9), 2, 5)], "c").passed
    assert not checks.check_all_accepted([], "c").passed
    # greedy w = 0: the sampled first draft after the prefill may cost the first round only
    assert checks.check_greedy_w0([_gen(range(9), 3, 3 * N - N)], N, "c").passed
    assert not checks.check_greedy_w0([_gen(range(9), 3, 3 * N - N - 1)], N, "c").passed


def test_log_and_server_info_and_metrics_checks():
    log = "INFO x\nINFO dialspec SGLang plugin (launcher): all 7 hooks live\n"
    assert checks.check_log(log, "c").passed and "launcher" in checks.check_log(log, "c").summary
    failed = log + "ERROR Failed to apply hooks to sglang.srt.speculative.eagle_utils.eagle_sample\n"
    assert not checks.check_log(failed, "c").passed
    assert not checks.check_log("dialspec SGLang plugin (scheduler): hooks not live, refusing", "c").passed
    info = {"speculative_algorithm": "STANDALONE", "speculative_use_rejection_sampling": True}
    info |= {"speculative_num_steps": N, "speculative_eagle_topk": 1}
    assert checks.check_server_info(info, N, "c").passed
    assert not checks.check_server_info({**info, "speculative_use_rejection_sampling": False}, N, "c").passed
    assert checks.check_metrics(
        'sglang:spec_accept_rate{a="b"} 0.5\nsglang:spec_accept_length 2\n', "c"
    ).passed
    assert not checks.check_metrics("sglang:num_running_reqs 3\n", "c").passed
    assert (
        gauge_max(
            'sglang:num_running_reqs{x="1"} 3\nsglang:num_running_reqs{x="2"} 41.0\n',
            "sglang:num_running_reqs",
        )
        == 41
    )


def test_nu_mix_and_contexts():
    p, q = {1: 0.5, 2: 0.3}, {1: 0.1, 2: 0.2, 3: 0.4}
    assert checks.mix(p, q, 0.25) == pytest.approx({1: 0.2, 2: 0.225})  # cells: tokens known in both
    assert checks.contexts([(1, 2), (1, 3), (4, 5), (1,)], min_count=2) == {1: [2, 3]}
    assert OTHER not in checks.mix(p, q, 0.5)


# ---------------------------------------------------------------------------- whole runs


class FakeServers:
    """The suite's `Servers` over fake pair servers; `broken` roles fail to start."""

    def __init__(self, mode="ok", broken=()):
        self.mode, self.broken, self.started = mode, set(broken), []

    def start(self, role, flags):
        if role in self.broken:
            raise RuntimeError("exited with status 1 during startup: HooksNotLive")
        server = FakePairServer(role, self.mode, num_draft=N).start()
        self.started.append((role, flags))
        handle = Handle(server.url, f"fake {role} {' '.join(flags)}", lambda: server.log)
        handle.server = server
        return handle

    def stop(self, handle):
        handle.server.stop()


def _options(**kw):
    base = dict(
        num_draft=N,
        law_prompts=[[1, 2], [3]],
        greedy_prompts=[[1], [2], [4], [5]],
        law_samples=700,
        law_tokens=3,
        sweep_requests=96,
        sweep_tokens=32,
        probe_requests=4,
        probe_tokens=16,
        greedy_tokens=12,
        mixed_concurrency=48,
        mixed_samples=384,
        mixed_tokens=8,
        min_context=60,
        top_k=6,
        bootstrap_draws=300,
        greedy_tolerance=0.0,
    )
    return SuiteOptions(**{**base, **kw})


def _by_name(results):
    return {(r.name, r.config): r for r in results}


DEFAULT = DRAFT_PATHS[0].name


@pytest.mark.slow
def test_a_correct_runtime_passes_every_check():
    servers = FakeServers()
    suite = Suite(_options(), servers, [DRAFT_PATHS[0], DRAFT_PATHS[2]])
    results = suite.run()
    failed = [f"{r.name} [{r.config}]: {r.summary} {r.details}" for r in results if not r.passed]
    assert not failed, failed
    names = {r.name for r in results}
    for needed in (
        "preflight: server_info",
        "hooks live: log",
        "hooks live: w = 0 probe",
        "acceptance rises as w falls (T = 1)",
        "greedy w = 0 accepts all but the first round",
        "greedy w = 1 equals the plain target",
        "w = 1 law equals the plain target",
        "power: w = 0.5 law differs from the target",
        "w = 0.5: y2 | context follows ν",
        "mixed w ran batched",
        "mixed batch: w = 0 rows accept every draft",
        "mixed batch: w = 0 rows follow their own ν",
        "mixed batch: w = 1 rows follow their own ν",
        "log-prob request served",
        "meta_info counters",
        "metrics present",
    ):
        assert needed in names, needed
    assert [role for role, _ in servers.started] == ["plugin", "plugin", "target", "draft"]
    assert servers.started[1][1] == ("--cuda-graph-max-bs-decode", "4", "--decode-log-interval", "1")
    nu = _by_name(results)[("w = 0.5: y2 | context follows ν", DEFAULT)]
    assert not nu.summary.startswith("0 contexts")


@pytest.mark.slow
def test_stock_runtime_fails_the_checks_that_prove_the_plugin_live():
    results = Suite(_options(), FakeServers("stock"), [DRAFT_PATHS[0]]).run()
    failed = {r.name for r in results if not r.passed}
    assert {
        "hooks live: w = 0 probe",
        "acceptance rises as w falls (T = 1)",
        "power: w = 0.5 law differs from the target",
        "w = 0.5: y2 | context follows ν",
        "mixed batch: w = 0 rows accept every draft",
        "mixed batch: w = 0 rows follow their own ν",
    } <= failed
    # What a stock runtime does right is not blamed on it.
    assert {"w = 1 law equals the plain target", "mixed batch: w = 1 rows follow their own ν"}.isdisjoint(
        failed
    )


@pytest.mark.parametrize(
    "mode, broken, expected",
    [
        ("hook_log", (), {"hooks live: log"}),
        ("serial", (), {"mixed w ran batched"}),
        ("ok", ("plugin",), {"plugin server starts"}),
    ],
)
def test_each_defect_fails_its_own_check(mode, broken, expected):
    opts = _options(law_samples=300, mixed_samples=96, min_context=30)
    results = Suite(opts, FakeServers(mode, broken), [DRAFT_PATHS[0]]).run()
    failed = {r.name for r in results if not r.passed}
    assert expected <= failed, failed
    if not broken:
        assert failed == expected, failed


def test_report_and_cli(tmp_path):
    results = [
        checks.CheckResult("a", "cfg", checks.PASS, "fine"),
        checks.CheckResult("b | c", "cfg", checks.FAIL, "broken", ["detail 1"]),
    ]
    text = cli.render(results, {"gpu": "fake"}, _options(), {"cfg": "python -m sglang.launch_server ..."})
    assert "**FAIL**: 1 of 2 checks passed." in text and "| b / c | cfg | FAIL | broken |" in text
    assert (
        "### b | c (cfg)" in text and "- detail 1" in text and "`python -m sglang.launch_server ...`" in text
    )
    assert "no check relies on seeded reproducibility" in text
    script = ROOT / "scripts" / "sglang_acceptance.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--deterministic" in out.stdout
    bad = subprocess.run(
        [sys.executable, str(script), "--target", str(tmp_path), "--draft", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a local model directory" in bad.stderr


def test_preflight_shared_vocabulary(tiny_pair, tmp_path):
    target, draft = tiny_pair
    assert cli.shared_vocab(str(target), str(draft)).passed
    assert not cli.shared_vocab(str(target), str(tmp_path)).passed


def test_fake_pair_laws_are_far_enough_apart_for_power():
    tv = [
        0.5 * sum(abs(a - b) for a, b in zip(p_law(c), q_law(c), strict=True))
        for c in ([1, 2], [3], [1, 2, 4])
    ]
    assert min(tv) > 0.1
