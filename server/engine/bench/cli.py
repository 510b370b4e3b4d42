"""`dialspec bench engine` (and the `bench` group other features may add to)."""

from __future__ import annotations

import json
from pathlib import Path

from server.cli_errors import CLIError
from server.engine.bench.report import to_markdown
from server.engine.bench.runner import run_bench


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
    p = sub.add_parser("engine", help="embedded engine vs HF generate / assisted generation")
    p.add_argument("--target", help="target model dir (default: the shipped embedded pair)")
    p.add_argument("--draft", help="draft model dir (default: the shipped embedded pair)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated, e.g. 1,4,8")
    # EOS is ignored so every method emits the same tokens; the embedded pair's answers are 15-27
    # tokens, and text forced past EOS is noise to both models (acceptance 0.31 at 64 tokens vs the
    # pair's 0.72), so the default stays inside the answers.
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request, EOS ignored (default 24)")
    p.add_argument("--num-draft", type=int, default=5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-hf", action="store_true", help="skip the HF baselines")
    p.add_argument("--waves", type=int, default=4, help="passes over the prompt list (the workload size)")
    p.add_argument("--trials", type=int, default=2, help="interleaved repeats; the fastest is kept")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 tokens, 1 wave, 1 trial")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None,
        help="model dtype for the engine and HF baselines (default: float32 on CPU, bfloat16 on CUDA)",
    )  # fmt: skip
    p.add_argument("--out", default="bench-results", help="output directory")
    p.set_defaults(func=_main)


def _main(args) -> int:
    from rich.progress import Progress

    try:
        conc = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    except ValueError as exc:
        raise CLIError(f"--concurrency must be integers like 1,4,8, got {args.concurrency!r}") from exc
    if not conc or min(conc) < 1 or args.max_tokens < 1 or not 1 <= args.num_draft <= 16:
        raise CLIError("need concurrency >= 1, --max-tokens >= 1 and 1 <= --num-draft <= 16")
    if (args.target is None) != (args.draft is None):
        raise CLIError("pass both --target and --draft, or neither (the shipped embedded pair)")
    target, draft = args.target, args.draft
    if target is None:
        try:
            from server.engine.embedded import default_pair_paths

            target, draft, _ = default_pair_paths()
        except Exception as exc:  # module missing or pair not downloaded/trained yet
            raise CLIError(f"embedded pair unavailable ({exc}); pass --target and --draft") from exc
    for path in (target, draft):
        if not (Path(path) / "config.json").exists():
            raise CLIError(f"{path} is not an HF model directory (no config.json)")
    if args.waves < 1 or args.trials < 1:
        raise CLIError("--waves and --trials must be >= 1")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise CLIError(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:0)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda but torch sees no CUDA device; use --device cpu")
    max_tokens, waves, trials = (8, 1, 1) if args.quick else (args.max_tokens, args.waves, args.trials)
    with Progress() as progress:
        report = run_bench(
            target, draft, progress, concurrency=conc, max_tokens=max_tokens, num_draft=args.num_draft,
            temperature=args.temperature, include_hf=not args.no_hf, waves=waves, trials=trials,
            device=str(device), dtype=args.dtype,
        )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(report, indent=2))
    md = to_markdown(report)
    (out / "engine.md").write_text(md)
    print(md)
    print(f"wrote {out / 'engine.json'} and {out / 'engine.md'}")
    return 0
