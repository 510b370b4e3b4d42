"""`dialspec` command line: the application's entry point. Each subcommand lives with its feature.

A subcommand module exposes `register(subparsers)`; it adds its parser and sets `func`. Modules
are named here as strings and imported only to build the parser: the CLI sits above every layer
(verifier <- engine <- gateway; training and loadtest on top) and nothing imports it back.
User mistakes raise `server.cli_errors.CLIError` (or a subcommand's own error type listed in its
module's `CLI_ERRORS`) and print one line with the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from server.cli_errors import CLIError

# Modules that provide subcommands.
SUBCOMMAND_MODULES: list[str] = [
    "server.engine.embedded.bench.cli",
    "server.gateway.serve",
    "loadtest.cli",
    "training.commands",
    "training.pair_cli",
    "server.runtime_cli",
]


def build_parser() -> tuple[argparse.ArgumentParser, tuple[type[Exception], ...]]:
    """The parser, and the exception types that mean "user mistake" (CLIError and the modules'
    own `CLI_ERRORS`: loadtest, which depends only on the HTTP API, brings its own)."""
    parser = argparse.ArgumentParser(prog="dialspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    user_errors: tuple[type[Exception], ...] = (CLIError,)
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(sub)
        user_errors += tuple(getattr(module, "CLI_ERRORS", ()))
    return parser, user_errors


def main(argv: list[str] | None = None) -> int:
    parser, user_errors = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except user_errors as exc:
        print(f"dialspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
