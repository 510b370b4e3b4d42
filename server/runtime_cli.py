"""`dialspec runtime launch|print-command`: the SGLang command line for a draft/target pair.

One place knows the flags that turn SGLang 0.5.23 into a dialspec runtime: STANDALONE
speculative decoding with a separate draft model, a topk = 1 chain of N drafts, the
rejection-sampling verify path the plugin patches, Prometheus metrics, and the plugin switched
on through the environment (`server.sglang_plugin.params`). `print-command` prints it as a
shell line; `launch` checks that the plugin is installed and replaces this process with the
SGLang server (GPU node only). The Docker image, docker-compose and k8s all run
`dialspec runtime launch`, so this module is the only place the flags are written.

Every option can come from the environment (what the deploy files set), a flag wins over its
variable: `--target` DIALSPEC_TARGET_MODEL, `--draft` DIALSPEC_DRAFT_MODEL, `-n`
DIALSPEC_NUM_DRAFT, `--default-w` DIALSPEC_DEFAULT_W, `--head` DIALSPEC_HEAD_PATH (empty = none),
`--host` SGLANG_HOST, `--port` SGLANG_PORT; SGLANG_EXTRA_ARGS (split like a shell line) is put
before the flags given after `--`.

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

from server.cli_errors import CLIError
from server.sglang_plugin.params import ENV_DEFAULT_W, ENV_ENABLE, ENV_HEAD_PATH

INSTALL_HINT = "SGLang is not installed here: pip install 'dialspec[sglang]' (on a GPU node)"
PLUGIN_ENTRY_POINT = "server.sglang_plugin:register"
ENV_TARGET, ENV_DRAFT, ENV_NUM_DRAFT = "DIALSPEC_TARGET_MODEL", "DIALSPEC_DRAFT_MODEL", "DIALSPEC_NUM_DRAFT"
ENV_HOST, ENV_PORT, ENV_EXTRA = "SGLANG_HOST", "SGLANG_PORT", "SGLANG_EXTRA_ARGS"


def _model_ref(value: str, what: str) -> str:
    """A local model directory or a hub id `org/name`; anything else is a typo."""
    path = Path(value).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if value.count("/") == 1 and not value.startswith((".", "/", "~")):
        return value  # hub id; SGLang resolves it
    raise CLIError(f"{what} {value!r} is neither a model directory nor an org/name hub id")


def _from_env(args: argparse.Namespace, environ=None) -> argparse.Namespace:
    """Fill options not given as flags from the environment; one-line errors name the variable."""
    env = os.environ if environ is None else environ

    def number(flag: str, var: str, kind, default):
        value = getattr(args, flag)
        if value is not None:
            return value
        raw = env.get(var, "").strip()
        if not raw:
            return default
        try:
            return kind(raw)
        except ValueError:
            raise CLIError(f"{var}={raw!r} is not a valid {kind.__name__}") from None

    out = argparse.Namespace(**vars(args))
    for flag, var in (("target", ENV_TARGET), ("draft", ENV_DRAFT)):
        value = getattr(args, flag) or env.get(var, "").strip()
        if not value:
            raise CLIError(f"--{flag} is required (or set {var})")
        setattr(out, flag, value)
    out.num_draft = number("num_draft", ENV_NUM_DRAFT, int, 5)
    out.default_w = number("default_w", ENV_DEFAULT_W, float, 1.0)
    out.port = number("port", ENV_PORT, int, 30000)
    out.host = args.host or env.get(ENV_HOST, "").strip() or "127.0.0.1"
    out.head = args.head if args.head is not None else (env.get(ENV_HEAD_PATH, "").strip() or None)
    try:
        env_extra = shlex.split(env.get(ENV_EXTRA, ""))
    except ValueError as exc:
        raise CLIError(f"{ENV_EXTRA}: {exc}") from None
    extra = list(args.extra or [])
    out.extra = env_extra + (extra[1:] if extra[:1] == ["--"] else extra)
    return out


def build_command(args: argparse.Namespace, environ=None) -> tuple[list[str], dict[str, str]]:
    """`(argv, extra environment)` for the SGLang server described by `args` (and `environ`)."""
    args = _from_env(args, environ)
    if args.num_draft < 1:
        raise CLIError(f"--num-draft must be >= 1, got {args.num_draft}")
    if not 0.0 <= args.default_w <= 1.0:
        raise CLIError(f"--default-w must be in [0, 1], got {args.default_w}")
    if not 0 < args.port < 65536:
        raise CLIError(f"--port must lie in 1..65535, got {args.port}")
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
    argv += args.extra
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


def check_plugin_installed() -> None:
    """The plugin's entry point must be visible to SGLang (group `sglang.srt.plugins`); without it
    SGLang would refuse STANDALONE rejection sampling with a confusing error."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value == PLUGIN_ENTRY_POINT]
    if not found:
        raise CLIError(
            f"dialspec's SGLang plugin is not registered (entry point {PLUGIN_ENTRY_POINT} in the group "
            "sglang.srt.plugins): reinstall dialspec (pip install -e .) in the runtime's environment"
        )


def _launch(args: argparse.Namespace) -> int:
    argv, env = build_command(args)
    if importlib.util.find_spec("sglang") is None:
        raise CLIError(INSTALL_HINT)
    check_plugin_installed()
    print(shell_line(argv, env), file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, {**os.environ, **env})  # never returns
    return 0  # pragma: no cover


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help=f"target model directory or org/name (default ${ENV_TARGET})")
    p.add_argument("--draft", help=f"draft model dir or org/name, same vocabulary (default ${ENV_DRAFT})")
    p.add_argument("--num-draft", "-n", type=int, help=f"draft length N (default ${ENV_NUM_DRAFT}, else 5)")
    p.add_argument(
        "--default-w",
        type=float,
        help=f"w for requests that send none, 1 = lossless (default ${ENV_DEFAULT_W}, else 1.0)",
    )
    p.add_argument(
        "--head",
        help=f"learned head (a `dialspec train` directory or TorchScript file) for per-token w "
        f"(default ${ENV_HEAD_PATH}; turns every CUDA graph off)",
    )
    p.add_argument("--host", help=f"listen address (default ${ENV_HOST}, else 127.0.0.1)")
    p.add_argument("--port", type=int, help=f"listen port (default ${ENV_PORT}, else 30000)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--mem-fraction", type=float, help="SGLang --mem-fraction-static")
    p.add_argument("--python", default=sys.executable, help="interpreter that has sglang installed")
    p.add_argument(
        "extra",
        nargs=argparse.REMAINDER,
        help=f"after `--`: more SGLang flags as is (after ${ENV_EXTRA})",
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser("runtime", help="SGLang runtime with the dialspec plugin (GPU nodes)")
    sub = parser.add_subparsers(dest="runtime_command", metavar="ACTION", required=True)
    launch = sub.add_parser("launch", help="start SGLang with the plugin on (replaces this process)")
    _add_common(launch)
    launch.set_defaults(func=_launch)
    show = sub.add_parser("print-command", help="print the SGLang command line, run nothing")
    _add_common(show)
    show.set_defaults(func=_print_command)
