"""Pool `dialspec eval` runs made with different seeds into one larger evaluation.

One run's paired bootstrap resamples its prompts, but each prompt's score is one draw at
temperature 1: a verdict decided by three prompts out of 96 can flip with the seed (measured on
code, 2026-11-23). Runs with different `--seed` draw different test prompts and different sampling
seeds; pooling them concatenates every policy's per-prompt scores and draft counts, so the same
frontier analysis (training/frontiers.py) runs on 96·k prompts and its SE covers both sources.

Terms
    compatible runs  same split, prompt count, tasks and policy rows (same sweeps and heads), and
                     pairwise different seeds (a repeated seed would count the same draws twice).
    pooled row       acceptance = Σ accepted / Σ proposed and score = mean over every prompt;
                     tokens/s and time per token from the summed tokens and wall time; normalised
                     time against the pooled AR row of the task; the runs' timed chunks side by
                     side (none if a run has none).
"""

from __future__ import annotations

import math

POOLED_LISTS = ("scores", "accepted", "proposed")


def _signature(results: dict) -> tuple:
    cfg = results["config"]
    rows = {t: tuple(r["policy"] for r in res["policies"]) for t, res in results["tasks"].items()}
    return cfg["split"], cfg["limit"], tuple(sorted(rows.items()))


def check_compatible(runs: list[dict]) -> None:
    """Raise ValueError naming the first difference that makes `runs` unpoolable."""
    if len(runs) < 2:
        raise ValueError(f"pooling needs at least 2 runs, got {len(runs)}")
    seeds = [r["config"]["seed"] for r in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs share a seed ({seeds}): the same prompts and draws would count twice")
    first = _signature(runs[0])
    for i, run in enumerate(runs[1:], start=2):
        if _signature(run) != first:
            what = ("split", "prompt count", "tasks or policy rows")
            diff = next(w for w, a, b in zip(what, first, _signature(run), strict=True) if a != b)
            raise ValueError(
                f"run {i} differs from run 1 in its {diff}; pool runs of one command line with --seed"
            )


def _pool_rows(rows: list[dict]) -> dict:
    first = rows[0]
    lists = {k: [v for r in rows for v in r["per_prompt"][k]] for k in POOLED_LISTS}
    scores = lists["scores"]
    n = len(scores)
    mean = sum(scores) / n
    var = sum((s - mean) ** 2 for s in scores) / max(1, n - 1)
    proposed = sum(lists["proposed"])
    tokens = sum(r["completion_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    w_rows = [r for r in rows if r["mean_w"] is not None]
    return {
        **{k: first[k] for k in ("policy", "family", "x")},
        "acceptance": sum(lists["accepted"]) / proposed
        if proposed and first["acceptance"] is not None
        else None,
        "score": mean,
        "score_se": math.sqrt(var / n),
        "mean_w": sum(r["mean_w"] for r in w_rows) / len(w_rows) if w_rows else None,
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "time_per_token_s": wall / max(1, tokens),
        "verify_rounds": sum(r["verify_rounds"] for r in rows),
        "per_prompt": lists,
        # every run's chunks, side by side: each was timed in its own run's minutes
        "chunks": {k: [v for r in rows for v in r["chunks"][k]] for k in ("wall_s", "tokens")}
        if all(r.get("chunks") for r in rows)
        else None,
    }


def pool(runs: list[dict]) -> dict:
    """One results dict (the shape `training.eval_report.write_report` takes) from compatible runs."""
    check_compatible(runs)
    out = {
        "config": {**runs[0]["config"], "seed": None, "pooled_seeds": [r["config"]["seed"] for r in runs]},
        "tasks": {},
        "wall_s": sum(r.get("wall_s", 0.0) for r in runs),
    }
    for task, res in runs[0]["tasks"].items():
        rows = [
            _pool_rows([run["tasks"][task]["policies"][i] for run in runs])
            for i in range(len(res["policies"]))
        ]
        ar = next((r for r in rows if r["family"] == "ar"), None)
        for r in rows:
            r["norm_time"] = r["time_per_token_s"] / ar["time_per_token_s"] if ar else 1.0
        tvs = [run["tasks"][task]["mean_tv"] for run in runs if run["tasks"][task]["mean_tv"] is not None]
        out["tasks"][task] = {
            "metric": res["metric"],
            "prompts": sum(run["tasks"][task]["prompts"] for run in runs),
            "mean_tv": sum(tvs) / len(tvs) if tvs else None,
            "policies": rows,
        }
    return out
