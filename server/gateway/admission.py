"""Admission control: a bounded number of running sequences plus a bounded FIFO of waiters.

Terms:
    slot     one running sequence; a request with n choices (x prompts) takes that many slots.
    running  slots in use; never more than `max_running` (default: the engine's max_batch, so
             admitted requests get a batch row at once and keep their latency under overload).
    waiting  requests queued for slots, at most `max_waiting`; one more is refused at once with
             `Overloaded` (the gateway answers 429 with Retry-After) instead of queueing unboundedly.

FIFO: a small request never jumps a large one queued before it, so nothing starves.
Closing (shutdown): waiters and later `acquire` calls get `Closed`; running requests keep their slots.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import asynccontextmanager


class Overloaded(Exception):
    """No slot and the waiting queue is full."""


class Closed(Exception):
    """The server is shutting down and admits nothing more."""


class Admission:
    def __init__(self, max_running: int, max_waiting: int):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0  # slots in use
        self.running_requests = 0
        self._queue: deque[tuple[int, asyncio.Future, float]] = deque()  # (slots, grant, queued at)
        self.closed = False

    @property
    def waiting_requests(self) -> int:
        return len(self._queue)

    def oldest_wait(self, now: float) -> float:
        """Seconds the head of the queue has waited (0 when nobody waits): O(1), for brownout."""
        return now - self._queue[0][2] if self._queue else 0.0

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self._queue

    async def acquire(self, slots: int = 1) -> None:
        """Wait for `slots` slots; raises Overloaded when the queue is full (fast, no waiting)."""
        if slots > self.max_running:
            raise ValueError(f"a request needs {slots} slots but the server runs at most {self.max_running}")
        if self.closed:
            raise Closed()
        if not self._queue and self.running + slots <= self.max_running:
            self.running += slots
            self.running_requests += 1
            return
        if len(self._queue) >= self.max_waiting:
            raise Overloaded()
        fut = asyncio.get_running_loop().create_future()
        entry = (slots, fut, time.monotonic())
        self._queue.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(slots)  # granted just as the waiter went away: hand it on
            elif entry in self._queue:
                self._queue.remove(entry)
                self._grant()  # the head may have been blocking smaller requests behind it
            raise

    def close(self) -> None:
        """Admit nothing more: every waiter gets `Closed` now."""
        self.closed = True
        while self._queue:
            _, fut, _ = self._queue.popleft()
            if not fut.done():
                fut.set_exception(Closed())

    def release(self, slots: int = 1) -> None:
        self.running -= slots
        self.running_requests -= 1
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.running + self._queue[0][0] <= self.max_running:
            slots, fut, _ = self._queue.popleft()
            if fut.done():
                continue
            self.running += slots
            self.running_requests += 1
            fut.set_result(None)

    @asynccontextmanager
    async def slots(self, slots: int = 1):
        await self.acquire(slots)
        try:
            yield
        finally:
            self.release(slots)
