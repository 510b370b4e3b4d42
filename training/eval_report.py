"""Artefacts of `dialspec eval`: JSON, the paper's Table 1 in markdown, the two plots, the verdict.

Terms
    static frontier  the upper envelope of the static-ensemble points (w sweep plus SD, w = 1) in the
                     plane (x, task score); between two points it is the straight line (mixing
                     two static policies request by request achieves it), beyond the ends it is
                     flat. x is normalised time (lower is better) or acceptance rate (higher is
                     better; immune to CPU-timing noise).
    theory lines     per position a draft is accepted with β = 1 − w·TV(p, q); the acceptance
                     *rate* (accepted / proposed, stopping at the first rejection) is then
                     `Σ_{k=1..N} β^k / N` with β at the mean TV. Real TV is uneven across
                     positions (mostly ~0, sometimes ~1), so measured rates sit below this curve.
    margin           learned score minus the frontier's score at the learned point's x. A learned
                     point "beats the static frontier" when its margin is > 0 (reported with the
                     score's standard error: on a small slice a margin below ~2 SE is noise).
"""

from __future__ import annotations

import json
from pathlib import Path

from verifier.theory import expected_accepted_length_constant


def frontier_score(points: list[tuple[float, float]], x: float, higher_x_better: bool) -> float:
    """Score of the static frontier at `x`; `points` are (x, score) pairs."""
    pts = [(-px if higher_x_better else px, s) for px, s in points]
    xq = -x if higher_x_better else x
    pts.sort()
    # Pareto set: as cost grows, keep only points that raise the best score so far.
    front, best = [], float("-inf")
    for px, s in pts:
        if s > best:
            front.append((px, s))
            best = s
    if xq <= front[0][0]:
        return front[0][1]  # cheaper than any static policy: must match the cheapest one's score
    for (x0, s0), (x1, s1) in zip(front, front[1:], strict=False):
        if x0 <= xq <= x1:
            return s0 + (s1 - s0) * (xq - x0) / (x1 - x0) if x1 > x0 else max(s0, s1)
    return front[-1][1]


def _envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pareto points (lower x, higher score) sorted by x, extended flat to the largest x."""
    front, best = [], float("-inf")
    for x, sc in sorted(points):
        if sc > best:
            front.append((x, sc))
            best = sc
    xmax = max(x for x, _ in points)
    return front + ([(xmax, best)] if front[-1][0] < xmax else [])


def verdicts(results: dict) -> dict:
    """Per task: each learned point's margins over the static frontier (time and acceptance axes)."""
    out = {}
    for task, res in results["tasks"].items():
        rows = res["policies"]
        static = [r for r in rows if r["family"] in ("static", "sd")]
        learned = [r for r in rows if r["family"] == "learned"]
        if not learned or len(static) < 1:
            continue
        by_time = [(r["norm_time"], r["score"]) for r in static]
        by_acc = [(r["acceptance"], r["score"]) for r in static]
        points = []
        for r in learned:
            mt = r["score"] - frontier_score(by_time, r["norm_time"], higher_x_better=False)
            ma = r["score"] - frontier_score(by_acc, r["acceptance"], higher_x_better=True)
            points.append(
                {
                    "policy": r["policy"],
                    "margin_time": mt,
                    "margin_acceptance": ma,
                    "score_se": r["score_se"],
                }
            )
        out[task] = {
            "points": points,
            "beats_time": any(p["margin_time"] > 0 for p in points),
            "beats_acceptance": any(p["margin_acceptance"] > 0 for p in points),
            "clear_time": any(p["margin_time"] > 2 * p["score_se"] for p in points),
            "clear_acceptance": any(p["margin_acceptance"] > 2 * p["score_se"] for p in points),
        }
        out[task]["beats_clearly"] = out[task]["clear_time"] and out[task]["clear_acceptance"]
    return out


def _axis_word(v: dict, axis: str) -> str:
    """One axis' verdict in words: beats by > 2 SE, above within noise, or not above."""
    where = "at equal normalised time" if axis == "time" else "at equal acceptance"
    if v[f"clear_{axis}"]:
        return f"{where} the learned head BEATS the static frontier (> 2 SE)"
    if v[f"beats_{axis}"]:
        return f"{where} the learned head is above the frontier but within 2 SE (not significant)"
    return f"{where} the learned head does not beat the frontier"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def markdown(results: dict, verdict: dict) -> str:
    task_names = list(results["tasks"])
    metrics = [results["tasks"][t]["metric"] for t in task_names]
    head = ["method"] + [
        c for t, m in zip(task_names, metrics, strict=True) for c in (f"{t} acc. rate", f"{t} {m}")
    ]
    lines = [
        "## Table 1 (dialspec embedded suite)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    policies = [r["policy"] for r in results["tasks"][task_names[0]]["policies"]]
    for name in policies:
        cells = [name]
        for t in task_names:
            r = next(x for x in results["tasks"][t]["policies"] if x["policy"] == name)
            cells += [_pct(r["acceptance"]) if r["family"] != "ar" else "–", f"{r['score']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Speed (time normalised to AR per completion token; lower is faster)", ""]
    head2 = ["method"] + [c for t in task_names for c in (f"{t} tok/s", f"{t} norm. time", f"{t} mean w")]
    lines += ["| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
    for name in policies:
        cells = [name]
        for t in task_names:
            r = next(x for x in results["tasks"][t]["policies"] if x["policy"] == name)
            mw = "–" if r["mean_w"] is None else f"{r['mean_w']:.3f}"
            cells += [f"{r['tokens_per_s']:.1f}", f"{r['norm_time']:.3f}", mw]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Learned head vs the static frontier", ""]
    for t in task_names:
        res = results["tasks"][t]
        tv = res["mean_tv"]
        lines.append(
            f"- **{t}** ({res['prompts']} prompts, mean TV(p, q) = {tv:.3f}):"
            if tv is not None
            else f"- **{t}**:"
        )
        v = verdict.get(t)
        if v is None:
            lines.append("  no learned head evaluated.")
            continue
        for p in v["points"]:
            lines.append(
                f"  - {p['policy']}: score margin {p['margin_time']:+.3f} at equal normalised time, "
                f"{p['margin_acceptance']:+.3f} at equal acceptance (score SE {p['score_se']:.3f})"
            )
        lines.append(f"  - verdict: {_axis_word(v, 'time')}; {_axis_word(v, 'acceptance')}.")
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = list(results["tasks"])
    written = []
    colors = {"static": "#1f77b4", "sd": "#1f77b4", "learned": "#d62728", "ar": "#555555"}
    colors.update({"sd_lossy": "#2ca02c", "cascade": "#9467bd"})
    markers = {"ar": "s", "sd": "o", "sd_lossy": "^", "cascade": "D", "static": "o", "learned": "*"}

    # 1. Acceptance vs w with the theory line.
    fig, axes = plt.subplots(1, len(task_names), figsize=(4.6 * len(task_names), 4.2), squeeze=False)
    for ax, t in zip(axes[0], task_names, strict=True):
        res = results["tasks"][t]
        static = sorted([r for r in res["policies"] if r["family"] in ("static", "sd")], key=lambda r: r["x"])
        ax.plot(
            [r["x"] for r in static],
            [r["acceptance"] for r in static],
            "o",
            color=colors["static"],
            ms=7,
            label="static ensemble (measured)",
        )
        if res["mean_tv"] is not None:
            tv, n = res["mean_tv"], results["config"]["num_draft"]
            ws = [i / 50 for i in range(51)]
            beta = [1 - w * tv for w in ws]
            rate = [expected_accepted_length_constant(b, n) / n for b in beta]
            ax.plot(ws, beta, ":", color="#888", label=f"theory per position: 1 − w·TV (TV={tv:.2f})")
            ax.plot(ws, rate, "--", color="#333", label=f"theory acc. rate: Σβ^k/N (N={n})")
        for r in res["policies"]:
            if r["family"] == "learned" and r["mean_w"] is not None:
                ax.plot(r["mean_w"], r["acceptance"], "*", color=colors["learned"], ms=13)
                ax.annotate(
                    f"d={r['x']:g}",
                    (r["mean_w"], r["acceptance"]),
                    textcoords="offset points",
                    xytext=(6, 4),
                    fontsize=8,
                )
        if any(r["family"] == "learned" for r in res["policies"]):
            ax.plot([], [], "*", color=colors["learned"], ms=11, label="learned head (at its mean w)")
        ax.set_title(f"{t}: acceptance vs w")
        ax.set_xlabel("ensemble weight w on the target")
        ax.set_ylabel("acceptance rate")
        ax.set_xlim(-0.05, 1.05)
        measured = [r["acceptance"] for r in res["policies"] if r["acceptance"] is not None]
        lowest = min(measured + ([rate[-1]] if res["mean_tv"] is not None else []), default=0.0)
        ax.set_ylim(max(0.0, lowest - 0.1), 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    written += _save(fig, out / "acceptance_vs_w")
    plt.close(fig)

    # 2./3. Task score vs normalised time and vs acceptance: static frontier, baselines, learned points.
    axes_spec = [
        ("norm_time", 1.0, "time per token, normalised to AR (lower = faster)", "time", "score_vs_time"),
        (
            "acceptance",
            -1.0,
            "acceptance rate (higher = faster; no timing noise)",
            "acceptance",
            "score_vs_acceptance",
        ),
    ]
    for key, sign, xlabel, short, stem in axes_spec:
        fig, axes = plt.subplots(1, len(task_names), figsize=(4.6 * len(task_names), 4.2), squeeze=False)
        for ax, t in zip(axes[0], task_names, strict=True):
            _score_panel(ax, results["tasks"][t], key, sign, colors, markers)
            ax.set_title(f"{t}: {results['tasks'][t]['metric']} vs {short}")
            ax.set_xlabel(xlabel)
        fig.tight_layout()
        written += _save(fig, out / stem)
        plt.close(fig)
    return written


def _score_panel(ax, res: dict, key: str, sign: float, colors: dict, markers: dict) -> None:
    """One task's score-vs-`key` panel; `sign` -1 means a higher `key` is better (acceptance)."""
    static = sorted(
        [r for r in res["policies"] if r["family"] in ("static", "sd")], key=lambda r: sign * r[key]
    )
    xs, ys = [r[key] for r in static], [r["score"] for r in static]
    ax.plot(xs, ys, "-o", color=colors["static"], label="static ensemble (w sweep)")
    front = [(sign * x, y) for x, y in _envelope([(sign * x, y) for x, y in zip(xs, ys, strict=True)])]
    ax.plot(*zip(*front, strict=True), "-", color=colors["static"], lw=6, alpha=0.18, label="static frontier")
    for r in static:
        ax.annotate(
            f"w={r['x']:g}",
            (r[key], r["score"]),
            textcoords="offset points",
            xytext=(4, -11),
            fontsize=7,
            color=colors["static"],
        )
    for r in res["policies"]:
        fam = r["family"]
        if fam in ("static", "sd") or r[key] is None:
            continue
        label = {"ar": "AR", "sd_lossy": r["policy"], "cascade": r["policy"]}.get(fam)
        size = 11 if fam == "learned" else 7
        ax.errorbar(
            r[key],
            r["score"],
            yerr=r["score_se"],
            fmt=markers[fam],
            color=colors[fam],
            ms=size,
            capsize=2,
            label=label,
        )
        if fam == "learned":
            ax.annotate(
                f"d={r['x']:g}",
                (r[key], r["score"]),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=8,
                color=colors["learned"],
            )
    ax.plot([], [], "*", color=colors["learned"], ms=11, label="learned head")
    ax.set_ylabel(res["metric"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _save(fig, stem: Path) -> list[Path]:
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=130)
    fig.savefig(paths[1])
    return paths


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write results.json, table.md and the plots into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    verdict = verdicts(results)
    results = {**results, "verdict": verdict}
    paths = {"json": out / "results.json", "markdown": out / "table.md"}
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    paths["markdown"].write_text(markdown(results, verdict))
    for p in plots(results, out):
        paths[p.stem + p.suffix] = p
    return paths
