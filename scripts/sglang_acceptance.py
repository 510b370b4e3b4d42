#!/usr/bin/env python3
"""GPU acceptance suite for dialspec's SGLang plugin: one command on a GPU node, a markdown report.

    python scripts/sglang_acceptance.py --target /models/target --draft /models/draft -n 5 \\
        --report sglang-acceptance.md

It starts, probes and stops its own servers, one at a time, on local target/draft directories:
the plugin runtime (`dialspec runtime` flags) once per draft-path configuration, then a plain
SGLang target server and a plain draft server as references. What each check proves, and the
statistics behind it, are in docs/sglang.md ("GPU acceptance suite") and in
scripts/sglang_acceptance_{suite,checks,stats}.py. Exit status 0 when every check passes.

Seeds: every request carries its own `sampling_seed`. The suite relies on none of them for
reproducibility; they only keep samples independent when the servers run with
`--enable-deterministic-inference` (`--deterministic`), under which SGLang gives unseeded
requests the same seed. `--deterministic` also makes the greedy comparison exact (tolerance 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import httpx  # noqa: E402
from sglang_acceptance_checks import FAIL, PASS, CheckResult  # noqa: E402
from sglang_acceptance_suite import DRAFT_PATHS, Handle, Suite, SuiteOptions  # noqa: E402

LAW_PROMPTS = ["The capital of France is", "Once upon a time, there was a"]
GREEDY_PROMPTS = [
    "Q: Tom has 12 apples and buys 7 more. How many apples does he have? A:",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five prime numbers greater than 100.",
    "Translate to French: The weather is nice today.",
    "def quicksort(xs):",
    "The three most important ideas in thermodynamics are",
    "Summarize: the council approved a budget of 45 million on Monday.",
]
CONFIG_KEYS = {"default": 0, "eager": 1, "graph-mix": 2, "no-overlap": 3}


class LocalServers:
    """Starts SGLang servers as subprocesses on this node (logs under `work_dir`)."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.count = args, 0
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)

    def _argv(self, role: str, flags: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
        a = self.args
        common = ["--tp-size", str(a.tp)] + (
            ["--mem-fraction-static", str(a.mem_fraction)] if a.mem_fraction else []
        )
        common += ["--enable-deterministic-inference"] if a.deterministic else []
        if role == "plugin":
            from server.runtime_cli import build_command

            ns = argparse.Namespace(
                target=a.target, draft=a.draft, num_draft=a.num_draft, default_w=1.0, head=None,
                host="127.0.0.1", port=a.port, tp=1, mem_fraction=None, python=a.python,
                extra=[*common, *flags],
            )  # fmt: skip
            return build_command(ns, environ={})
        model = a.target if role == "target" else a.draft
        argv = [a.python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1"]
        return [*argv, "--port", str(a.port), "--enable-metrics", *common, *flags], {}

    def start(self, role: str, flags: tuple[str, ...]) -> Handle:
        argv, env = self._argv(role, flags)
        self.count += 1
        log_path = self.work / f"{self.count:02d}-{role}.log"
        full_env = {k: v for k, v in os.environ.items() if k != "DIALSPEC_SGLANG_PLUGIN"} | env
        command = " ".join([*(f"{k}={v}" for k, v in env.items()), *argv])
        print(f"[{role}] {command}\n[{role}] log: {log_path}", flush=True)
        log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(
            argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        handle = Handle(
            f"http://127.0.0.1:{self.args.port}", command, lambda: log_path.read_text(errors="replace")
        )
        handle.proc, handle.file = proc, log
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.stop(handle)
                tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
                raise RuntimeError(f"exited with status {proc.returncode} during startup: {tail}")
            try:
                if httpx.get(handle.url + "/health", timeout=5).status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
            time.sleep(3)
        self.stop(handle)
        raise RuntimeError(f"not healthy after {self.args.startup_timeout:.0f} s (log {log_path})")

    def stop(self, handle: Handle) -> None:
        proc = handle.proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        handle.file.close()


def preflight(args: argparse.Namespace) -> tuple[list[CheckResult], dict[str, str]]:
    """Versions, the plugin entry point and a shared vocabulary, before any server starts."""
    results, env = (
        [],
        {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node()},
    )
    try:
        import sglang
        import torch

        env |= {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": str(torch.version.cuda),
        }
        env |= {"sglang": getattr(sglang, "__version__", "?")}
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
        commit = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        env["dialspec"] = commit.stdout.strip() or "unknown commit"
        ok = env["sglang"] == "0.5.23"
        results.append(
            CheckResult(
                "preflight: versions",
                "-",
                PASS if ok else FAIL,
                ", ".join(f"{k} {v}" for k, v in env.items()),
            )
        )
    except ImportError as exc:
        results.append(CheckResult("preflight: versions", "-", FAIL, f"cannot import: {exc}"))
    from server.cli import CLIError
    from server.runtime_cli import check_plugin_installed

    try:
        check_plugin_installed()
        results.append(
            CheckResult(
                "preflight: plugin entry point",
                "-",
                PASS,
                "server.sglang_plugin:register in sglang.srt.plugins",
            )
        )
    except CLIError as exc:
        results.append(CheckResult("preflight: plugin entry point", "-", FAIL, str(exc)))
    results.append(shared_vocab(args.target, args.draft))
    return results, env


def shared_vocab(target: str, draft: str) -> CheckResult:
    """Target and draft must share one tokenizer (same token -> id map) and vocabulary size."""
    import json

    from transformers import AutoTokenizer

    try:
        sizes = [json.loads((Path(d) / "config.json").read_text()).get("vocab_size") for d in (target, draft)]
        vocabs = [AutoTokenizer.from_pretrained(d).get_vocab() for d in (target, draft)]
    except Exception as exc:
        return CheckResult("preflight: shared vocabulary", "-", FAIL, f"{type(exc).__name__}: {exc}")
    ok = sizes[0] == sizes[1] and vocabs[0] == vocabs[1]
    return CheckResult(
        "preflight: shared vocabulary",
        "-",
        PASS if ok else FAIL,
        f"vocab_size {sizes}, tokenizers {'equal' if vocabs[0] == vocabs[1] else 'DIFFER'}",
    )


def _cell(text: str) -> str:
    return text.replace("|", "/")  # a bar would split the markdown table cell


def render(
    results: list[CheckResult], env: dict[str, str], options: SuiteOptions, commands: dict[str, str]
) -> str:
    """The markdown report."""
    failed = [r for r in results if not r.passed]
    lines = [
        "# SGLang acceptance report (dialspec plugin)",
        "",
        *(f"- {k}: {v}" for k, v in env.items()),
        f"- N = {options.num_draft}; law samples {options.law_samples} per prompt and arm, "
        f"L = {options.law_tokens}; sweep {options.sweep_requests} requests x {options.sweep_tokens} tokens; "
        f"alpha {options.alpha} per check",
        "- seeds: every request has its own sampling_seed; no check relies on seeded reproducibility",
        "",
        f"**{'PASS' if not failed else 'FAIL'}**: {len(results) - len(failed)} of {len(results)} "
        "checks passed.",
        "",
        "| check | configuration | result | summary |",
        "|---|---|---|---|",
        *(f"| {_cell(r.name)} | {_cell(r.config)} | {r.status} | {_cell(r.summary)} |" for r in results),
    ]
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            lines += [
                f"### {r.name} ({r.config})",
                "",
                r.summary,
                "",
                *(f"- {d}" for d in r.details[:20]),
                "",
            ]
    lines += ["", "## Server commands", "", *(f"- {k}: `{v}`" for k, v in commands.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="local target model directory")
    ap.add_argument("--draft", required=True, help="local draft model directory (same tokenizer)")
    ap.add_argument("--num-draft", "-n", type=int, default=5)
    ap.add_argument("--report", default="sglang-acceptance.md")
    ap.add_argument("--work-dir", default="sglang-acceptance-logs", help="server logs")
    ap.add_argument(
        "--configs", default="default,eager,graph-mix,no-overlap", help=f"subset of {','.join(CONFIG_KEYS)}"
    )
    ap.add_argument("--law-samples", type=int, default=2000)
    ap.add_argument("--sweep-requests", type=int, default=64)
    ap.add_argument("--mixed-samples", type=int, default=1200)
    ap.add_argument("--alpha", type=float, default=1e-3)
    ap.add_argument("--greedy-tolerance", type=float, default=0.1)
    ap.add_argument(
        "--deterministic", action="store_true", help="--enable-deterministic-inference on every server"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mem-fraction", type=float)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--startup-timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    for d in (args.target, args.draft):
        if not (Path(d) / "config.json").is_file():
            ap.error(f"{d}: not a local model directory (no config.json)")
    unknown = set(args.configs.split(",")) - set(CONFIG_KEYS)
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}; choose from {sorted(CONFIG_KEYS)}")
    results, env = preflight(args)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    options = SuiteOptions(
        num_draft=args.num_draft,
        law_prompts=[tok.encode(p) for p in LAW_PROMPTS],
        greedy_prompts=[tok.encode(p) for p in GREEDY_PROMPTS],
        law_samples=args.law_samples,
        sweep_requests=args.sweep_requests,
        mixed_samples=args.mixed_samples,
        alpha=args.alpha,
        greedy_tolerance=0.0 if args.deterministic else args.greedy_tolerance,
        seed=args.seed,
    )
    configs = [DRAFT_PATHS[CONFIG_KEYS[k]] for k in args.configs.split(",")]
    if all(r.passed for r in results):
        suite = Suite(options, LocalServers(args), configs)
        results += suite.run()
        commands = suite.commands
    else:
        commands = {}
    Path(args.report).write_text(render(results, env, options, commands))
    failed = [r for r in results if not r.passed]
    print(
        f"{'PASS' if not failed else 'FAIL'}: {len(results) - len(failed)}/{len(results)} checks; "
        f"report {args.report}"
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
