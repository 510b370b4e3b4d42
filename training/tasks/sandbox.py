"""Run untrusted model-written Python against asserts: subprocess, timeout, no network, temp dir.

Guarantees (best effort without OS-level isolation, documented honestly):
    * a fresh interpreter (`python -I`: no site-packages on the path tricks, no env vars honoured),
      working directory and HOME/TMPDIR in a throw-away temp dir that is deleted afterwards;
    * a wall-clock timeout (the process group is killed), plus RLIMIT_CPU / RLIMIT_AS / RLIMIT_FSIZE
      so an infinite loop or a memory bomb cannot hang or starve the scorer;
    * a CPython audit hook installed *before* the candidate code runs refuses sockets, subprocesses,
      `os.system`, and any file opened for writing outside the temp dir. Audit hooks cannot be
      removed from inside the interpreter.
Anything that fails, raises, times out or is blocked scores as a failure -- never a hang.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap

_PRELUDE = textwrap.dedent(
    """
    import os, sys
    _ROOT = os.path.realpath(os.getcwd())
    def _guard(event, args):
        if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn",
                             "os.fork", "pty.", "ctypes.")):
            raise PermissionError("sandbox: " + event + " is not allowed")
        if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(
                c in args[1] for c in "wax+"):
            path = os.path.realpath(str(args[0]))
            if not path.startswith(_ROOT + os.sep):
                raise PermissionError("sandbox: writes only inside the temp dir")
    sys.addaudithook(_guard)
    del _guard
    """
)


def _limits() -> None:  # runs in the child before exec
    import resource

    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (5, 5))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def run_tests(program: str, tests: list[str], timeout_s: float = 3.0) -> bool:
    """True iff `program` followed by `tests` exits 0 within `timeout_s` seconds in the sandbox."""
    source = _PRELUDE + "\n" + program + "\n\n" + "\n".join(tests) + "\n"
    with tempfile.TemporaryDirectory(prefix="dialspec-sandbox-") as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w") as fh:
            fh.write(source)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0"}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", path],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_limits,
            )
        except OSError:
            return False
        try:
            return proc.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
            return False
