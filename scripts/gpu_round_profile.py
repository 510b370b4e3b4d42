#!/usr/bin/env python3
"""Where the embedded engine's rounds spend time on CUDA, per tier: `torch.profiler` around
`run_bench` rows at one concurrency (fixed N), ops sorted by host time and by device time.

    python scripts/gpu_round_profile.py [--tiers exact,standard] [--concurrency 32] [--n 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from server.engine.embedded.bench import run_bench
    from server.engine.embedded.engine import default_pair_paths

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="exact,standard")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25, help="ops shown per table")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft, _ = default_pair_paths()
    for tier in args.tiers.split(","):
        opts = dict(
            concurrency=(args.concurrency,),
            tiers=(tier,),
            sweep=(args.n,),
            max_tokens=24,
            waves=2,
            trials=1,
            include_hf=False,
            device=device,
            dtype="bfloat16",
            profile_budget_s=1.0,
        )
        run_bench(target, draft, **opts)  # warm-up (shapes, allocator)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            report = run_bench(target, draft, **opts)
        for row in report["rows"]:
            print(
                f"{tier}: {row['method']} c={row['concurrency']}: {row['tokens_per_s']:.0f} tok/s, "
                f"t_draft {row['t_draft_ms']} ms, t_verify {row['t_verify_ms']} ms",
                flush=True,
            )
        ka = prof.key_averages()
        print(
            f"\n## {tier}: by self host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=args.rows)
        )
        if device == "cuda":
            by_device = ka.table(sort_by="self_device_time_total", row_limit=args.rows)
            print(f"\n## {tier}: by device time\n" + by_device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
