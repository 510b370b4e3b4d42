"""`python -m server.engine.embedded.bench engine ...`: `dialspec bench engine` without the rest of
the CLI, whose gateway needs packages a bare GPU node (torch, triton, transformers) does not have."""

import argparse
import sys

from server.cli_errors import CLIError
from server.engine.embedded.bench import cli

PROG = "python -m server.engine.embedded.bench"

parser = argparse.ArgumentParser(prog=PROG)
commands = parser.add_subparsers()
cli.register(commands)
cli._bench_subparsers(commands).choices["engine"].prog = f"{PROG} engine"  # usage as typed
args = parser.parse_args(["bench", *sys.argv[1:]])
try:
    sys.exit(int(args.func(args) or 0))
except CLIError as exc:
    print(f"{PROG}: error: {exc}", file=sys.stderr)
    sys.exit(2)
