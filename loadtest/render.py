"""The terminal report: the conventional serving-benchmark block, then per-tier and sweep tables.

The block follows `vllm bench serve` / `sglang.bench_serving` (successful / failed requests,
duration, throughputs, TTFT / TPOT / ITL / e2e mean, median, p90, p99 in ms, acceptance), so its
numbers can be compared line by line with theirs.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

WIDTH = 50


LAG_WARN_MS = 100  # the generator's own lag past which its latencies are not the server's


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _rule(title: str) -> str:
    return f"{title:-^{WIDTH}}"


def _line(label: str, value) -> str:
    return f"{label:<40}{_fmt(value):>10}"


def benchmark_block(phase: dict) -> str:
    """The plain-text block for one phase (also what the tests read)."""
    title = phase["label"] + (", interrupted" if phase.get("stopped_by") == "interrupted" else "")
    lines = [f"{' Serving Benchmark Result (' + title + ') ':=^{WIDTH}}"]
    lines.append(_line("Successful requests:", phase["completed"]))
    lines.append(_line("Failed requests:", phase["failed"]))
    for kind, count in phase["failures"].items():
        lines.append(_line(f"  {kind}:", count))
    lines.append(_line("Benchmark duration (s):", phase["duration_s"]))
    lines.append(_line("Total input tokens:", phase["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", phase["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", phase["request_throughput"]))
    lines.append(_line("Output token throughput (tok/s):", phase["output_throughput"]))
    lines.append(_line("Total Token throughput (tok/s):", phase["total_token_throughput"]))
    for key, title, short in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2e_ms", "End-to-end Latency", "E2EL"),
    ):
        s = phase[key]
        lines.append(_rule(title))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(_line(f"{name} {short} (ms):", s[stat]))
    spec = phase["spec"]
    lines.append(_rule("Speculative Decoding"))
    rate = spec["acceptance_rate"]
    lines.append(_line("Acceptance rate (%):", None if rate is None else 100.0 * rate))
    lines.append(_line("Acceptance length:", spec["mean_accepted_length"]))
    lines.append(_line("Drafts:", spec["drafts"]))
    lines.append(_line("Draft tokens:", spec["draft_tokens"]))
    lines.append(_line("Accepted tokens:", spec["accepted_tokens"]))
    svc = phase.get("service")
    if svc is not None:
        lines.append(_rule("Service Level"))
        if svc["slo_ttft_ms"] is not None:
            lines.append(_line(f"Goodput, TTFT <= {svc['slo_ttft_ms']:g} ms (req/s):", svc["goodput"]))
        lines.append(
            _line("Refused, 429 (%):", None if svc["refused_rate"] is None else 100 * svc["refused_rate"])
        )
        lines.append(_line("Mean quality requested:", svc["requested_quality_mean"]))
        lines.append(_line("Mean quality served:", svc["served_quality_mean"]))
        lines.append(_line("Served lower than asked:", svc["lowered"]))
        lines.append(_line("Served below the floor:", svc["below_floor"]))
    check = phase["metrics_check"]
    verdict = "n/a" if not check["available"] else ("match" if check["match"] else "MISMATCH")
    lines.append(f"{'/metrics delta vs responses:':<40}{verdict:>10}")
    if phase.get("drift"):
        d = phase["drift"]
        lines.append(_rule("Drift (first -> last third)"))
        for key, name in (("ttft_ms_p50", "Median TTFT (ms):"), ("e2e_ms_p50", "Median E2EL (ms):")):
            first, last = _fmt(d["first_third"][key]), _fmt(d["last_third"][key])
            lines.append(f"{name:<30}{first:>9} ->{last:>9}")
    lag = phase.get("client_lag_ms") or {}
    if lag.get("p99") is not None:
        lines.append(_line("Load generator lag p99 (ms):", lag["p99"]))
        if lag["p99"] > LAG_WARN_MS:
            lines.append(
                f"! the load generator fell behind (> {LAG_WARN_MS} ms): latencies include its delay"
            )
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def tier_table(phase: dict) -> Table:
    table = Table(
        title=f"Per tier ({phase['label']})",
        title_justify="left",
        caption="latencies in ms; metrics % = acceptance rate from the /metrics delta",
        caption_justify="left",
    )
    # latencies in ms; "accept" from the responses, "metrics" from the /metrics delta
    for col in (
        "tier",
        "ok",
        "failed",
        "TTFT p50",
        "TPOT p50",
        "E2EL p50",
        "E2EL p99",
        "out tok/s",
        "accept %",
        "accept len",
        "metrics %",
    ):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in phase["tiers"].items():
        spec = t["spec"]
        rate = spec["acceptance_rate"]
        mrate = t.get("metrics_acceptance_rate")
        table.add_row(
            name,
            str(t["completed"]),
            str(t["failed"]),
            _fmt(t["ttft_ms"]["median"], 1),
            _fmt(t["tpot_ms"]["median"], 1),
            _fmt(t["e2e_ms"]["median"], 1),
            _fmt(t["e2e_ms"]["p99"], 1),
            _fmt(t["output_throughput"], 1),
            _fmt(None if rate is None else 100 * rate, 1),
            _fmt(spec["mean_accepted_length"]),
            _fmt(None if mrate is None else 100 * mrate, 1),
        )
    return table


def sweep_table(phases: list[dict]) -> Table:
    table = Table(title="Sweep", title_justify="left")
    for col in (
        "load",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TPOT p50",
        "E2EL p50",
        "E2EL p99",
        "accept %",
        "goodput",
        "429 %",
        "quality",
    ):
        table.add_column(col, justify="left" if col == "load" else "right")
    for p in phases:
        rate = p["spec"]["acceptance_rate"]
        svc = p.get("service") or {}
        refused = svc.get("refused_rate")
        table.add_row(
            p["label"],
            str(p["completed"]),
            str(p["failed"]),
            _fmt(p["request_throughput"]),
            _fmt(p["output_throughput"], 1),
            _fmt(p["ttft_ms"]["median"], 1),
            _fmt(p["tpot_ms"]["median"], 1),
            _fmt(p["e2e_ms"]["median"], 1),
            _fmt(p["e2e_ms"]["p99"], 1),
            _fmt(None if rate is None else 100 * rate, 1),
            _fmt(svc.get("goodput")),
            _fmt(None if refused is None else 100 * refused, 1),
            _fmt(svc.get("served_quality_mean")),
        )
    return table


def print_phase(console: Console, phase: dict) -> None:
    console.print(benchmark_block(phase), markup=False, highlight=False)
    console.print(tier_table(phase))
    check = phase["metrics_check"]
    if check["available"] and not check["match"]:
        for tier, c in check["tiers"].items():
            if not c["match"]:
                console.print(
                    f"[yellow]metrics check, tier {tier}: responses {c['extension']} vs /metrics delta "
                    f"{c['metrics']} (other traffic on the server, or aborted requests, explain a gap)[/]"
                )
    elif not check["available"]:
        console.print(f"[dim]/metrics not scraped: {check['error']}[/]")
