"""`dialspec train` and `dialspec eval`: the head's training run and the evaluation harness.

    dialspec train [--updates 40] [--out models/embedded/head] [--resume]
    dialspec eval  [--head models/embedded/head] [--out runs/eval] [--limit 16] [--quick]
    dialspec eval-pool RUN1 RUN2 ... --out runs/eval_pooled   (runs of one command with --seed 0, 1, ...)

Both default to the shipped embedded pair (`server.engine.model_pair.verify_pair()`); `--target` and
`--draft` (with `--pair-name`) pick another one. User mistakes raise `server.cli_errors.CLIError`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields
from pathlib import Path

from server.cli_errors import CLIError

DEFAULT_HEAD = "models/embedded/head"


def resolve_pair(args) -> tuple[str, str, str]:
    """(target, draft, name) from `--target/--draft/--pair-name`, else the shipped pair."""
    if bool(args.target) != bool(args.draft):
        raise CLIError("give both --target and --draft, or neither (the shipped embedded pair)")
    if args.target:
        for p in (args.target, args.draft):
            if not (Path(p) / "config.json").is_file():
                raise CLIError(f"{p} is not a model directory (no config.json)")
        return args.target, args.draft, args.pair_name or Path(args.target).name
    try:
        from server.engine.model_pair import verify_pair

        pair = verify_pair()
    except (ImportError, OSError, ValueError, RuntimeError) as exc:  # RuntimeError: PairIntegrityError
        raise CLIError(f"the embedded pair is not available ({exc}); pass --target and --draft") from exc
    return str(pair.target), str(pair.draft), pair.name


def _pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (default: the shipped embedded pair)")
    p.add_argument("--draft", help="draft model directory")
    p.add_argument("--pair-name", help="the pair's name (default: the target directory's name)")
    p.add_argument("--seed", type=int, default=0)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return values


def _positive(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(not v >= 0.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return values


def _named_dirs(text: str) -> dict[str, str]:
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep or not name or not path or "[" in name or name in out:
            raise argparse.ArgumentTypeError(f"expected NAME=DIR pairs with distinct names, got {part!r}")
        out[name] = path
    return out


def _tasks(text: str) -> tuple[str, ...]:
    from training.tasks import TASKS

    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown task(s) {bad}; choose from {sorted(TASKS)}")
    return names


def register(subparsers) -> None:
    t = subparsers.add_parser("train", help="train the learned weight head with REINFORCE++")
    _pair_args(t)
    t.add_argument("--out", default=DEFAULT_HEAD, help=f"where to write the head (default {DEFAULT_HEAD})")
    t.add_argument("--run-dir", default="runs/train", help="checkpoints and the training log")
    t.add_argument("--updates", type=int, default=None, help="REINFORCE++ updates")
    t.add_argument("--batch", type=int, default=None, help="rollouts per update")
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--max-tokens", type=int, default=None, help="completion tokens per rollout")
    t.add_argument("--tasks", type=_tasks, default=None, help="comma-separated tasks")
    t.add_argument("--dials", type=_floats, default=None, help="dial grid sampled per rollout")
    t.add_argument("--eval-every", type=int, default=None)
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other TrainConfig field, e.g. --set lambda_max=2 --set kl_coef=0.02",
    )
    t.add_argument("--resume", action="store_true", help="continue from run-dir/checkpoint.pt")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=run_train)

    e = subparsers.add_parser("eval", help="Table 1 + Pareto plots: every policy on the task suite")
    _pair_args(e)
    e.add_argument("--head", default=DEFAULT_HEAD, help="learned head directory ('none' to skip)")
    e.add_argument("--out", default="runs/eval", help="output directory (JSON, markdown, PNG, SVG)")
    e.add_argument("--limit", type=int, default=None, help="prompts per task (default 96; --quick 6)")
    e.add_argument("--tasks", type=_tasks, default=None)
    e.add_argument("--split", choices=("train", "dev", "test"), default="test")
    e.add_argument("--max-tokens", type=int, default=None)
    e.add_argument("--w-sweep", type=_floats, default=None, help="static weights (w = 1 is the SD row)")
    e.add_argument("--lenience-sweep", type=_floats, default=None, help="SD lossy lenience values")
    e.add_argument("--alpha-sweep", type=_positive, default=None, help="SpecCascade α values (>= 0)")
    e.add_argument("--typical-sweep", type=_positive, default=None, help="scales of Medusa's (ε, δ)")
    e.add_argument("--dials", type=_floats, default=None, help="dial points for the learned head")
    e.add_argument(
        "--ablation-heads", type=_named_dirs, default=None, metavar="NAME=DIR,...",
        help="more heads to evaluate beside --head, reported as learned[NAME]",
    )  # fmt: skip
    e.add_argument("--quick", action="store_true", help="a small, fast slice (6 prompts, fewer points)")
    e.add_argument(
        "--time-chunks", type=int, default=None,
        help="run the policies interleaved over this many chunks of each task's prompts (default 8)",
    )  # fmt: skip
    e.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model dtype (auto: bfloat16 on CUDA, on CPU the faster one for this pair, measured)",
    )
    e.set_defaults(func=run_eval_cmd)

    pool = subparsers.add_parser(
        "eval-pool", help="pool `dialspec eval` runs made with different --seed into one table and plots"
    )
    pool.add_argument("runs", nargs="+", type=Path, help="eval output directories (or their results.json)")
    pool.add_argument("--out", default="runs/eval_pooled", help="output directory (JSON, markdown, PNG, SVG)")
    pool.set_defaults(func=run_eval_pool_cmd)


def run_train(args) -> int:
    from training.rl import TrainConfig
    from training.trainer import Trainer

    target, draft, name = resolve_pair(args)
    overrides = {
        "updates": args.updates,
        "batch": args.batch,
        "lr": args.lr,
        "max_tokens": args.max_tokens,
        "tasks": args.tasks,
        "dials": args.dials,
        "eval_every": args.eval_every,
    }
    if args.updates is not None and args.updates < 0:
        raise CLIError("--updates must be >= 0 (0: calibration and warm start only)")
    for key in ("batch", "max_tokens", "eval_every"):
        if overrides[key] is not None and overrides[key] < 1:
            raise CLIError(f"--{key.replace('_', '-')} must be >= 1")
    known = {f.name: f for f in fields(TrainConfig)}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in known or key in ("target_path", "draft_path", "extra"):
            raise CLIError(f"--set {item!r}: expected KEY=VALUE with KEY a TrainConfig field")
        default = getattr(TrainConfig(), key)
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("expected true or false")
                overrides[key] = value.lower() in ("true", "1")
            elif isinstance(default, tuple):
                overrides[key] = tuple(type(default[0])(v) for v in value.split(",")) if default else ()
            else:
                overrides[key] = type(default)(value)
        except ValueError as exc:
            raise CLIError(f"--set {item!r}: {exc}") from exc
    cfg = TrainConfig(
        target_path=target,
        draft_path=draft,
        pair_name=name,
        out_dir=args.out,
        run_dir=args.run_dir,
        seed=args.seed,
        **{k: v for k, v in overrides.items() if v is not None and k in known},
    )
    if args.resume and not (Path(cfg.run_dir) / "checkpoint.pt").is_file():
        raise CLIError(f"--resume: no checkpoint at {cfg.run_dir}/checkpoint.pt")
    try:
        trainer = Trainer(cfg)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    summary = trainer.train(resume=args.resume, progress=not args.no_progress)
    first, last = summary["dev"][0], summary["dev"][-1]
    print(
        f"trained {summary['updates']} updates in {summary['wall_s']:.0f}s; dev objective "
        f"{first['objective']:.3f} -> {last['objective']:.3f}; head written to {cfg.out_dir}"
    )
    return 0


def run_eval_cmd(args) -> int:
    from training.eval_report import write_report
    from training.policy_eval import EvalConfig, run_eval

    target, draft, name = resolve_pair(args)
    head_path = None if args.head in (None, "", "none") else args.head
    paths = ({"": head_path} if head_path else {}) | dict(args.ablation_heads or {})
    heads = {}
    if paths:
        from server.engine.head_store import load_head

        for key, path in paths.items():
            try:
                heads[key] = load_head(path, name, target_path=target, draft_path=draft)
            except (FileNotFoundError, ValueError) as exc:
                raise CLIError(f"{exc} (or pass --head none)") from exc
    cfg = EvalConfig(
        target_path=target,
        draft_path=draft,
        pair_name=name,
        head_path=head_path,
        seed=args.seed,
        dtype=args.dtype,
    )
    if args.quick:
        cfg.limit, cfg.max_tokens, cfg.w_sweep, cfg.dials = 6, 48, (0.0, 0.5), (0.25, 0.75)
        cfg.lenience_sweep, cfg.alpha_sweep, cfg.typical_sweep = (0.25,), (0.5, 2.0), (1.0,)
    for key, value in (
        ("limit", args.limit),
        ("tasks", args.tasks),
        ("split", args.split),
        ("max_tokens", args.max_tokens),
        ("w_sweep", args.w_sweep),
        ("lenience_sweep", args.lenience_sweep),
        ("alpha_sweep", args.alpha_sweep),
        ("typical_sweep", args.typical_sweep),
        ("dials", args.dials),
        ("time_chunks", args.time_chunks),
    ):
        if value is not None:
            setattr(cfg, key, value)
    if cfg.limit < 1:
        raise CLIError("--limit must be >= 1")
    if cfg.time_chunks < 1:
        raise CLIError("--time-chunks must be >= 1 (1: each policy's prompts in one batch run)")
    t0 = time.perf_counter()

    def progress(task, row):
        if "chunk" in row:
            print(f"  {task:8s} chunk {row['chunk']}/{row['chunks']} done "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
            return
        acc = "–" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
        print(
            f"  {task:8s} {row['policy']:20s} acc {acc:>6s}  score {row['score']:.3f}  "
            f"{row['tokens_per_s']:7.1f} tok/s  norm time {row['norm_time']:.3f}",
            flush=True,
        )

    results = run_eval(cfg, heads=heads, progress=progress)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    written = write_report(results, args.out)
    print(f"eval done in {results['wall_s']:.0f}s; wrote {', '.join(str(p) for p in written.values())}")
    return 0


def run_eval_pool_cmd(args) -> int:
    import json

    from training.eval_pool import pool
    from training.eval_report import write_report

    runs = []
    for path in args.runs:
        file = path / "results.json" if path.is_dir() else path
        if not file.is_file():
            raise CLIError(f"{file} not found; pass the --out directories of `dialspec eval` runs")
        try:
            runs.append(json.loads(file.read_text()))
        except json.JSONDecodeError as exc:
            raise CLIError(f"{file} is not an eval's results.json ({exc})") from exc
    try:
        pooled = pool(runs)
    except (ValueError, KeyError) as exc:
        raise CLIError(f"cannot pool these runs: {exc}") from exc
    written = write_report(pooled, args.out)
    prompts = {t: r["prompts"] for t, r in pooled["tasks"].items()}
    print(f"pooled {len(runs)} runs (seeds {pooled['config']['pooled_seeds']}, prompts {prompts}); "
          f"wrote {', '.join(str(p) for p in written.values())}")  # fmt: skip
    return 0
