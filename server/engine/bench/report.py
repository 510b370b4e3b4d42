"""Benchmark rows, the acceptance targets, and the markdown table."""

from __future__ import annotations

from dataclasses import dataclass

ENSEMBLE_WEIGHTS = (0.75, 0.5, 0.25)


@dataclass
class BenchRow:
    method: str
    concurrency: int
    tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    predicted_speedup: float | None = None
    measured_speedup: float | None = None
    verify_fraction: float | None = None
    t_draft_ms: float | None = None  # per draft forward (with sampling)
    t_verify_ms: float | None = None  # target forward over N+1 positions + verifier call, per round
    t_target_ms: float | None = None  # autoregressive round (1 token) at this concurrency
    note: str = ""


def spec_row(method, c, tokens, seconds, stats, timers, n, ar: BenchRow | None) -> BenchRow:
    from verifier import cost_model_speedup

    drafts = sum(s.drafts for s in stats)
    proposed = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    row = BenchRow(method, c, tokens, seconds, tokens / seconds)
    rounds = max(timers["rounds"], 1)
    row.verify_fraction = timers["verify_call_s"] / max(timers["round_s"], 1e-12)
    if not drafts:  # autoregressive
        row.t_target_ms = 1e3 * timers["round_s"] / rounds
        return row
    row.acceptance_rate = accepted / proposed
    row.mean_accepted_length = 1 + accepted / drafts
    row.t_draft_ms = 1e3 * timers["draft_s"] / max(timers["draft_forwards"], 1)
    row.t_verify_ms = 1e3 * (timers["verify_forward_s"] + timers["verify_call_s"]) / rounds
    if ar is not None:
        row.t_target_ms = ar.t_target_ms
        row.measured_speedup = row.tokens_per_s / ar.tokens_per_s
        row.predicted_speedup = cost_model_speedup(
            accepted / drafts, n, row.t_draft_ms, row.t_verify_ms, ar.t_target_ms
        )
    return row


def check_targets(rows: list[BenchRow]) -> dict:
    """The issue's acceptance targets, each with the measured value and whether it is met."""
    by = {(r.method, r.concurrency): r for r in rows}
    out = {}
    sd1, hf1 = by.get(("dialspec_sd", 1)), by.get(("hf_assisted", 1))
    if sd1 and hf1:
        v = sd1.tokens_per_s / hf1.tokens_per_s
        out["sd_b1_vs_hf_assisted"] = {"value": v, "target": 2.0, "met": v >= 2.0}
    spec = [r for r in rows if r.predicted_speedup]
    if spec:
        v = min(r.measured_speedup / r.predicted_speedup for r in spec)
        out["measured_over_predicted_min"] = {"value": v, "target": 0.9, "met": v >= 0.9}
    cmax = max(r.concurrency for r in rows)
    for method, name in (("dialspec_sd", "sd"), ("dialspec_ar", "ar")):
        lo, hi = by.get((method, 1)), by.get((method, cmax))
        if lo and hi and cmax > 1:
            v = hi.tokens_per_s / lo.tokens_per_s
            out[f"{name}_throughput_c{cmax}_over_c1"] = {"value": v, "target": 4.0, "met": v >= 4.0}
    fr = [r.verify_fraction for r in rows if r.verify_fraction is not None and r.acceptance_rate is not None]
    if fr:
        out["verify_fraction_max"] = {"value": max(fr), "target": 0.03, "met": max(fr) <= 0.03}
    return out


def to_markdown(report: dict) -> str:
    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    m = report["meta"]
    lines = [
        f"# dialspec bench engine\n\ntarget `{m['target']}`, draft `{m['draft']}`, N={m['num_draft']}, "
        f"max_tokens={m['max_tokens']}, temperature={m['temperature']}, device={m['device']}, "
        f"threads={m['torch_threads']}\n",
        "| method | conc. | tok/s | acc. rate | mean acc. len | pred. speedup | meas. speedup "
        "| verify frac. | t_draft ms | t_verify ms | t_target ms | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']:.1f} "
            f"| {f(r['acceptance_rate'], '.3f')} "
            f"| {f(r['mean_accepted_length'], '.2f')} | {f(r['predicted_speedup'], '.2f')} "
            f"| {f(r['measured_speedup'], '.2f')} | {f(r['verify_fraction'], '.3%')} "
            f"| {f(r['t_draft_ms'], '.2f')} | {f(r['t_verify_ms'], '.2f')} | {f(r['t_target_ms'], '.2f')} "
            f"| {r['note']} |"
        )
    lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
    for name, t in report["targets"].items():
        lines.append(f"| {name} | {t['value']:.3f} | {t['target']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"
