"""How much room a per-prompt selector has: the per-prompt oracle's frontier against each method's.

    python scripts/prompt_oracle.py runs/eval/results.json [--methods static,cascade]

Reads a `dialspec eval` results.json (per-prompt scores and draft counts of every point), builds,
per task, the oracle that picks for each prompt the best of every non-AR point as it realised
(`training.frontiers.prompt_oracle`; optimistic: it keeps lucky draws), and prints the mean of
oracle − method frontier over the method's acceptance range, and the oracle's lead at a few
acceptances. A small lead means no per-prompt choice among these settings can beat that method;
the 2026-11-23 test split (SD, static w ∈ {0, 0.5}, cascade α ∈ {0.5, 0.75, 0.9, 1}) gave
+0.12..+0.18 on math and +0.01..+0.04 on code over the cascade + SD hull.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.eval_report import frontier_groups  # noqa: E402
from training.frontiers import MIN_WIDTH, _coords, frontier_at, prompt_oracle  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a `dialspec eval` results.json")
    ap.add_argument("--methods", default="", help="comma-separated families to compare (default: all)")
    args = ap.parse_args(argv)
    if not args.results.is_file():
        print(f"error: {args.results} not found; run `dialspec eval --out DIR` and pass DIR/results.json",
              file=sys.stderr)  # fmt: skip
        return 2
    results = json.loads(args.results.read_text())
    wanted = {m for m in args.methods.split(",") if m}
    for task, res in results["tasks"].items():
        groups = frontier_groups(res)
        every = {p.name: p for pts in groups.values() for p in pts}
        ox, oy = prompt_oracle(list(every.values()))
        print(f"{task} ({len(every)} points; oracle from {ox[0]:.3f} to {ox[-1]:.3f} acceptance)")
        full = (np.arange(len(next(iter(every.values())).scores)), None)
        for method, pts in groups.items():
            if wanted and method not in wanted:
                continue
            x, y = _coords(pts, full, "acceptance")
            lo, hi = max(x.min(), ox[0]), min(x.max(), ox[-1])
            if hi - lo < MIN_WIDTH:
                print(f"  oracle - {method:10s} (its points span no acceptance range)")
                continue
            grid = np.linspace(lo, hi, 41)
            lead = np.interp(grid, ox, oy) - frontier_at(x, y, grid)
            marks = "  ".join(f"{g:.2f}: {d:+.3f}" for g, d in zip(grid[::10], lead[::10], strict=True))
            print(f"  oracle - {method:10s} mean {np.nanmean(lead):+.3f}   at {marks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
