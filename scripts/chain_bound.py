"""How much room any per-position weight policy has above the SD <-> draft chord (the chain bound).

    python scripts/chain_bound.py [--tasks math,code,summary] [--split test] [--limit 96]
                                  [--results RUN/results.json]

Teacher-forces each task's reference replies through the pair (models/embedded by default), reads
TV(p_t, q_t) at every position and prints, per task (`training.chain_bound`):
  gain share  how much of the TV is the draft missing the reference token (1.00: the chain model
              applies, every unit of TV is an error the reply must avoid);
  model check the model's success rate at static w ∈ {0, 0.5, 0.75, 1} (and, with --results, the
              eval's measured static scores beside it);
  room        mean and largest lead of the clairvoyant per-reply oracle over the chord, in score
              units: an upper bound on what any per-position policy (a head, a cascade) can gain
              over time-sharing SD with the draft on that task.
With --results (its split, seed(s) and prompt count are used; a `dialspec eval-pool` output
forces every pooled run's prompts, in its order) it also realises that oracle's choice:
SD's measured rows on the replies with the highest slope (1 − P0_i)/A_i (top 25 / 50 / 75 %), the
draft's (static w = 0) on the rest, and compares that frontier with every method's by the eval's
paired bootstrap (`training.frontiers.analyse`).
Measured 2026-11-23 (test split, 96 references): math gain share 1.00, room +0.07 mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import tasks  # noqa: E402
from training.chain_bound import chain_bound, gain_share, reply_slopes, success_probability  # noqa: E402
from training.rollout import Forced  # noqa: E402

STATIC = (0.0, 0.5, 0.75, 1.0)
SELECTED = (0.25, 0.5, 0.75)  # shares of replies the realised oracle serves with SD


def load_pair(pair: Path):
    """(tokenizer, target, draft) of a dialspec pair directory, loaded once per run."""
    from transformers import AutoTokenizer

    from server.engine.embedded.model.llama import load_model

    return (
        AutoTokenizer.from_pretrained(pair / "target"),
        load_model(pair / "target"),
        load_model(pair / "draft"),
    )


def reference_forced(models, task: str, split: str, limit: int, seed: int):
    """Teacher-forced quantities of `limit` reference replies (plus eos) of `task`."""
    from training.data import encode
    from training.rollout import Rollout, teacher_force

    tokenizer, target, draft = models
    encoded = encode(tokenizer, tasks.load(task, split, limit, seed))
    return teacher_force(target, draft, [Rollout(e.prompt, list(e.completion)) for e in encoded])


def measured_static(results: dict | None, task: str) -> dict[float, float]:
    if results is None or task not in results.get("tasks", {}):
        return {}
    rows = results["tasks"][task]["policies"]
    out = {r["x"]: r["score"] for r in rows if r["family"] == "static"}
    out.update((1.0, r["score"]) for r in rows if r["family"] == "sd")
    return out


def realised_oracle(task_res: dict, slope) -> list[str]:
    """Lines comparing the realised reply-selection frontier with every method's (see module doc)."""
    import numpy as np

    from training.eval_report import frontier_groups
    from training.frontiers import Point, analyse

    groups = frontier_groups(task_res)
    points = {p.name: p for pts in groups.values() for p in pts}
    if "SD" not in points or "static w=0" not in points:
        return ["  realised oracle: needs the eval's SD and static w=0 rows"]
    sd, draft = points["SD"], points["static w=0"]
    rank = np.argsort(np.argsort(-np.asarray(slope)))  # 0 = the reply cheapest to make exact
    chosen = []
    for share in SELECTED:
        pick = rank < round(share * len(rank))
        chosen.append(Point("oracle", f"SD on top {share:.0%}", np.where(pick, sd.scores, draft.scores),
                            np.where(pick, sd.accepted, draft.accepted),
                            np.where(pick, sd.proposed, draft.proposed), float("nan")))  # fmt: skip
    shown = [f"{p.name} {p.accepted.sum() / p.proposed.sum():.3f} acc, {p.scores.mean():.3f}" for p in chosen]
    lines = ["  realised oracle: " + "; ".join(shown)]
    methods = {m: pts for m, pts in groups.items() if m != "sd_lossy"}
    verdicts = analyse({"oracle": [draft, *chosen, sd], **methods})["pairs"]
    for name, v in verdicts.items():
        if name.startswith("oracle vs") and v.get("mean_diff") is not None:
            lines.append(f"    {name}: {v['mean_diff']:+.3f} ± {v['se']:.3f} ({v['verdict']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pair", type=Path, default=Path("models/embedded"), help="directory with target/ and draft/"
    )
    ap.add_argument("--tasks", default="math,code,summary")
    ap.add_argument("--split", choices=tasks.SPLITS, default="test")
    ap.add_argument("--limit", type=int, default=96, help="references per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, help="a `dialspec eval` results.json: its prompts, measured rows")
    args = ap.parse_args(argv)
    names = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in names if t not in tasks.TASKS]
    problems = []
    if unknown or not names:
        problems.append(f"unknown task(s) {unknown or args.tasks!r}; choose from {','.join(tasks.TASKS)}")
    if args.limit < 1:
        problems.append(f"--limit must be >= 1, got {args.limit}")
    if not (args.pair / "target").is_dir() or not (args.pair / "draft").is_dir():
        problems.append(f"{args.pair} has no target/ and draft/; pass --pair DIR of a dialspec pair")
    if args.results is not None and not args.results.is_file():
        problems.append(f"{args.results} not found; run `dialspec eval --out DIR` and pass DIR/results.json")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    results = json.loads(args.results.read_text()) if args.results else None
    if results is not None:  # the references of the eval's own prompts
        cfg = results["config"]
        args.split, args.limit = cfg["split"], cfg["limit"]
        seeds = cfg.get("pooled_seeds") or [cfg["seed"]]  # `dialspec eval-pool` output: every run's prompts
    else:
        seeds = [args.seed]
    torch.set_grad_enabled(False)
    models = load_pair(args.pair)
    for task in names:
        forced = Forced.cat([reference_forced(models, task, args.split, args.limit, s) for s in seeds])
        a, mask = forced.tv.double(), forced.mask
        bound = chain_bound(a, mask)
        measured = measured_static(results, task)
        checks = []
        for w in STATIC:
            model = float(success_probability(torch.full_like(a, w), a, mask).mean())
            seen = f" (measured {measured[w]:.3f})" if w in measured else ""
            checks.append(f"w={w:g} {model:.3f}{seen}")
        accept = bound.acceptance()
        print(f"{task} ({mask.shape[0]} references, {bound.positions} positions, "
              f"per-position acceptance {float(accept[-1]):.3f} at SD .. 1.000 all draft)")  # fmt: skip
        print(f"  gain share {gain_share(forced):.3f}")
        print(f"  model score at static {'; '.join(checks)}")
        print(f"  oracle over chord: mean {bound.room:+.3f}, largest {bound.max_room:+.3f}")
        if results is not None and task in results["tasks"]:
            print("\n".join(realised_oracle(results["tasks"][task], reply_slopes(a, mask).tolist())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
