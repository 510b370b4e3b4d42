"""`dialspec bench engine` (and the `bench` group other features may add to)."""

from __future__ import annotations

import json
from pathlib import Path

from server.cli_errors import CLIError
from server.engine.embedded.bench.report import to_markdown
from server.engine.embedded.bench.runner import TIERS, run_bench


def _bench_subparsers(subparsers):
    """The `bench` group's sub-commands, created here or shared with another feature's `bench X`."""
    import argparse

    bench = subparsers.choices.get("bench")
    if bench is None:
        bench = subparsers.add_parser("bench", help="benchmarks")
        bench.set_defaults(func=lambda args: bench.print_help() or 2)
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return bench.add_subparsers(dest="bench_command", metavar="WHAT")


def register(subparsers) -> None:
    sub = _bench_subparsers(subparsers)
    p = sub.add_parser("engine", help="embedded engine per dial tier vs engine AR and HF generate")
    p.add_argument("--target", help="target model dir (default: the shipped embedded pair)")
    p.add_argument("--draft", help="draft model dir (default: the shipped embedded pair)")
    p.add_argument("--concurrency", default="1,8", help="comma-separated, e.g. 1,8 (default)")
    # EOS is ignored so every method emits the same tokens; the embedded pair's answers are 15-27
    # tokens, and text forced past EOS is noise to both models (acceptance 0.31 at 64 tokens vs the
    # pair's 0.72), so the default stays inside the answers.
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request, EOS ignored (default 24)")
    p.add_argument(
        "--length-spread", type=float, default=0.25,
        help="request lengths spread evenly over max_tokens x (1 ± this), mean max_tokens; 0 = all "
        "equal, which keeps plain decoding's batches in lockstep (default 0.25)",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=8, help="task-suite prompts in the workload (default 8)")
    p.add_argument(
        "--waves", default="1",
        help="passes over the prompt list: one number, or one per --concurrency (1,4: four passes at "
        "the second concurrency, so its rows run as many rounds as batch 1's; default 1)",
    )  # fmt: skip
    p.add_argument("--trials", type=int, default=2, help="interleaved repeats; the fastest is kept")
    p.add_argument(
        "--tiers",
        default=",".join(TIERS),
        help=f"dial tiers to run ('q0' = quality 0; default {','.join(TIERS)})",
    )
    p.add_argument(
        "--sweep", nargs="?", const="all", default=None, metavar="NS",
        help="also run each tier at fixed N: every N in 0..--max-num-draft, or those listed (0,2,4,8)",
    )  # fmt: skip
    p.add_argument("--max-num-draft", type=int, default=8, help="largest N (adaptive and sweep; default 8)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop starting runs after this long")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--response-format", choices=("json",), default=None,
        help="every engine request follows a small JSON schema (the grammar's mask cost per round is "
        "reported as grammar_ms; HF baselines stay unconstrained)",
    )  # fmt: skip
    p.add_argument(
        "--unseeded", action="store_true",
        help="engine requests without a seed (planned jointly with their batch, as most traffic is); "
        "by default each is seeded, which gives every method the same draws and plans each row alone",
    )  # fmt: skip
    p.add_argument("--no-hf", action="store_true", help="skip the HF baselines")
    p.add_argument("--no-hf-assisted", action="store_true", help="skip HF assisted generation (slow)")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 tokens, 2 prompts, 1 trial")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
        help="model dtype for the engine and HF baselines (auto: bfloat16 on CUDA, on CPU the faster "
        "one for this pair, measured)",
    )  # fmt: skip
    p.add_argument(
        "--cache-dir", default=None,
        help="keep measured cost models and dtype choices here (default: measure afresh every run)",
    )  # fmt: skip
    p.add_argument(
        "--forced-tv", type=float, default=None, metavar="TV",
        help="accept each draft with probability 1 - w*TV (0.1-0.3 is what same-family real pairs show) "
        "while every forward, check and bonus step runs for real: the tiers at a real pair's acceptance "
        "on random-weight shapes (`dialspec pair synth`), where drafts are otherwise all rejected. "
        "Timing only; the output follows no law",
    )  # fmt: skip
    p.add_argument("--out", default="bench-results", help="output directory")
    p.set_defaults(func=_main)


def _sweep(args) -> tuple[int, ...]:
    if args.sweep is None:
        return ()
    if args.sweep == "all":
        return tuple(range(args.max_num_draft + 1))
    try:
        ns = tuple(sorted({int(x) for x in args.sweep.split(",") if x.strip()}))
    except ValueError as exc:
        raise CLIError(f"--sweep takes Ns like 0,2,4,8 (or nothing for all), got {args.sweep!r}") from exc
    if not ns or min(ns) < 0 or max(ns) > args.max_num_draft:
        bound = f"0..--max-num-draft ({args.max_num_draft})"
        raise CLIError(f"--sweep Ns must lie in {bound}, got {args.sweep!r}")
    return ns


def _validate(args) -> tuple[tuple[int, ...], tuple[str, ...], str, str]:
    try:
        conc = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    except ValueError as exc:
        raise CLIError(f"--concurrency must be integers like 1,8, got {args.concurrency!r}") from exc
    if not conc or min(conc) < 1 or args.max_tokens < 1 or not 1 <= args.max_num_draft <= 16:
        raise CLIError("need concurrency >= 1, --max-tokens >= 1 and 1 <= --max-num-draft <= 16")
    if not 0 <= args.length_spread < 1:
        raise CLIError(f"--length-spread must be in [0, 1), got {args.length_spread}")
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise CLIError(f"unknown --tiers {bad or args.tiers!r}; use some of {','.join(TIERS)}")
    try:
        waves = tuple(int(x) for x in args.waves.split(","))
    except ValueError:
        waves = ()
    if len(waves) not in (1, len(conc)):
        raise CLIError(f"--waves takes one number or one per --concurrency ({len(conc)}), got {args.waves!r}")
    args.waves = waves[0] if len(waves) == 1 else waves
    if min(waves) < 1 or args.trials < 1 or args.prompts < 1:
        raise CLIError("--prompts, --waves and --trials must be >= 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise CLIError("--max-seconds must be > 0")
    if args.forced_tv is not None and not 0.0 <= args.forced_tv <= 1.0:
        raise CLIError(f"--forced-tv must lie in [0, 1], got {args.forced_tv}")
    if (args.target is None) != (args.draft is None):
        raise CLIError("pass both --target and --draft, or neither (the shipped embedded pair)")
    target, draft = args.target, args.draft
    if target is None:
        try:
            from server.engine.embedded.engine import default_pair_paths

            target, draft, _ = default_pair_paths()
        except Exception as exc:  # module missing or pair not downloaded/trained yet
            raise CLIError(f"embedded pair unavailable ({exc}); pass --target and --draft") from exc
    for path in (target, draft):
        if not (Path(path) / "config.json").exists():
            raise CLIError(f"{path} is not an HF model directory (no config.json)")
    return conc, tiers, str(target), str(draft)


def _main(args) -> int:
    from rich.progress import Progress

    conc, tiers, target, draft = _validate(args)
    sweep = _sweep(args)
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise CLIError(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:0)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda but torch sees no CUDA device; use --device cpu")
    max_tokens, prompts, trials = (8, 2, 1) if args.quick else (args.max_tokens, args.prompts, args.trials)
    with Progress() as progress:
        report = run_bench(
            target, draft, progress, concurrency=conc, max_tokens=max_tokens, prompts=prompts,
            waves=args.waves, trials=trials, tiers=tiers, sweep=sweep,
            max_num_draft=args.max_num_draft, temperature=args.temperature, include_hf=not args.no_hf,
            include_hf_assisted=not args.no_hf_assisted, device=str(device), dtype=args.dtype,
            max_seconds=args.max_seconds, cache_dir=args.cache_dir, length_spread=args.length_spread,
            forced_tv=args.forced_tv, response_format=args.response_format, seeded=not args.unseeded,
        )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(report, indent=2))
    md = to_markdown(report)
    (out / "engine.md").write_text(md)
    print(md)
    print(f"wrote {out / 'engine.json'} and {out / 'engine.md'}")
    return 0
