"""Continuous batching: a thread that admits, prefills, steps and retires rows.

Terms
    waiting   submitted rows not yet holding a slot (FIFO); `load()['waiting']`.
    running   rows holding a slot and decoding; `load()['running']`.
    step      one pass of the loop: retire cancelled rows, admit waiting rows into free slots
              (prefilled together in one padded forward), then one round per draft-length group
              (see `step.py`).
              Rows join and leave only between steps, so a step's tensors never change shape.

Draft length: before the rounds of a step, the draft-length planner (`draft_length.py`) sets N
for the adaptive rows from their acceptance estimates and the measured cost model at this step's
batch; fixed rows (a per-request num_draft, autoregressive requests) keep theirs.

Grouping: rows with different N (including N = 0) run as separate rounds within the same step.
Mixing them into one target forward would pad every N = 0 row to N+1 positions; separate rounds
cost one extra forward instead, which the planner prices in when it picks the Ns.

Slots are handed out lowest-first so that a busy batch usually occupies `0..R-1` and the KV cache
read is a view rather than a gather.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from server.engine.round_timers import StepTimers
from server.engine.row import Row
from server.engine.step import Models, prefill, run_round


class Scheduler:
    def __init__(self, models: Models, max_batch: int):
        self.models = models
        self.max_batch = max_batch
        self.timers = StepTimers()
        self._free = list(range(max_batch))
        self._waiting: deque[Row] = deque()
        self._running: list[Row] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    # -- thread-safe API -------------------------------------------------------------------
    def submit(self, row: Row) -> None:
        with self._cv:
            self._waiting.append(row)
            self._cv.notify()

    def cancel(self, row: Row) -> None:
        """Abort a row: dropped from the queue now, or its slot freed before the next step."""
        with self._cv:
            row.cancelled = True
            if row in self._waiting:
                self._waiting.remove(row)
            self._cv.notify()

    def load(self) -> dict[str, int]:
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dialspec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, abort_error: Exception | None = None) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for row in [*self._running, *self._waiting]:
            if not row.done and abort_error is not None:
                row.fail(abort_error)
        self._running.clear()
        self._waiting.clear()
        self._free = list(range(self.max_batch))

    # -- scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        if self.models.num_threads:  # per-thread OpenMP setting: affects only this thread
            torch.set_num_threads(self.models.num_threads)
        while True:
            with self._cv:
                while not self._stopping and not self._running and not self._waiting:
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except BaseException as exc:  # a model failure must reach every caller, not kill silently
                self.error = exc
                for row in list(self._running):
                    row.fail(exc)
                    self._retire(row)
                time.sleep(0.01)

    def _retire(self, row: Row) -> None:
        with self._cv:
            if row in self._running:
                self._running.remove(row)
                self._free.append(row.slot)
                self._free.sort()
            row.slot = -1

    def _admit(self) -> list[Row]:
        new = []
        with self._cv:
            while self._waiting and self._free:
                row = self._waiting.popleft()
                row.slot = self._free.pop(0)
                self._running.append(row)
                new.append(row)
        return new

    def step(self) -> None:
        """Retire finished/cancelled rows, admit and prefill new ones, run one round per group."""
        for row in list(self._running):
            if row.cancelled or row.done:
                self._retire(row)
        new = self._admit()
        if new:
            with self.timers.phase("prefill", self.models.device):
                prefill(self.models, new)
        live = [row for row in self._running if not row.cancelled and not row.done]
        planner = self.models.planner
        if planner is not None:
            with self.timers.phase("plan", self.models.device):
                planner.assign(live)
        groups: dict[int, list[Row]] = {}
        for row in live:
            groups.setdefault(row.num_draft, []).append(row)
        for n, rows in sorted(groups.items()):
            predicted = planner.predict(rows, n) if planner is not None else None
            seconds = run_round(self.models, rows, n, self.timers)
            if predicted is not None:
                self.timers.record_prediction(seconds, *predicted)
        for row in list(self._running):
            if row.cancelled or row.done:
                self._retire(row)
