"""`dialspec pair ...` and `dialspec tasks ...`: retrain, re-score and export the embedded pair's data.

dialspec pair train [--out DIR] [--minutes M]   tokenizer + draft + target, scores, card, checksums
dialspec pair score [--pair DIR] [--n N]         re-measure scores and acceptance, rewrite the card
dialspec pair verify [--pair DIR]                check SHA256SUMS
dialspec pair prompts [--pair DIR] [--n N]       write the pair's prompts.jsonl (test-split prompts)
dialspec pair synth --out DIR [--shape S]        random-weight pair with a public pair's exact shapes
dialspec tasks export --task T --split S [--n N] [--out FILE]   JSONL of generated examples
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from server.cli_errors import CLIError
from server.engine.model_pair import EMBEDDED_PAIR_DIR, PROMPTS_FILE, PairIntegrityError, verify_pair
from training.tasks import SPLITS, TASKS, load


def _train(args) -> int:
    from training.model_card import write_pair_files
    from training.recipe import RecipeConfig, run
    from training.scorecard import score_pair

    if args.minutes is not None and args.minutes <= 1:
        raise CLIError(f"--minutes must be > 1 (got {args.minutes}); the default budget is 58 minutes")
    cfg = RecipeConfig()
    if (
        args.minutes is not None
    ):  # split like the default: 14/58 draft (a cap; it is step-bound), 44/58 target
        cfg = dataclasses.replace(
            cfg,
            draft_train=dataclasses.replace(cfg.draft_train, minutes=args.minutes * 14 / 58),
            target_train=dataclasses.replace(cfg.target_train, minutes=args.minutes * 44 / 58),
        )
    out = Path(args.out)
    run(out, cfg)
    meta = write_pair_files(out, score_pair(out))
    print(json.dumps({k: meta[k] for k in ("name", "scores", "acceptance")}, indent=1))
    return 0


def _score(args) -> int:
    from training.model_card import write_pair_files
    from training.scorecard import score_pair

    pair = Path(args.pair)
    if not (pair / "target").is_dir() or not (pair / "draft").is_dir():
        raise CLIError(f"{pair} has no target/ and draft/ model dirs; train one with `dialspec pair train`")
    meta = write_pair_files(pair, score_pair(pair, n=args.n))
    print(json.dumps({k: meta[k] for k in ("name", "scores", "acceptance")}, indent=1))
    return 0


def _verify(args) -> int:
    try:
        paths = verify_pair(args.pair)
    except PairIntegrityError as exc:
        raise CLIError(str(exc)) from None
    print(f"ok: {paths.name} (target {paths.target}, draft {paths.draft})")
    return 0


PROMPTS_PER_TASK = 100


def suite_prompt_lines(n: int = PROMPTS_PER_TASK) -> list[str]:
    """JSONL lines of `n` test-split prompts per task (seed 0), tasks interleaved in sorted order —
    the workload file serving and load testing read without importing this package."""
    per_task = [load(t, "test", n) for t in sorted(TASKS)]
    return [
        json.dumps({"uid": ex.uid, "task": ex.task, "prompt": ex.prompt}, ensure_ascii=False)
        for group in zip(*per_task, strict=True)
        for ex in group
    ]


def _prompts(args) -> int:
    if args.n < 1:
        raise CLIError(f"--n must be >= 1 (got {args.n})")
    if not Path(args.pair).is_dir():
        raise CLIError(f"{args.pair} is not a directory; point --pair at a model pair directory")
    out = Path(args.pair) / PROMPTS_FILE
    out.write_text("\n".join(suite_prompt_lines(args.n)) + "\n", encoding="utf-8")
    print(f"wrote {out} ({args.n} prompts per task)")
    return 0


def _synth(args) -> int:
    from rich.progress import Progress

    from training.synth_pair import PAIRS, num_tensors, write_pair

    if args.shape not in PAIRS:
        raise CLIError(f"unknown --shape {args.shape!r}; use one of: {', '.join(PAIRS)}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "pair.json").exists():
        raise CLIError(f"{out} exists and is not a synthetic pair; pick an empty or new --out")
    with Progress() as progress:
        task = progress.add_task(f"writing {args.shape}", total=num_tensors(args.shape))
        meta = write_pair(out, args.shape, args.seed, args.device, lambda n: progress.advance(task, n))
    print(json.dumps(meta, indent=1))
    print(f"bench it: dialspec bench engine --target {out / 'target'} --draft {out / 'draft'}")
    return 0


def _export(args) -> int:
    if args.n < 1:
        raise CLIError(f"--n must be >= 1 (got {args.n})")
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 -- stdout is not ours to close
    try:
        for e in load(args.task, args.split, args.n, seed=args.seed):
            out.write(
                json.dumps(
                    {
                        "uid": e.uid,
                        "task": e.task,
                        "prompt": e.prompt,
                        "reference": e.reference,
                        "meta": e.meta,
                    }
                )
                + "\n"
            )
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def register(subparsers) -> None:
    pair = subparsers.add_parser("pair", help="train, score or verify the embedded draft/target pair")
    psub = pair.add_subparsers(dest="pair_command", metavar="ACTION", required=True)
    train = psub.add_parser("train", help="retrain tokenizer, draft and target; write card and checksums")
    train.add_argument("--out", default=str(EMBEDDED_PAIR_DIR), help="output dir (default: the shipped pair)")
    train.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-clock training budget in minutes (default 58: draft <= 14, target <= 44)",
    )
    train.set_defaults(func=_train)
    score = psub.add_parser("score", help="re-measure test scores and acceptance; rewrite card")
    score.add_argument("--pair", default=str(EMBEDDED_PAIR_DIR))
    score.add_argument("--n", type=int, default=200, help="test examples per task")
    score.set_defaults(func=_score)
    ver = psub.add_parser("verify", help="check the pair's SHA256SUMS")
    ver.add_argument("--pair", default=str(EMBEDDED_PAIR_DIR))
    ver.set_defaults(func=_verify)
    prompts = psub.add_parser("prompts", help="write the pair's prompts.jsonl (benchmark/load-test prompts)")
    prompts.add_argument("--pair", default=str(EMBEDDED_PAIR_DIR))
    prompts.add_argument("--n", type=int, default=PROMPTS_PER_TASK, help="prompts per task")
    prompts.set_defaults(func=_prompts)

    synth = psub.add_parser("synth", help="random-weight pair with a public pair's exact shapes (speed only)")
    synth.add_argument("--out", required=True, help="output directory (target/, draft/, pair.json)")
    synth.add_argument(
        "--shape", default="qwen2.5-0.5b-1.5b", help="qwen2.5-0.5b-1.5b (default) or llama3-1b-8b"
    )
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--device", default="cpu", help="where the random numbers are drawn (cpu, cuda)")
    synth.set_defaults(func=_synth)

    tasks = subparsers.add_parser("tasks", help="the generated task suite")
    tsub = tasks.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)
    export = tsub.add_parser("export", help="write generated examples as JSONL")
    export.add_argument("--task", choices=sorted(TASKS), required=True)
    export.add_argument("--split", choices=SPLITS, default="test")
    export.add_argument("--n", type=int, default=100)
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--out", default=None, help="file (default stdout)")
    export.set_defaults(func=_export)
