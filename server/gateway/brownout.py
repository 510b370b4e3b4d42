"""Brownout: under overload, serve new requests at a lower quality (never below the floor each
client allowed) so that time to first token holds, instead of queueing until the 429s come.

Terms:
    objective  `brownout_ttft_s`: the time to first token the operator promises. Admission is the
               part of it the gateway controls, so the controller watches the queue wait.
    floor      a request's `min_quality` (verifier.dial.resolve_floor); by default its own quality,
               so a client that does not opt in is never lowered.
    level      0..K: how far brownout lowers requests (verifier.dial.lowered_quality: low levels
               lower only the requests whose floors leave the most room; at K every request sits
               at its floor). Decided here, applied once per request at admission (O(1)); a running
               request never changes quality.
    cost       seconds of a slot per request: the gateway measures each finished request's service
               time (admitted to last token) and its time per token at the quality it was served
               at, per rung of the ladder. Nothing about a quality's speed is assumed: a rung never
               served borrows the time per token of its measured neighbours (linearly between two,
               else that of the nearest higher one, i.e. no speed-up).

The control rule (every `TICK_S`, on the event loop, O(window)):
    capacity(k) = slots / mean over recent requests of their service time rescaled to the rung
                  level k would serve them at (time per token there / time per token where they ran)
    raise       when the oldest waiter has waited over half the objective, or a request was refused
                for want of queue room since the last tick (the bounded queue keeps waits short
                by refusing, so a 429 is the same alarm): to the lowest level
                whose capacity covers the arrival rate with 10 % headroom, and at least one level
                up (the model may be wrong; a raise acts only once running requests finish, so
                feedback raises are spaced by `_RAISE_EVERY_S`).
    lower       one level, when nobody waits, the level has held for `_HOLD_S`, and the level
                below still covers the arrival rate with 30 % headroom. The gap between the 10 %
                and 30 % headrooms and the hold keep it from oscillating.
When even level K cannot keep up, the bounded queue still answers 429 (admission.py).

Known limits of the model (the feedback raise covers them, one level a second): a rung's time per
token is measured under whatever load it last ran at, so rungs seen only in an overload read slow
(the model then lowers further than needed, and recovers later than it could); and slot-seconds
are taken to add up, while a batch mixing kinds of rows (draft-only with verified ones) runs
slower per row than a batch of one kind.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from verifier.dial import DialConfig, DialPoint, at_quality, ladder, lowered_quality

TICK_S = 0.25  # the gateway calls `tick` this often (service.Gateway.run_brownout)
_RAISE_AT = 0.5  # x objective: the oldest waiter's wait that triggers a raise
_RAISE_HEADROOM = 1.1
_LOWER_HEADROOM = 1.3
_RAISE_EVERY_S = 1.0
_HOLD_S = 2.0
_RATE_WINDOW_S = 5.0  # arrival rate: arrivals over the last this many seconds
_WINDOW = 64  # recent finished requests the capacity estimate reads
_EWMA = 0.1  # weight of one request in a rung's time per token


@dataclass(frozen=True)
class Finished:
    """One finished request, as the capacity estimate reads it."""

    quality: float  # requested
    floor: float  # lowest allowed (= quality when not opted in)
    served: float  # the quality it ran at
    slot_seconds: float  # service time x slots


class Brownout:
    """The controller's state. `serve` is all a request costs; `tick` runs on a timer."""

    def __init__(
        self,
        config: DialConfig,
        objective_s: float | None,
        slots: int,
        oldest_wait: Callable[[float], float],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.objective_s = objective_s  # None: brownout off
        self.slots = slots
        self.rungs = ladder(config)
        self.max_level = len(self.rungs) - 1
        self.level = 0
        self._oldest_wait = oldest_wait  # now -> seconds the head of the admission queue has waited
        self._clock = clock
        self._per_token: dict[float, float] = {}  # rung -> seconds per token (per slot)
        self._recent: deque[Finished] = deque(maxlen=_WINDOW)
        self._arrivals = 0  # since the last tick
        self._refusals = 0  # 429s for want of queue room, since the last tick
        self._ticks: deque[tuple[float, int]] = deque()  # (tick time, arrivals), last _RATE_WINDOW_S
        self._rate = 0.0  # arrivals per second over the window
        now = clock()
        self._started = self._last_tick = self._changed_at = self._raised_at = now
        self.degraded_s = 0.0  # time spent at level > 0

    @property
    def enabled(self) -> bool:
        return self.objective_s is not None

    # -- per request (O(1)) ----------------------------------------------------------------------
    def arrived(self) -> None:
        self._arrivals += 1

    def refused(self) -> None:
        self._refusals += 1

    def serve(self, point: DialPoint, floor: float | None) -> DialPoint:
        """The dial point a request admitted now runs at: `point`, or lower but never below `floor`."""
        if not self.level or floor is None or point.quality is None or floor >= point.quality:
            return point
        return at_quality(point, lowered_quality(point.quality, floor, self.level, self.rungs), self.config)

    def finished(self, requested: DialPoint, floor: float | None, served: DialPoint, service_s: float,
                 tokens: int, slots: int) -> None:  # fmt: skip
        """Record a finished request's cost (autoregressive and learned requests are not ranked)."""
        if served.quality is None or requested.quality is None or tokens < 1 or served.verification.learned:
            return
        rung = self._rung(served.quality)
        per_token = service_s / tokens
        old = self._per_token.get(rung)
        self._per_token[rung] = per_token if old is None else old + _EWMA * (per_token - old)
        floor = requested.quality if floor is None else floor
        self._recent.append(Finished(requested.quality, floor, served.quality, service_s * slots))

    # -- the controller ----------------------------------------------------------------------------
    def capacity(self, level: int) -> float | None:
        """Requests per second the slots serve at `level`, from the recent requests' measured costs
        (None before any request finished)."""
        if not self._recent:
            return None
        total = 0.0
        for f in self._recent:
            q = lowered_quality(f.quality, f.floor, level, self.rungs)
            total += f.slot_seconds * self._time_per_token(q) / self._time_per_token(f.served)
        return self.slots / (total / len(self._recent))

    def tick(self) -> int:
        """Update the rate, decide the level; returns it."""
        now = self._clock()
        dt, self._last_tick = now - self._last_tick, now
        if self.level:
            self.degraded_s += dt
        self._ticks.append((now, self._arrivals))
        self._arrivals, refusals, self._refusals = 0, self._refusals, 0
        while now - self._ticks[0][0] > _RATE_WINDOW_S:
            self._ticks.popleft()
        span = min(_RATE_WINDOW_S, now - self._started)
        self._rate = sum(n for _, n in self._ticks) / span if span > 0 else 0.0
        if not self.enabled:
            return self.level
        waited = self._oldest_wait(now)
        if refusals or waited > _RAISE_AT * self.objective_s:
            target = self._lowest_level_covering(_RAISE_HEADROOM)
            if now - self._raised_at >= _RAISE_EVERY_S:
                target = max(target, self.level + 1)
            if target > self.level:
                self._set(min(target, self.max_level), now)
                self._raised_at = now
        elif (
            self.level
            and waited == 0.0
            and not refusals
            and now - self._changed_at >= _HOLD_S
            and (cap := self.capacity(self.level - 1)) is not None
            and cap >= _LOWER_HEADROOM * self._rate
        ):
            self._set(self.level - 1, now)
        return self.level

    def summary(self) -> dict:
        """What the controller sees now (GET /v1/engine/runtime's `brownout`)."""
        return {
            "enabled": self.enabled,
            "objective_ttft_s": self.objective_s,
            "level": self.level,
            "max_level": self.max_level,
            "ladder": list(self.rungs),
            "arrival_rate": round(self._rate, 3),
            "capacity_by_level": [
                None if (c := self.capacity(k)) is None else round(c, 3) for k in range(self.max_level + 1)
            ],
            "seconds_per_token": {str(k): round(v, 6) for k, v in sorted(self._per_token.items())},
        }

    # -- helpers -----------------------------------------------------------------------------------
    def _set(self, level: int, now: float) -> None:
        self.level, self._changed_at = level, now

    def _lowest_level_covering(self, headroom: float) -> int:
        """The lowest level whose capacity covers the arrival rate; the current one while nothing
        has been measured, the highest when none does."""
        if not self._recent:
            return self.level
        for k in range(self.max_level + 1):
            if self.capacity(k) >= headroom * self._rate:
                return k
        return self.max_level

    def _rung(self, quality: float) -> float:
        return min(self.rungs, key=lambda r: abs(r - quality))

    def _time_per_token(self, quality: float) -> float:
        """Measured at `quality`'s rung, else between the nearest measured rungs (see module doc)."""
        rung = self._rung(quality)
        if rung in self._per_token:
            return self._per_token[rung]
        above = [r for r in self._per_token if r > rung]
        below = [r for r in self._per_token if r < rung]
        if above and below:
            hi, lo = min(above), max(below)
            t = (rung - lo) / (hi - lo)
            return self._per_token[lo] + t * (self._per_token[hi] - self._per_token[lo])
        return self._per_token[min(above)] if above else self._per_token[max(below)]
