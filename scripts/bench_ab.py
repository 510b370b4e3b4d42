"""`dialspec bench engine` on two source trees, alternated on one host, side by side.

A rewrite must be shown to lose nothing, and this host's speed swings by 2x over minutes: two
benches run an hour apart compare the host's spells, not the code. So the two trees (git worktrees:
`git worktree add --detach /tmp/old <commit>`) run the same bench command in turn, `--passes`
times, the first tree first on odd passes and second on even ones, each in its own process with
its own PYTHONPATH. Each target line of the bench is reported per tree as its median over passes
and how many passes met it, with the noise floor (AR control / AR) of the same passes.

    python scripts/bench_ab.py --a /tmp/old --b . --passes 2 --out runs/ab -- \\
        --concurrency 1,8 --waves 1,8 --sweep 0,2,4,6 --trials 3 --no-hf-assisted

writes runs/ab/{a,b}-pass{k}/engine.{json,md} and runs/ab/ab.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _run(tree: Path, bench_args: list[str], out: Path, python: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # the bench alone: a bare GPU node lacks the gateway's packages, which the full CLI imports
    cmd = [python, "-m", "server.engine.embedded.bench", "engine", *bench_args, "--out", str(out.resolve())]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    print(f"  {out.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads((out / "engine.json").read_text())


def _line(name: str) -> str:
    """A target's name without what varies between runs (the best N, the worst tier or pair)."""
    name = re.sub(r" \(worst pair\): [^,]*,", " (worst pair),", name)
    return re.sub(r" \((N=\d+|worst: [^)]*|dialspec_[^)]*)\)", "", name)


def summarise(reports: dict[str, list[dict]]) -> dict:
    """{line: {tree: {"median", "met", "passes", "target"}}}, lines in the first report's order."""
    out: dict[str, dict] = {}
    for tree, runs in reports.items():
        for report in runs:
            for name, t in report["targets"].items():
                cell = out.setdefault(_line(name), {}).setdefault(tree, {"values": [], "met": 0})
                cell["values"].append(t["value"])
                cell["met"] += bool(t["met"])
                cell["target"] = t["target"]
    for cells in out.values():
        for cell in cells.values():
            cell["median"] = statistics.median(cell.pop("values"))
            cell["passes"] = len(next(iter(reports.values())))
    return out


def to_markdown(summary: dict, trees: dict[str, str], command: str) -> str:
    a, b = trees
    lines = [
        "# bench A/B\n",
        f"`{command}`\n",
        f"A: `{trees[a]}`  B: `{trees[b]}`; medians over passes, (met / passes).\n",
        "| target line | goal | A | B |",
        "|---|---|---|---|",
    ]
    for name, cells in summary.items():

        def cell(tree, cells=cells):
            c = cells.get(tree)
            if c is None:
                return "–"
            met = "" if c["target"] == "-" else f" ({c['met']}/{c['passes']})"
            return f"{c['median']:.3f}{met}"

        goal = next(iter(cells.values()))["target"]
        lines.append(f"| {name} | {goal} | {cell(a)} | {cell(b)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="first source tree (e.g. the old commit's worktree)")
    p.add_argument("--b", required=True, help="second source tree")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--again", action="store_true", help="only re-read the passes already in --out")
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    trees = {"a": str(Path(args.a).resolve()), "b": str(Path(args.b).resolve())}
    for name, tree in trees.items():
        if not (Path(tree) / "server" / "cli.py").is_file():
            p.error(f"--{name} {tree} is not a dialspec source tree (no server/cli.py)")
    out = Path(args.out)
    reports: dict[str, list[dict]] = {"a": [], "b": []}
    for k in range(1, args.passes + 1):
        print(f"pass {k}/{args.passes}", flush=True)
        for tree in ("a", "b") if k % 2 else ("b", "a"):
            run = out / f"{tree}-pass{k}"
            if args.again:
                reports[tree].append(json.loads((run / "engine.json").read_text()))
            else:
                reports[tree].append(_run(Path(trees[tree]), bench_args, run, args.python))
    summary = summarise(reports)
    command = "python scripts/bench_ab.py " + " ".join(argv)
    (out / "ab.json").write_text(json.dumps({"trees": trees, "command": command, "lines": summary}, indent=2))
    (out / "ab.md").write_text(to_markdown(summary, trees, command))
    print((out / "ab.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
