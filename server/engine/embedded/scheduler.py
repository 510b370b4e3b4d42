"""Continuous batching: a thread that admits, prefills, steps and retires rows.

Terms
    waiting   submitted rows not yet holding a slot (FIFO); `load()['waiting']`.
    running   rows holding a slot and decoding; `load()['running']`.
    step      one pass of the loop: retire cancelled rows, admit waiting rows into free slots
              (prefilled together in one padded forward), then one round per draft-length group
              (see `round.py`).
              Rows join and leave only between steps, so a step's tensors never change shape.

Draft length: before the rounds of a step, the draft-length planner (`draft_planner.py`) sets N
for the adaptive rows from their acceptance estimates and the measured cost model at this step's
batch; fixed rows (a per-request num_draft, autoregressive requests) keep theirs. Seeded and greedy
rows are planned alone, from their own history and the start-up cost profile, so that their output
does not depend on the load (`draft_planner.py`, module doc).

Grouping: rows with different N (including N = 0) run as separate rounds within the same step.
Mixing them into one target forward would pad every N = 0 row to N+1 positions; separate rounds
cost one extra forward instead, which the planner prices in when it picks the Ns. Quality-0 rows
that decode from the draft alone (`draft_only.py`) form groups of their own.

Slots are handed out lowest-first so that a busy batch usually occupies `0..R-1` and the KV cache
read is a view rather than a gather.

Fault isolation: an exception while prefilling or stepping fails only the rows that cause it.
    prefill   (with each row's first token, `prefill.py`) retried row by row for the rows that
              have not drawn their first token; a row whose own prefill raises is failed.
    round     `run_round` changes a row's state only in its last stage (`advance`, row by row, in
              order) apart from drawing its coins; the coins are put back from a snapshot of each
              row's generator. If some rows had advanced, the last of them raised (the rest run
              next step). Otherwise every row is run alone: the ones that raise alone are failed,
              the others get exactly the tokens they would have got (a row's draws depend only on
              its own stream, so its output is the same alone or batched). The adaptive N keeps
              that: a row learns its acceptance as it advances (`round.advance`), and a row whose
              round did not run gets this step's plan undone (its count of plain rounds), so the
              planner sees the same history for it next step as without the fault.
    engine    when every suspect failed alone, a probe request (`probe`, a tiny fresh row) is run;
              if it raises too, the engine itself is broken: `fault` is set, every row fails and
              the loop stops (the process should exit, see protocol.engine_fault). Failed rows get
              EngineError 'internal' naming the exception type (messages may quote data).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from server.engine.embedded.draft_only import run_draft_only_round
from server.engine.embedded.models import Models
from server.engine.embedded.prefill import prefill
from server.engine.embedded.round import run_round
from server.engine.embedded.row import Row
from server.engine.embedded.timers import Stage, StepTimers
from server.engine.protocol import EngineError

log = logging.getLogger("dialspec.engine")


class Scheduler:
    def __init__(self, models: Models, max_batch: int, probe: Callable[[], Row] | None = None):
        self.models = models
        self.max_batch = max_batch
        self.probe = probe  # builds a tiny known-good row, run to tell a bad request from a bad engine
        self.timers = StepTimers()
        self._free = list(range(max_batch))
        self._waiting: deque[Row] = deque()
        self._running: list[Row] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.fault: BaseException | None = None  # unrecoverable: set once, the loop has stopped
        self.faults = 0  # requests failed by an isolated fault (the engine went on)

    # -- thread-safe API -------------------------------------------------------------------
    def submit(self, row: Row) -> None:
        with self._cv:
            if self.fault is not None:
                raise EngineError(f"engine failed: {type(self.fault).__name__}", "unavailable")
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

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
            except BaseException as exc:  # step() isolates request faults: this is the engine's own
                self._die(exc)
                return

    def _die(self, exc: BaseException) -> None:
        log.critical("engine fault, the engine stops: %s", type(exc).__name__, exc_info=exc)
        err = EngineError(f"engine failed: {type(exc).__name__}", "unavailable")
        with self._cv:
            self.fault = exc
            rows = [*self._running, *self._waiting]
            self._running.clear()
            self._waiting.clear()
        for row in rows:
            if not row.done:
                row.fail(err)

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
        t0 = time.perf_counter()
        for row in list(self._running):
            if row.cancelled or row.done:
                self._retire(row)
        new = self._admit()
        t_prefill = time.perf_counter()
        if new:
            with self.timers.phase(Stage.PREFILL, self.models.device):
                self._prefill(new)
        prefill_s = time.perf_counter() - t_prefill
        live = [row for row in self._running if not row.cancelled and not row.done]
        planner = self.models.planner
        planned = [(row, row.rounds, row.estimate.plain_rounds) for row in live]
        if planner is not None:
            with self.timers.phase(Stage.PLAN, self.models.device):
                planner.assign(live)
        groups: dict[tuple[bool, int], list[Row]] = {}
        for row in live:
            groups.setdefault((row.mode.draft_only, row.num_draft), []).append(row)
        rounds_s = 0.0
        for (_, n), rows in sorted(groups.items()):
            seconds = self._round(rows, n, planner.predict(rows, n) if planner is not None else None)
            rounds_s += seconds or 0.0
        for row, rounds, plain_rounds in planned:
            if row.rounds == rounds:  # no round ran (a fault): its next plan is this one's again
                row.estimate.plain_rounds = plain_rounds
        for row in list(self._running):
            if row.cancelled or row.done:
                self._retire(row)
        if planner is not None and live:
            # what every step costs besides its rounds (the plan, bookkeeping): the planner weighs it
            planner.learn_step(len(live), time.perf_counter() - t0 - prefill_s - rounds_s)

    # -- fault isolation ---------------------------------------------------------------------
    def _prefill(self, rows: list[Row]) -> None:
        """`prefill` (which also draws each row's first token), isolating faults: the forwards only
        write each row's own slot and set its lengths, so a row that has not advanced (drawn its
        first token) can be prefilled again alone, at once."""
        self._isolating(rows, lambda group: prefill(self.models, group), redo_unadvanced=True)

    def _round(self, rows: list[Row], n: int, predicted: tuple[float, float] | None = None) -> float | None:
        """`run_round`, isolating faults (module doc); `predicted`: the planner's (live, profile)
        seconds for this round, compared with the measured time when the round succeeds. Rows
        that had not advanced when a row raised in `advance` run their round next step. Returns
        the round's seconds (None after a fault)."""
        seconds = self._isolating(rows, lambda group: _run(self.models, group, n, self.timers))
        if seconds is not None and predicted is not None:
            self.timers.record_prediction(seconds, *predicted)
        return seconds

    def _isolating(self, rows: list[Row], run, redo_unadvanced: bool = False):
        """`run(rows)`; its result, or None after a fault, with only the rows that cause it failed.

        `run` changes a row's state only in `advance` (row by row, in order; `row.rounds` marks a
        row that advanced) apart from drawing its coins, which are put back from a snapshot of each
        row's generator. If some rows had advanced, the last of them raised; the others are re-run
        alone now when `redo_unadvanced`, else left for the caller's next call. Otherwise every
        row is re-run alone: the ones that raise alone are failed, the others get exactly the
        tokens they would have got (a row's draws depend only on its own stream)."""
        marks = [(row.rounds, row.generator.get_state()) for row in rows]
        try:
            return run(rows)
        except Exception as exc:
            error = exc

        def put_back(row: Row, mark: tuple) -> bool:
            """Restore the coins of a row that has not advanced; whether it had not."""
            if row.rounds != mark[0]:
                return False
            row.generator.set_state(mark[1])  # as if the call had not drawn its coins
            if row.grammar is not None:  # ... nor its matcher taken the round's drafts
                row.grammar.settle(0, None)
            return True

        waiting = [(row, mark) for row, mark in zip(rows, marks, strict=True) if put_back(row, mark)]
        advanced = [row for row, mark in zip(rows, marks, strict=True) if row.rounds != mark[0]]
        if advanced:  # `advance` raised on the last row it reached
            rest = len(waiting) if redo_unadvanced else 0
            self._isolated([(advanced[-1], error)], survivors=len(advanced) - 1 + rest)
            if not redo_unadvanced:
                return None
        elif len(rows) == 1:
            self._isolated([(rows[0], error)], survivors=0)
            return None
        failed = []
        for row, mark in waiting:
            try:
                run([row])
            except Exception as exc:
                put_back(row, mark)
                failed.append((row, exc))
        self._isolated(failed, survivors=len(rows) - len(failed))
        return None

    def _isolated(self, failed: list[tuple[Row, Exception]], survivors: int) -> None:
        """Fail the rows that raised; if none of the suspects got through, check the engine."""
        for row, exc in failed:
            log.error(
                "request %s faulted the engine (%s); failing it alone",
                row.request.request_id,
                type(exc).__name__,
                exc_info=exc,
            )
            self.faults += 1
            row.fail(
                EngineError(
                    f"the engine failed on this request ({type(exc).__name__}); other requests "
                    "are unaffected",
                    "internal",
                )
            )
            self._retire(row)
        if failed and not survivors:
            self._check_engine()

    def _check_engine(self) -> None:
        """Run the probe row; raises (so the loop declares a fault) if the engine cannot serve it."""
        if self.probe is None:
            return
        with self._cv:
            if not self._free:
                return
            slot = self._free.pop(0)
        row = self.probe()
        row.slot = slot
        try:
            prefill(self.models, [row])
            if not row.done:
                run_round(self.models, [row], row.num_draft, self.timers)
        finally:
            row.slot = -1
            with self._cv:
                self._free.append(slot)
                self._free.sort()


def _run(models: Models, rows: list[Row], n: int, timers: StepTimers) -> float:
    """One round of a group: the draft alone for quality-0 rows (`draft_only.py`), else speculative."""
    runner = run_draft_only_round if rows[0].mode.draft_only else run_round
    return runner(models, rows, n, timers)
