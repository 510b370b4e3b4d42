"""The learned head's share of a speculative round on the embedded engine.

    python scripts/head_cost.py [--head models/embedded/head] [--concurrency 8] [--tokens 64]

Runs `--concurrency` requests at quality 'auto' (the head's default dial) through the embedded
engine, timing every head call (the module, plus the position statistics it reads) against the
scheduler's round timer, and prints one JSON line: rounds, mean round ms, mean head ms per
round, and the head's share of a round. Interleaving is not needed: both clocks run in the same
rounds, so the share is a ratio measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import server.engine.embedded.round as step  # noqa: E402
from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from server.engine.model_pair import suite_prompts  # noqa: E402
from server.engine.protocol import GenerationRequest, SamplingOptions  # noqa: E402
from verifier.dial import Verification  # noqa: E402


class _Clock:
    seconds = 0.0
    calls = 0


class TimedHead:
    """Delegates to the head; adds each call's wall time to `_Clock`."""

    def __init__(self, head):
        self._head = head

    def __getattr__(self, name):
        return getattr(self._head, name)

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self._head(*args)
        _Clock.seconds += time.perf_counter() - t0
        _Clock.calls += 1
        return out


def _timed(fn):
    def wrapper(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        _Clock.seconds += time.perf_counter() - t0
        return out

    return wrapper


async def _run(engine: EmbeddedEngine, prompts: list[str], tokens: int, dial: float) -> None:
    async def one(i: int, text: str):
        req = GenerationRequest(
            request_id=f"h{i}",
            prompt_token_ids=tuple(engine.encode_prompt(text)),
            sampling=SamplingOptions(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True),
            verify=Verification(dial=dial),
        )
        async for _ in engine.generate(req):
            pass

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default=str(Path(__file__).resolve().parents[1] / "models/embedded/head"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--num-draft", type=int, default=5, help="fixed N: rounds comparable")
    args = ap.parse_args()
    config = EmbeddedEngineConfig(head=args.head, max_batch=args.concurrency, num_draft=args.num_draft)
    engine = EmbeddedEngine(config)
    engine.start_sync()
    sched = engine.scheduler
    sched.models.head = TimedHead(sched.models.head)
    step.position_stats = _timed(step.position_stats)
    prompts = suite_prompts(args.concurrency)
    dial = engine.info.auto_dial
    asyncio.run(_run(engine, prompts, 4, dial))  # warm-up
    sched.timers.reset()
    _Clock.seconds, _Clock.calls = 0.0, 0
    for _ in range(args.waves):
        asyncio.run(_run(engine, prompts, args.tokens, dial))
    t = sched.timers
    asyncio.run(engine.stop())
    out = {
        "concurrency": args.concurrency,
        "rounds": t.rounds,
        "round_ms": 1e3 * t.seconds.get("round", 0.0) / max(t.rounds, 1),
        "head_ms_per_round": 1e3 * _Clock.seconds / max(t.rounds, 1),
        "head_share": _Clock.seconds / t.seconds["round"] if t.seconds.get("round") else None,
        "head_calls": _Clock.calls,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
