"""`dialspec` command line. Each subcommand lives with its feature and registers here.

A subcommand module exposes `register(subparsers)`; it adds its parser and sets `func`.
User mistakes raise `CLIError` and print one line with the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide subcommands (added as features land).
SUBCOMMAND_MODULES: list[str] = [
    "server.engine.bench",
    "server.gateway.serve",
    "loadtest.cli",
    "training.commands",
    "training.pair_cli",
    "server.runtime_cli",
]


class CLIError(Exception):
    """A user mistake: printed as one line `dialspec: error: ...` with exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dialspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"dialspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run through the importable module, not this `__main__` copy: subcommands raise
    # `server.cli.CLIError`, which must be the class `main` catches.
    from server.cli import main as _main

    sys.exit(_main())
