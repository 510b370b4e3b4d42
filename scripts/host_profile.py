#!/usr/bin/env python3
"""Where the embedded engine's scheduler thread spends its host time, per tier: `cProfile` around
the scheduler loop during one closed-loop run per (tier, concurrency), beside the stage timers.

On CUDA a decoding step of the embedded pair is launch- and host-bound, so a tier that does the
same device work as plain decoding (an adaptive row held at N = 0) can still be slower by its
Python: this shows which functions.

    python scripts/host_profile.py [--device cuda] [--tiers ar,exact,q0] [--concurrency 1,32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from transformers import AutoTokenizer

    from server.engine.embedded.bench.runner import BenchConfig, _start_engine, _workload, tier_verification
    from server.engine.embedded.bench.workload import engine_run
    from server.engine.embedded.engine import default_pair_paths
    from server.engine.embedded.scheduler import Scheduler
    from server.engine.embedded.timers import Stage
    from verifier.dial import Verification

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiers", default="ar,exact,standard,q0")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--rows", type=int, default=18, help="functions shown per run")
    ap.add_argument("--unseeded", action="store_true")
    args = ap.parse_args()
    target, draft, _ = default_pair_paths()
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    cfg = BenchConfig(str(target), str(draft), concurrency=concurrency, waves=args.waves, device=args.device,
                      dtype="bfloat16" if args.device != "cpu" else "auto", profile_budget_s=1.0)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(cfg.target_path, padding_side="left")
    chats, prompt_ids = _workload(tok, cfg.prompts)
    engine = _start_engine(cfg, prompt_ids, chats)
    current: list[cProfile.Profile] = []
    loop = Scheduler._loop

    def profiled_loop(self):  # the scheduler thread runs under the profile current at its start
        current[-1].enable()
        try:
            loop(self)
        finally:
            current[-1].disable()

    sched = engine.scheduler
    sched.stop()
    Scheduler._loop = profiled_loop
    current.append(cProfile.Profile())
    sched.start()
    engine_run(engine, prompt_ids[:2], 4, 1.0, tier_verification("standard"), clients=2)  # warm-up
    for c in concurrency:
        for tier in args.tiers.split(","):
            verify = Verification(mode="autoregressive") if tier == "ar" else tier_verification(tier)
            sched.stop()
            current.append(cProfile.Profile())
            sched.start()
            tokens, seconds, _, timers = engine_run(
                engine, prompt_ids, cfg.max_tokens, 1.0, verify, c, args.waves, spread=cfg.length_spread,
                seeded=not args.unseeded,
            )  # fmt: skip
            rounds = max(timers["round_count"], 1)
            ms = {stage: 1e3 * timers[f"{stage}_s"] / rounds for stage in Stage}
            per_round = ", ".join(f"{stage} {v:.2f}" for stage, v in ms.items() if v)
            mean_n = timers["draft_tokens"] / max(timers["row_rounds"], 1)
            print(
                f"\n## {tier} c={c}: {tokens / seconds:.0f} tok/s, {timers['round_count']} rounds, "
                f"mean N {mean_n:.2f}; ms per round: {per_round}"
            )
            sched.stop()
            buf = io.StringIO()
            stats = pstats.Stats(current[-1], stream=buf)
            stats.sort_stats("tottime").print_stats(args.rows)
            stats.sort_stats("cumtime").print_stats("dialspec|server|verifier", args.rows)
            print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()), flush=True)
            sched.start()
    sched.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
