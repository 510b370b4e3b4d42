"""Per-request records of one phase -> the serving-benchmark numbers, overall and per tier.

Conventions (as `vllm bench serve` / `sglang.bench_serving`):
    request throughput       successful requests / phase duration
    output token throughput  sum of `usage.completion_tokens` of successes / phase duration
    total token throughput   (prompt + completion tokens of successes) / phase duration
    latencies                over successful requests only, in milliseconds; ITL pools every gap
                             of every response
    acceptance rate          sum accepted draft tokens / sum proposed draft tokens (from the
                             `dialspec` extensions of successful responses)
    mean accepted length     1 + sum accepted / sum drafts
    drift                    median TTFT and e2e of the first vs the last third of successes by
                             send time (a soak's latency drift)
    goodput                  successes whose TTFT met `--slo-ttft-ms`, per second of the phase
    served quality           from the `dialspec` extension: the quality each success was served
                             at (lower than asked only under brownout, never below `min_quality`;
                             `below_floor` counts violations, which must stay 0)
The metrics check compares those extension sums with the `/metrics` counter delta per tier label
(the server's label: a tier name, or `custom` for a numeric quality).
"""

from __future__ import annotations

import math
from collections import Counter

from loadtest.client import RequestRecord
from loadtest.runner import PhaseResult
from loadtest.scrape import ALL, SpecCounters
from loadtest.stats import percentile, summarize

_SPEC_KEYS = ("drafts", "draft_tokens", "accepted_tokens")


def _output_tokens(r: RequestRecord) -> int:
    return r.output_tokens if r.output_tokens is not None else r.chunks


def spec_totals(records: list[RequestRecord]) -> dict:
    """Speculative counters summed over the successful responses that carry the extension."""
    ext = [r.dialspec for r in records if r.ok and r.dialspec]
    sums = {k: sum(int(e.get(k) or 0) for e in ext) for k in _SPEC_KEYS}
    return {
        "responses": len(ext),
        **sums,
        "acceptance_rate": sums["accepted_tokens"] / sums["draft_tokens"] if sums["draft_tokens"] else None,
        "mean_accepted_length": 1 + sums["accepted_tokens"] / sums["drafts"] if sums["drafts"] else None,
    }


def latency(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], 1000.0),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None], 1000.0),
        "itl_ms": summarize([gap for r in ok for gap in r.itl], 1000.0),
        "e2e_ms": summarize([r.e2e for r in ok if r.e2e is not None], 1000.0),
    }


def _counts(records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    out_tok = sum(_output_tokens(r) for r in ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "sent": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures": dict(sorted(Counter(r.error_kind for r in records if not r.ok).items())),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "usage_missing": sum(1 for r in ok if r.output_tokens is None),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tok),
        "total_token_throughput": per_s(out_tok + in_tok),
    }


def service_level(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None) -> dict:
    """Goodput against the TTFT objective, refusals, and the quality served vs asked."""
    ok = [r for r in records if r.ok]
    ext = [r.dialspec for r in ok if r.dialspec and isinstance(r.dialspec.get("quality"), (int, float))]
    served = [e["quality"] for e in ext]
    asked = [e.get("requested_quality", e["quality"]) for e in ext]
    floors = [e.get("min_quality") for e in ext]
    met = (
        None
        if slo_ttft_ms is None
        else sum(1 for r in ok if r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms)
    )
    refused = sum(1 for r in records if r.error_kind == "http_429")
    return {
        "slo_ttft_ms": slo_ttft_ms,
        "met_slo": met,
        "goodput": None if met is None else (met / duration if duration > 0 else 0.0),
        "refused_429": refused,
        "refused_rate": refused / len(records) if records else None,
        "served_quality_mean": sum(served) / len(served) if served else None,
        "requested_quality_mean": sum(asked) / len(asked) if asked else None,
        "lowered": sum(1 for q, a in zip(served, asked, strict=True) if q < a),
        "below_floor": sum(1 for q, f in zip(served, floors, strict=True) if f is not None and q < f - 1e-9),
    }


def metrics_check(records: list[RequestRecord], delta: SpecCounters | None, error: str | None) -> dict:
    """Extension sums by server tier label vs the `/metrics` delta; `match` when all equal."""
    if delta is None:
        return {"available": False, "error": error, "match": None, "tiers": {}}
    ext: dict[str, dict[str, int]] = {}
    for r in records:
        if r.ok and r.dialspec:
            tier = str(r.dialspec.get("tier") or ALL)
            bucket = ext.setdefault(tier, dict.fromkeys(_SPEC_KEYS, 0))
            for k in _SPEC_KEYS:
                bucket[k] += int(r.dialspec.get(k) or 0)
    if set(delta) == {ALL}:  # a server without a tier label: compare totals
        ext = {ALL: {k: sum(b[k] for b in ext.values()) for k in _SPEC_KEYS}} if ext else {}
    tiers = {}
    for tier in sorted(set(ext) | set(delta)):
        e = ext.get(tier, dict.fromkeys(_SPEC_KEYS, 0))
        m = {k: int(round(delta.get(tier, {}).get(k, 0.0))) for k in _SPEC_KEYS}
        if not any(e.values()) and not any(m.values()):
            continue
        tiers[tier] = {
            "extension": e,
            "metrics": m,
            "metrics_acceptance_rate": m["accepted_tokens"] / m["draft_tokens"]
            if m["draft_tokens"]
            else None,
            "metrics_mean_accepted_length": 1 + m["accepted_tokens"] / m["drafts"] if m["drafts"] else None,
            "match": e == m,
        }
    return {
        "available": True,
        "error": None,
        "match": all(t["match"] for t in tiers.values()),
        "tiers": tiers,
    }


def _attach_metrics(tiers: dict, records: list[RequestRecord], check: dict) -> None:
    """Give each requested tier the /metrics acceptance of the server label its responses carry
    (`server_tier`), when that label is its alone (two numeric qualities both land on `custom`)."""
    labels = {
        name: {str(r.dialspec.get("tier")) for r in records if r.tier == name and r.ok and r.dialspec}
        for name in tiers
    }
    for name, entry in tiers.items():
        mine = labels[name]
        label = next(iter(mine)) if len(mine) == 1 else None
        shared = label is not None and any(label in other for n, other in labels.items() if n != name)
        server = check["tiers"].get(label) if label is not None and not shared else None
        entry["server_tier"] = label
        entry["metrics_acceptance_rate"] = server["metrics_acceptance_rate"] if server else None
        entry["metrics_mean_accepted_length"] = server["metrics_mean_accepted_length"] if server else None


def drift(records: list[RequestRecord]) -> dict | None:
    """Median TTFT / e2e (ms) of the first and last third of successes by send time."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.start)
    if len(ok) < 6:
        return None
    third = len(ok) // 3
    first, last = ok[:third], ok[-third:]

    def med(rs, attr):
        return percentile([getattr(r, attr) * 1000.0 for r in rs], 50.0)

    out = {
        "first_third": {"ttft_ms_p50": med(first, "ttft"), "e2e_ms_p50": med(first, "e2e")},
        "last_third": {"ttft_ms_p50": med(last, "ttft"), "e2e_ms_p50": med(last, "e2e")},
    }
    base = out["first_third"]["e2e_ms_p50"]
    out["e2e_p50_change_pct"] = 100.0 * (out["last_third"]["e2e_ms_p50"] - base) / base if base else None
    return out


def summarize_phase(
    result: PhaseResult,
    delta: SpecCounters | None = None,
    metrics_error: str | None = None,
    tier_order: list[str] | None = None,
    slo_ttft_ms: float | None = None,
) -> dict:
    """The phase's numbers; `tiers` follows `tier_order` (the mix order), unknown names last."""
    records = result.records
    tiers = {}
    seen = {r.tier for r in records}
    order = [t for t in (tier_order or []) if t in seen] + sorted(seen - set(tier_order or []))
    for name in order:
        group = [r for r in records if r.tier == name]
        tiers[name] = {**_counts(group, result.duration), **latency(group), "spec": spec_totals(group)}
    check = metrics_check(records, delta, metrics_error)
    _attach_metrics(tiers, records, check)
    shape = result.shape
    return {
        "label": shape.label,
        "shape": {
            "kind": shape.kind,
            "value": shape.value if math.isfinite(shape.value) else "inf",
            "max_concurrency": shape.max_concurrency,
        },
        "planned": result.planned,
        "stopped_by": result.stopped_by,
        "duration_s": result.duration,
        **_counts(records, result.duration),
        **latency(records),
        "spec": spec_totals(records),
        "service": service_level(records, result.duration, slo_ttft_ms),
        "tiers": tiers,
        "metrics_check": check,
        "drift": drift(records),
        "client_lag_ms": summarize(result.client_lag, 1000.0),
    }
