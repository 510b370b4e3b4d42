"""`dialspec runtime launch|print-command`: the SGLang command line for a draft/target pair.

One place knows the flags that turn SGLang 0.5.23 into a dialspec runtime: STANDALONE
speculative decoding with a separate draft model, a topk = 1 chain of N drafts, the
rejection-sampling verify path the plugin patches, Prometheus metrics, and the plugin switched
on through the environment (`server.sglang_plugin.params`). `print-command` prints it as a
shell line; `launch` replaces this process with the SGLang server (GPU node only).

Terms: N (`--num-draft`) is the draft length, `--speculative-num-steps`; SGLang's
`--speculative-num-draft-tokens` counts the verified slots, N + 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from server.cli import CLIError
from server.sglang_plugin.params import ENV_DEFAULT_W, ENV_ENABLE, ENV_HEAD_PATH

INSTALL_HINT = "SGLang is not installed here: pip install 'dialspec[sglang]' (on a GPU node)"


def _model_ref(value: str, what: str) -> str:
    """A local model directory or a hub id `org/name`; anything else is a typo."""
    path = Path(value).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if value.count("/") == 1 and not value.startswith((".", "/", "~")):
        return value  # hub id; SGLang resolves it
    raise CLIError(f"{what} {value!r} is neither a model directory nor an org/name hub id")


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """`(argv, extra environment)` for the SGLang server described by `args`."""
    if args.num_draft < 1:
        raise CLIError(f"--num-draft must be >= 1, got {args.num_draft}")
    if not 0.0 <= args.default_w <= 1.0:
        raise CLIError(f"--default-w must be in [0, 1], got {args.default_w}")
    argv = [
        args.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        _model_ref(args.target, "--target"),
        "--speculative-algorithm",
        "STANDALONE",
        "--speculative-draft-model-path",
        _model_ref(args.draft, "--draft"),
        "--speculative-num-steps",
        str(args.num_draft),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(args.num_draft + 1),
        "--speculative-use-rejection-sampling",
        "--enable-metrics",
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    if args.tp > 1:
        argv += ["--tp-size", str(args.tp)]
    if args.mem_fraction is not None:
        argv += ["--mem-fraction-static", str(args.mem_fraction)]
    extra = list(args.extra or [])
    argv += extra[1:] if extra[:1] == ["--"] else extra
    env = {ENV_ENABLE: "1", ENV_DEFAULT_W: repr(float(args.default_w))}
    if args.head:
        head = Path(args.head).expanduser()
        if not head.exists():
            raise CLIError(f"--head {args.head!r}: no such head directory or TorchScript file")
        env[ENV_HEAD_PATH] = str(head.resolve())
        # The head's state capture runs as forward hooks, which CUDA-graph replay skips: every
        # phase's graphs go (decode: draft/verify graphs; prefill: the breakable prefill graph).
        argv.insert(argv.index("--enable-metrics"), "--disable-cuda-graph")
    return argv, env


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def _print_command(args: argparse.Namespace) -> int:
    argv, env = build_command(args)
    print(shell_line(argv, env))
    return 0


def _launch(args: argparse.Namespace) -> int:
    argv, env = build_command(args)
    if importlib.util.find_spec("sglang") is None:
        raise CLIError(INSTALL_HINT)
    print(shell_line(argv, env), file=sys.stderr)
    os.execvpe(argv[0], argv, {**os.environ, **env})  # never returns
    return 0  # pragma: no cover


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory or org/name")
    p.add_argument("--draft", required=True, help="draft model directory or org/name (same vocabulary)")
    p.add_argument("--num-draft", "-n", type=int, default=5, help="draft length N (default 5)")
    p.add_argument(
        "--default-w", type=float, default=1.0, help="w for requests that send none (1 = lossless)"
    )
    p.add_argument("--head", help="TorchScript learned head for per-token w (optional)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--mem-fraction", type=float, help="SGLang --mem-fraction-static")
    p.add_argument("--python", default=sys.executable, help="interpreter that has sglang installed")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after `--`: more SGLang flags, passed as is")


def register(subparsers) -> None:
    parser = subparsers.add_parser("runtime", help="SGLang runtime with the dialspec plugin (GPU nodes)")
    sub = parser.add_subparsers(dest="runtime_command", metavar="ACTION", required=True)
    launch = sub.add_parser("launch", help="start SGLang with the plugin on (replaces this process)")
    _add_common(launch)
    launch.set_defaults(func=_launch)
    show = sub.add_parser("print-command", help="print the SGLang command line, run nothing")
    _add_common(show)
    show.set_defaults(func=_print_command)
