"""Plots of a run, each saved as PNG and SVG (matplotlib, Agg backend: no display needed).

throughput   request and output-token throughput against the swept load (concurrency or rate)
latency_by_tier  median TTFT, TPOT and e2e per tier, one bar per phase, whiskers to p90
acceptance_by_tier  acceptance rate per tier from the responses (bars) and from the /metrics
             delta (markers), mean accepted length written on each bar
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, out: Path, stem: str) -> list[Path]:
    paths = []
    for ext in ("png", "svg"):
        path = out / f"{stem}.{ext}"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def _x(phase: dict) -> float:
    v = phase["shape"]["value"]
    return math.inf if v == "inf" else float(v)


def _tiers(phases: list[dict]) -> list[str]:
    """Tier names in report order (the mix order), across phases."""
    out: list[str] = []
    for p in phases:
        out += [t for t in p["tiers"] if t not in out]
    return out


def plot_throughput(phases: list[dict], out: Path) -> list[Path]:
    kind = phases[0]["shape"]["kind"]
    finite = [p for p in phases if math.isfinite(_x(p))] or phases
    xs = [_x(p) if math.isfinite(_x(p)) else 0 for p in finite]
    xlabel = "concurrency (requests in flight)" if kind == "concurrency" else "offered rate (req/s)"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    panels = (
        ("output_throughput", "output tokens / s", "tab:blue"),
        ("request_throughput", "requests / s", "tab:orange"),
    )
    for ax, (key, label, color) in zip(axes, panels, strict=True):
        ax.plot(xs, [p[key] for p in finite], "o-", color=color, label="achieved")
        if kind == "rate" and key == "request_throughput":
            ax.plot(xs, xs, ":", color="gray", label="offered")
            ax.legend(fontsize="small")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.suptitle("Throughput vs " + ("concurrency" if kind == "concurrency" else "request rate"))
    return _save(fig, out, "throughput")


def plot_latency_by_tier(phases: list[dict], out: Path) -> list[Path]:
    tiers = _tiers(phases)
    metrics = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), layout="constrained")
    width = 0.8 / max(len(phases), 1)
    for ax, (key, title) in zip(axes, metrics, strict=False):
        for j, p in enumerate(phases):
            med, err = [], []
            for t in tiers:
                s = p["tiers"].get(t, {}).get(key) or {}
                m, p90 = s.get("median"), s.get("p90")
                med.append(m if m is not None else 0.0)
                err.append((p90 - m) if (m is not None and p90 is not None) else 0.0)
            pos = [i + (j - (len(phases) - 1) / 2) * width for i in range(len(tiers))]
            ax.bar(pos, med, width, yerr=[[0] * len(err), err], capsize=3, label=p["label"])
        ax.set_xticks(range(len(tiers)))
        ax.set_xticklabels(tiers)
        ax.set_title(f"{title} (median, whisker p90)")
        ax.set_ylabel("ms")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(phases), 6), fontsize="small")
    fig.suptitle("Latency by tier")
    return _save(fig, out, "latency_by_tier")


def plot_acceptance_by_tier(phases: list[dict], out: Path) -> list[Path]:
    tiers = _tiers(phases)
    fig, ax = plt.subplots(figsize=(6.8, 4.4), layout="constrained")
    width = 0.8 / max(len(phases), 1)
    for j, p in enumerate(phases):
        pos = [i + (j - (len(phases) - 1) / 2) * width for i in range(len(tiers))]
        rates, lengths, mrates = [], [], []
        for t in tiers:
            spec = p["tiers"].get(t, {}).get("spec", {})
            rates.append(100 * spec["acceptance_rate"] if spec.get("acceptance_rate") is not None else 0.0)
            lengths.append(spec.get("mean_accepted_length"))
            mr = p["tiers"].get(t, {}).get("metrics_acceptance_rate")
            mrates.append(100 * mr if mr is not None else math.nan)
        bars = ax.bar(pos, rates, width, label=f"{p['label']} (responses)")
        for bar, length in zip(bars, lengths, strict=False):
            if length is not None and bar.get_height() > 0:
                ax.annotate(
                    f"L={length:.2f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                    ha="center",
                    va="center",
                    rotation=90,
                    fontsize=8,
                )
        if not all(math.isnan(m) for m in mrates):
            ax.plot(pos, mrates, "kx", markersize=8, label="/metrics delta" if j == 0 else None)
    ax.set_xticks(range(len(tiers)))
    ax.set_xticklabels(tiers)
    ax.set_ylim(0, 105)
    ax.set_ylabel("acceptance rate (%)")
    ax.set_title("Draft acceptance by tier (L = mean accepted length)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    return _save(fig, out, "acceptance_by_tier")


def plot_all(phases: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return (
        plot_throughput(phases, out)
        + plot_latency_by_tier(phases, out)
        + plot_acceptance_by_tier(phases, out)
    )
