"""The acceptance suite's verdicts: pure functions from collected answers to CheckResults.

Each check names what it proves about an SGLang runtime with dialspec's plugin (DESIGN.md §1):
the ensemble rule ν = w·p + (1−w)·q is what the runtime samples, per request, in any batch, on
every draft path. Inputs are `Generation`s (scripts/sglang_acceptance_client.py) and next-token
laws read from plain target/draft servers; nothing here talks to a server, so every verdict is
unit-tested on CPU (tests/test_sglang_acceptance.py).

Terms
    N        draft length of the runtime; w the request's ensemble weight on the target.
    law      the distribution of generated tokens; position 1 is always the target's (SGLang
             samples the first token in the prefill, outside speculation), so law checks look at
             positions 2..L.
    context  a prompt plus a first generated token y1; the law of y2 given it is ν(· | context).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sglang_acceptance_client import Generation
from sglang_acceptance_stats import (
    acceptance_rate,
    bootstrap_increase,
    goodness_of_fit,
    per_position,
    two_sample,
)

PASS, FAIL = "PASS", "FAIL"
HOOK_FAILURE = re.compile(
    r"Failed to (apply hooks|execute general plugin|load plugin)|dialspec SGLang plugin \(\w+\): "
    r"(hooks not live|setup failed)"
)
HOOKS_LIVE = re.compile(r"dialspec SGLang plugin \((launcher|scheduler)\): all \d+ hooks live")


@dataclass
class CheckResult:
    name: str
    config: str
    status: str
    summary: str
    details: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == PASS


def _result(name: str, config: str, ok: bool, summary: str, details: list[str] | None = None) -> CheckResult:
    return CheckResult(name, config, PASS if ok else FAIL, summary, details or [])


def check_server_info(info: Mapping, num_draft: int, config: str) -> CheckResult:
    """`/server_info` (SGLang's resolved arguments) shows a STANDALONE chain under rejection sampling."""
    want = {
        "speculative_algorithm": "STANDALONE",
        "speculative_use_rejection_sampling": True,
        "speculative_num_steps": num_draft,
        "speculative_eagle_topk": 1,
    }
    wrong = [f"{k}={info.get(k)!r} (want {v!r})" for k, v in want.items() if info.get(k) != v]
    return _result(
        "preflight: server_info",
        config,
        not wrong,
        "; ".join(wrong) or "STANDALONE, rejection sampling, N ok",
    )


def check_log(text: str, config: str) -> CheckResult:
    """No hook-failure line in the runtime's log; reports whether the liveness lines were seen."""
    bad = [line.strip()[:200] for line in text.splitlines() if HOOK_FAILURE.search(line)]
    seen = sorted({m.group(1) for m in HOOKS_LIVE.finditer(text)})
    note = f"liveness confirmed in: {', '.join(seen) or 'no INFO line seen (log level?)'}"
    return _result("hooks live: log", config, not bad, f"{len(bad)} hook-failure lines; {note}", bad[:10])


def check_all_accepted(
    gens: Sequence[Generation], config: str, name: str = "hooks live: w = 0 probe"
) -> CheckResult:
    """T = 1, w = 0: ν = q, so every draft is accepted; stock SGLang essentially never does that."""
    bad = [
        f"request {i}: accepted {g.accepted} of {g.proposed}"
        for i, g in enumerate(gens)
        if g.proposed <= 0 or g.accepted != g.proposed
    ]
    total = sum(g.proposed for g in gens)
    return _result(
        name,
        config,
        bool(gens) and not bad,
        f"{len(gens) - len(bad)}/{len(gens)} requests accepted every draft ({total} drafts)",
        bad[:10],
    )


def check_counters(gens: Sequence[Generation], num_draft: int, config: str) -> CheckResult:
    """meta_info counters agree with each other: proposed = rounds·N, accepted ≤ proposed, the
    accept length is completion/rounds, and rounds ≤ completion ≤ 1 + rounds·(N+1) (the first
    token comes from the prefill, each round emits 1..N+1)."""
    bad = []
    for i, g in enumerate(gens):
        m = g.meta
        length = m.get("spec_accept_length")
        problems = [
            g.proposed != g.rounds * num_draft and "proposed != rounds·N",
            not 0 <= g.accepted <= g.proposed and "accepted outside [0, proposed]",
            not g.rounds <= g.completion <= 1 + g.rounds * (num_draft + 1)
            and "completion outside [rounds, 1 + rounds·(N+1)]",
            g.rounds
            and (length is None or abs(length - g.completion / g.rounds) > 1e-6)
            and "spec_accept_length != completion/rounds",
        ]
        problems = [p for p in problems if p]
        if problems:
            bad.append(
                f"request {i} ({ {k: m.get(k) for k in sorted(m) if k.startswith('spec_')} }): "
                + ", ".join(problems)
            )
    return _result(
        "meta_info counters",
        config,
        bool(gens) and not bad,
        f"{len(gens) - len(bad)}/{len(gens)} consistent",
        bad[:10],
    )


def check_metrics(exposition: str, config: str) -> CheckResult:
    names = ["sglang:spec_accept_rate", "sglang:spec_accept_length"]
    missing = [n for n in names if not re.search(rf"^{re.escape(n)}(\{{|\s)", exposition, flags=re.M)]
    return _result(
        "metrics present", config, not missing, f"missing: {missing}" if missing else ", ".join(names)
    )


def check_sweep(
    by_w: Mapping[float, Sequence[tuple[int, int]]], alpha: float, draws: int, seed: int, config: str
) -> CheckResult:
    """Acceptance strictly rises as w falls: for each adjacent pair the bootstrap lower bound of
    rate(lower w) − rate(higher w) is > 0 (one-sided, Bonferroni over the pairs)."""
    ws = sorted(by_w, reverse=True)
    pairs = list(zip(ws, ws[1:], strict=False))
    details, ok = (
        [f"w={w:g}: acceptance {acceptance_rate(by_w[w]):.4f} over {len(by_w[w])} requests" for w in ws],
        bool(pairs),
    )
    for hi, lo in pairs:
        b = bootstrap_increase(by_w[lo], by_w[hi], alpha / len(pairs), draws, seed)
        ok &= b.lower > 0
        details.append(
            f"w {hi:g} -> {lo:g}: +{b.difference:.4f}, lower bound {b.lower:.4f} "
            f"({'ok' if b.lower > 0 else 'NOT above 0'})"
        )
    summary = ", ".join(f"{w:g}:{acceptance_rate(by_w[w]):.3f}" for w in ws)
    return _result("acceptance rises as w falls (T = 1)", config, ok, summary, details)


def check_greedy_w0(gens: Sequence[Generation], num_draft: int, config: str) -> CheckResult:
    """T = 0, w = 0: argmax ν = argmax q, and the draft proposes argmax q, except that SGLang
    *samples* the first draft after the prefill (`_draft_extend_for_prefill`); so only the first
    round may fail: accepted ≥ proposed − N per request."""
    bad = [
        f"request {i}: accepted {g.accepted} of {g.proposed}"
        for i, g in enumerate(gens)
        if g.proposed <= 0 or g.accepted < g.proposed - num_draft
    ]
    rate = acceptance_rate([(g.accepted, g.proposed) for g in gens])
    return _result(
        "greedy w = 0 accepts all but the first round",
        config,
        bool(gens) and not bad,
        f"acceptance {rate:.4f}",
        bad[:10],
    )


def check_greedy_match(
    ours: Sequence[Sequence[int]], target: Sequence[Sequence[int]], tolerance: float, config: str
) -> CheckResult:
    """T = 0, w = 1: argmax ν = argmax p, so the output is the plain target's greedy output, up to
    `tolerance` of prompts differing (batched GPU arithmetic is not bit-reproducible unless the
    servers run with --enable-deterministic-inference; then use tolerance 0)."""
    differ = [i for i, (a, b) in enumerate(zip(ours, target, strict=True)) if list(a) != list(b)]
    share = len(differ) / max(1, len(ours))
    return _result(
        "greedy w = 1 equals the plain target",
        config,
        share <= tolerance,
        f"{len(differ)}/{len(ours)} prompts differ (allowed {tolerance:.0%})",
        [f"prompt {i}" for i in differ],
    )


def _position_tests(ours, target, positions) -> list[tuple[str, object]]:
    tests = []
    for p, (a, b) in enumerate(zip(ours, target, strict=True)):
        for k in positions:
            tests.append((f"prompt {p} position {k}", two_sample(per_position(a, k), per_position(b, k))))
    return [(label, t) for label, t in tests if t is not None]


def check_law_equal(
    ours,
    target,
    positions: Sequence[int],
    alpha: float,
    config: str,
    name: str = "w = 1 law equals the plain target",
) -> CheckResult:
    """Two-sample chi-square per (prompt, position), Bonferroni: no test may reject at alpha/m.
    `ours`, `target`: per prompt, lists of token sequences."""
    tests = _position_tests(ours, target, positions)
    level = alpha / max(1, len(tests))
    rejected = [
        f"{label}: p = {t.pvalue:.2e} (chi2 {t.statistic:.1f}, df {t.df})"
        for label, t in tests
        if t.rejects(level)
    ]
    worst = min((t.pvalue for _, t in tests), default=float("nan"))
    return _result(
        name,
        config,
        bool(tests) and not rejected,
        f"{len(tests)} tests at level {level:.1e}; smallest p {worst:.2e}",
        rejected,
    )


def check_power(other, target, positions: Sequence[int], alpha: float, w: float, config: str) -> CheckResult:
    """The same test must reject w < 1 samples against the target: otherwise a pass of the w = 1
    test says nothing (too few samples for this pair)."""
    tests = _position_tests(other, target, positions)
    level = alpha / max(1, len(tests))
    hits = [label for label, t in tests if t.rejects(level)]
    return _result(
        f"power: w = {w:g} law differs from the target",
        config,
        bool(hits),
        f"{len(hits)}/{len(tests)} tests reject" + ("" if hits else ": raise --law-samples"),
        hits,
    )


def contexts(samples: Sequence[Sequence[int]], min_count: int) -> dict[int, list[int]]:
    """y1 -> the y2 values that followed it, for y1 values seen at least `min_count` times."""
    follow: dict[int, list[int]] = defaultdict(list)
    for s in samples:
        if len(s) >= 2:
            follow[s[0]].append(s[1])
    return {y1: y2s for y1, y2s in follow.items() if len(y2s) >= min_count}


def mix(p: Mapping[int, float], q: Mapping[int, float], w: float) -> dict[int, float]:
    """ν = w·p + (1−w)·q on the tokens where both are known (the cells of the test)."""
    return {t: w * p[t] + (1 - w) * q[t] for t in p if t in q}


def check_nu(
    tests: Sequence[tuple[str, Sequence[int], Mapping[int, float]]], alpha: float, name: str, config: str
) -> CheckResult:
    """Goodness of fit of y2 | context against ν built from the plain servers' log-probs, one test
    per context, Bonferroni. `tests`: (label, y2 samples, ν on known tokens)."""
    run = [(label, goodness_of_fit(y2s, law), len(y2s)) for label, y2s, law in tests]
    run = [(label, t, n) for label, t, n in run if t is not None]
    level = alpha / max(1, len(run))
    rejected = [
        f"{label}: p = {t.pvalue:.2e} (chi2 {t.statistic:.1f}, df {t.df}, n {n})"
        for label, t, n in run
        if t.rejects(level)
    ]
    summary = f"{len(run)} contexts at level {level:.1e}" + ("" if run else ": no context had enough samples")
    return _result(name, config, bool(run) and not rejected, summary, rejected)


def check_batched(peak: float | None, needed: int, config: str) -> CheckResult:
    """The mixed-w requests really shared batches: sglang:num_running_reqs reached `needed`."""
    ok = peak is not None and peak >= needed
    return _result("mixed w ran batched", config, ok, f"peak sglang:num_running_reqs {peak} (need {needed})")


def check_logprobs(gens: Sequence[Generation], config: str) -> CheckResult:
    """A return_logprob request is served: one finite log-prob ≤ 0 per generated token."""
    bad = []
    for i, g in enumerate(gens):
        rows = g.meta.get("output_token_logprobs") or []
        values = [r[0] for r in rows]
        if len(rows) != g.completion or any(v is None or not math.isfinite(v) or v > 1e-6 for v in values):
            bad.append(f"request {i}: {len(rows)} log-probs for {g.completion} tokens, values {values[:5]}")
    return _result(
        "log-prob request served",
        config,
        bool(gens) and not bad,
        f"{len(gens) - len(bad)}/{len(gens)} ok",
        bad,
    )


def first_tokens(samples: Sequence[Sequence[int]]) -> Counter:
    return Counter(s[0] for s in samples if s)
