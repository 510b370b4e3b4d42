"""Load shapes and sweeps.

    closed loop (fixed concurrency C)  C workers each send their next request as soon as the
        previous one finished; the offered load adapts to the server's speed.
    open loop (Poisson rate r)         request i is sent at time t_i regardless of how earlier
        requests fare; inter-arrival gaps are independent Exponential(r) draws (mean 1/r s), the
        standard model of independent users. `inf` sends everything at t = 0.
    sweep                              the same run repeated for each value of a comma list, e.g.
        `--concurrency 1,4,8` or `--rate 1,2,4`; one phase per value.

Schedules are seeded (`random.Random(f"poisson:{seed}")`) so the same seed gives the same
arrival times, whatever the server does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadShape:
    """One phase's shape: `kind` is "concurrency" (value = workers) or "rate" (value = req/s)."""

    kind: str
    value: float
    max_concurrency: int | None = None  # open loop only: cap on requests in flight

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency={int(self.value)}"
        return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}/s"


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of `n` open-loop requests at `rate` requests/second."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if math.isinf(rate):
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(f"poisson:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def parse_sweep(text: str, kind: str) -> list[float]:
    """`"1,4,8"` -> [1, 4, 8]. Concurrency values must be positive integers; rates positive numbers
    or `inf`. Raises ValueError with a message fit for the command line."""
    flag = f"--{kind}"
    values: list[float] = []
    for raw in text.split(","):
        item = raw.strip()
        try:
            value = float(item)
        except ValueError:
            raise ValueError(
                f"{flag} takes comma-separated numbers, e.g. {flag} 1,4,8; got {item!r}"
            ) from None
        if kind == "concurrency":
            if not math.isfinite(value) or value < 1 or value != int(value):
                raise ValueError(f"{flag} values must be whole numbers >= 1, got {item!r}")
        elif math.isnan(value) or value <= 0:
            raise ValueError(f"{flag} values must be positive requests/second (or inf), got {item!r}")
        values.append(value)
    return values
