"""Artefacts of `dialspec eval`: JSON, the paper's Table 1 in markdown, frontier plots, verdicts.

Terms (the frontier math, areas and dominance are defined in `training/frontiers.py`)
    method        static (w sweep, with SD as w = 1), sd_lossy (lenience sweep, with SD as l = 1),
                  cascade (SpecCascade α sweep), typical (Medusa thresholds), learned (the head's
                  dial sweep) and learned[<name>] (ablation heads). AR has no acceptance: it is a
                  reference point on the time axis only.
    theory lines  per position a draft is accepted with β = 1 − w·TV(p, q); the acceptance
                  *rate* (accepted / proposed, stopping at the first rejection) is then
                  `Σ_{k=1..N} β^k / N` with β at the mean TV. Real TV is uneven across
                  positions (mostly ~0, sometimes ~1), so measured rates sit below this curve.
    goals         per task, from the pairwise verdicts: does the learned head's frontier dominate
                  SpecCascade's and the static one at matched acceptance, and is it no worse than
                  static at matched normalised time (not dominated by it)?
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from training.frontiers import Point, analyse
from verifier.theory import expected_accepted_length_constant

BASELINES = ("static", "sd_lossy", "cascade", "typical")
COLORS = {"static": "#1f77b4", "sd_lossy": "#2ca02c", "cascade": "#9467bd", "typical": "#8c564b",
          "learned": "#d62728", "ar": "#555555"}  # fmt: skip
ABLATION_COLORS = ("#ff7f0e", "#e377c2", "#17becf", "#bcbd22")
MARKERS = {"static": "o", "sd_lossy": "^", "cascade": "D", "typical": "v", "learned": "*", "ar": "s"}


def frontier_groups(task_res: dict) -> dict[str, list[Point]]:
    """method -> its points (SD joins static and lossy as their strict end); AR left out."""
    groups: dict[str, list[Point]] = {}
    ar = next((r for r in task_res["policies"] if r["family"] == "ar"), None)
    ar_chunks = _chunk_time(ar) if ar else None
    for r in task_res["policies"]:
        fam = r["family"]
        if fam == "ar" or r["acceptance"] is None:
            continue
        pp = r["per_prompt"]
        point = Point(fam, r["policy"], np.array(pp["scores"], float), np.array(pp["accepted"], float),
                      np.array(pp["proposed"], float), r["norm_time"], _chunk_time(r), ar_chunks)  # fmt: skip
        for method in ("static", "sd_lossy") if fam == "sd" else (fam,):
            groups.setdefault(method, []).append(point)
    return groups


def _chunk_time(row: dict) -> np.ndarray | None:
    """A row's `[C, 2]` (seconds, tokens) per interleaved chunk; None for results without them."""
    chunks = row.get("chunks")
    return np.array([chunks["wall_s"], chunks["tokens"]], float).T if chunks else None


def verdicts(results: dict, boot: int = 400) -> dict:
    """Per task: frontier areas and pairwise verdicts on both axes, and the learned head's goals."""
    out = {}
    for task, res in results["tasks"].items():
        groups = frontier_groups(res)
        acc, time_ = analyse(groups, "acceptance", boot), analyse(groups, "time", boot)
        entry = {"acceptance": acc, "time": time_}
        if "learned" in groups:
            entry["goals"] = {
                "beats_cascade_at_acceptance": _verdict(acc, "learned", "cascade") == "learned dominates",
                "beats_static_at_acceptance": _verdict(acc, "learned", "static") == "learned dominates",
                "not_worse_than_static_at_time": _verdict(time_, "learned", "static") != "static dominates",
            }
        out[task] = entry
    return out


def _verdict(analysis: dict, a: str, b: str) -> str | None:
    pair = analysis["pairs"].get(f"{a} vs {b}") or analysis["pairs"].get(f"{b} vs {a}")
    return None if pair is None else pair["verdict"]


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
    lines += ["", "## Frontiers (paired bootstrap over prompts; definitions in training/frontiers.py)", ""]
    for t in task_names:
        lines += _frontier_section(t, results["tasks"][t], verdict[t])
    if "wall_s" in results:
        lines.append(f"Run time: {results['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def _flip(rng, axis: str):
    """Ranges on the time axis are stored as −norm_time; show them as normalised time."""
    return rng if rng is None or axis == "acceptance" else (-rng[1], -rng[0])


def _frontier_section(task: str, res: dict, v: dict) -> list[str]:
    tv = res["mean_tv"]
    title = f"### {task} ({res['prompts']} prompts" + (
        f", mean TV(p, q) = {tv:.3f})" if tv is not None else ")"
    )
    lines = [title, ""]
    for axis, label in (("acceptance", "acceptance"), ("time", "normalised time")):
        a = v[axis]
        rng = _flip(a["range"], axis)
        where = (
            "(no shared range)" if rng is None else f"over the shared {label} range {rng[0]:.3f}–{rng[1]:.3f}"
        )
        if a.get("left_out"):  # frontiers that end before the range (time-axis ends are −norm_time)
            ends = ", ".join(f"{m} {abs(end):.3f}" for m, end in a["left_out"].items())
            where += f" (left out, their frontiers end before it: {ends})"
        lines += [f"Mean frontier score {where}:", "", "| method | mean score | SE |", "|---|---|---|"]
        for m, area in sorted(a["areas"].items(), key=lambda kv: -kv[1]["area"]):
            lines.append(f"| {m} | {area['area']:.3f} | {area['se']:.3f} |")
        lines += [
            "",
            f"Pairwise at matched {label} (mean frontier difference over each pair's shared range):",
        ]
        lines += ["", "| pair | range | mean diff | SE | verdict |", "|---|---|---|---|---|"]
        for name, pair in a["pairs"].items():
            r = _flip(pair["range"], axis)
            if r is None:
                lines.append(f"| {name} | – | – | – | no overlap |")
            else:
                diff, se = f"{pair['mean_diff']:+.3f}", f"{pair['se']:.3f}"
                lines.append(f"| {name} | {r[0]:.3f}–{r[1]:.3f} | {diff} | {se} | {pair['verdict']} |")
        lines.append("")
    if "goals" in v:
        g = v["goals"]
        lines += [
            "Goals for the learned head: dominates SpecCascade at matched acceptance: "
            f"**{_yes(g['beats_cascade_at_acceptance'])}**; dominates static at matched acceptance: "
            f"**{_yes(g['beats_static_at_acceptance'])}**; no worse than static at matched time: "
            f"**{_yes(g['not_worse_than_static_at_time'])}**.",
            "",
        ]
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def plots(results: dict, out: Path, verdict: dict | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = list(results["tasks"])
    written = []
    colors = {**COLORS, "sd": COLORS["static"]}

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

    # 2./3. Task score vs acceptance and vs normalised time: every method's frontier.
    for key, xlabel, stem in (
        ("acceptance", "acceptance rate (higher = faster; no timing noise)", "score_vs_acceptance"),
        ("norm_time", "time per token, normalised to AR (lower = faster)", "score_vs_time"),
    ):
        fig, axes = plt.subplots(1, len(task_names), figsize=(5.2 * len(task_names), 4.6), squeeze=False)
        for ax, t in zip(axes[0], task_names, strict=True):
            _frontier_panel(ax, results["tasks"][t], key)
            ax.set_title(f"{t}: {results['tasks'][t]['metric']} vs {key.replace('norm_', 'normalised ')}")
            ax.set_xlabel(xlabel)
        fig.tight_layout()
        written += _save(fig, out / stem)
        plt.close(fig)
    return written


def _method_style(method: str, ablations: list[str]) -> tuple[str, str]:
    """Fixed colours per method; ablation heads (`learned[NAME]`) get distinct ones in order."""
    if method in ablations:
        return ABLATION_COLORS[ablations.index(method) % len(ABLATION_COLORS)], "P"
    return COLORS.get(method, "#333"), MARKERS.get(method, "o")


def _frontier_panel(ax, res: dict, key: str) -> None:
    """Every method's points (with score SE) and its frontier line; AR as a reference."""
    from training.frontiers import _hull

    groups = frontier_groups(res)
    ablations = sorted(m for m in groups if m.startswith("learned["))
    for method, pts in sorted(groups.items()):
        color, marker = _method_style(method, ablations)
        rows = [next(r for r in res["policies"] if r["policy"] == p.name) for p in pts]
        xs = np.array([r[key] for r in rows], float)
        ys = np.array([r["score"] for r in rows], float)
        ax.errorbar(xs, ys, yerr=[r["score_se"] for r in rows], fmt=marker, color=color,
                    ms=10 if method == "learned" else 6, capsize=2, alpha=0.85, label=method)  # fmt: skip
        sign = 1.0 if key == "acceptance" else -1.0
        hx, hy = _hull(sign * xs, ys)
        ax.plot(sign * hx, hy, "-", color=color, lw=2.4 if method == "learned" else 1.4, alpha=0.8)
    ar = next((r for r in res["policies"] if r["family"] == "ar"), None)
    if ar is not None:
        if key == "norm_time":
            ax.errorbar([1.0], [ar["score"]], yerr=[ar["score_se"]], fmt="s", color=COLORS["ar"], label="AR")
        else:
            ax.axhline(ar["score"], color=COLORS["ar"], ls=":", lw=1, label="AR score")
    ax.set_ylabel(res["metric"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _save(fig, stem: Path) -> list[Path]:
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=130)
    fig.savefig(paths[1])
    return paths


def write_report(results: dict, out_dir: str | Path, boot: int = 400) -> dict[str, Path]:
    """Write results.json, table.md and the plots into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    verdict = verdicts(results, boot)
    results = {**results, "verdict": verdict}
    paths = {"json": out / "results.json", "markdown": out / "table.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=_jsonable) + "\n")
    paths["markdown"].write_text(markdown(results, verdict))
    for p in plots(results, out, verdict):
        paths[p.stem + p.suffix] = p
    return paths


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
