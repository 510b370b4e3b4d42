"""Do seeded outputs survive batch composition on the embedded engine in a given dtype?

The README's "Seeds" numbers: `tests/test_engine_seeds.py`'s seeded requests (exact, two tiers,
quality 0, a greedy w < 1 row, a learned row; tiny pair, adaptive N) are run alone, alone again,
then `--trials` times inside busy mixed batches of unseeded noise, and each output is compared
with its alone run. Prints one line per differing output and a summary.

    PYTHONPATH=. python scripts/seed_batch_check.py --dtype bfloat16 --trials 10
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

import tests.test_engine_seeds as seeds
from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from tests.tiny_pair import drafting_costs, make_tiny_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    pair = make_tiny_pair(Path(tempfile.mkdtemp(prefix="seed-batch-")))
    config = EmbeddedEngineConfig(
        *pair,
        max_batch=seeds.MAX_BATCH,
        max_context=160,
        profile_budget_s=0.3,
        head=seeds._head,
        dtype=args.dtype,
    )
    engine = EmbeddedEngine(config)
    engine.start_sync()
    engine.scheduler.models.planner.set_cost(drafting_costs(seeds.MAX_BATCH, config.max_num_draft))
    try:
        seeded = seeds._seeded(engine)
        alone = [seeds._together(engine, [r])[0] for r in seeded]
        again = [seeds._together(engine, [r])[0] for r in seeded]
        print(f"alone twice: {sum(a == b for a, b in zip(alone, again, strict=True))}/{len(alone)} identical")
        rng = random.Random(0)
        differing = compared = 0
        for trial in range(args.trials):
            mixed = seeded + seeds._noise(engine, rng, 8)
            order = list(range(len(mixed)))
            rng.shuffle(order)
            results = seeds._together(engine, [mixed[i] for i in order])
            by_id = {mixed[i].request_id: out for i, out in zip(order, results, strict=True)}
            for request, (tokens, _) in zip(seeded, alone, strict=True):
                got, _ = by_id[request.request_id]
                compared += 1
                if got != tokens:
                    differing += 1
                    at = next(
                        (k for k, (a, b) in enumerate(zip(got, tokens, strict=False)) if a != b), len(tokens)
                    )
                    print(f"trial {trial} {request.request_id}: differs from token {at} of {len(tokens)}")
        print(f"{args.dtype}: {differing} of {compared} seeded outputs differ in busy batches")
    finally:
        asyncio.run(engine.stop())


if __name__ == "__main__":
    main()
