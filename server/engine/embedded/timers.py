"""Wall-clock sums of a decoding step's stages (`planner.cost_model.Stage`: the round times them
under the names the cost model prices them by), and how well the cost model predicted each round;
`bench engine` reads them."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from server.engine.embedded.planner.cost_model import Stage


@dataclass
class StepTimers:
    """Seconds and counts per stage summed over rounds; the cost model's prediction errors."""

    seconds: dict = field(default_factory=dict)  # Stage -> seconds
    counts: dict = field(default_factory=dict)  # Stage -> forwards (draft steps count one each)
    drafted: dict = field(default_factory=dict)  # Stage -> seconds, in rounds with N >= 1 only
    drafted_rounds: int = 0
    grammar_s: float = 0.0  # `response_format` masks (inside the stages above; `grammar.py`)
    grammar_masks: int = 0  # masks computed (one per constrained row and position)
    draft_tokens: int = 0  # Σ N over rounds and rows (mean N = draft_tokens / row_rounds)
    row_rounds: int = 0  # Σ rows over rounds
    # Predictions made before each round (scheduler): the live cost model, and the start-up
    # profile alone; Σ|predicted − measured| over the rounds that had a prediction.
    predicted_rounds: int = 0
    predicted_round_s: float = 0.0
    measured_predicted_round_s: float = 0.0
    abs_error_s: float = 0.0
    profile_abs_error_s: float = 0.0
    last: dict = field(default_factory=dict, repr=False)  # the last round's Stage -> seconds

    def reset(self) -> None:
        self.__init__()

    @property
    def rounds(self) -> int:
        return self.counts.get(Stage.ROUND, 0)

    @contextlib.contextmanager
    def phase(self, stage: Stage, device: torch.device, count: int = 1, drafted: bool = False):
        """Time a stage; on CUDA the device is synchronised first so kernels count where they run."""
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        self.last[stage] = dt
        self.seconds[stage] = self.seconds.get(stage, 0.0) + dt
        self.counts[stage] = self.counts.get(stage, 0) + count
        if drafted:
            self.drafted[stage] = self.drafted.get(stage, 0.0) + dt
            self.drafted_rounds += stage == Stage.ROUND

    def record_prediction(self, measured: float, predicted: float, profile_predicted: float) -> None:
        self.predicted_rounds += 1
        self.measured_predicted_round_s += measured
        self.predicted_round_s += predicted
        self.abs_error_s += abs(predicted - measured)
        self.profile_abs_error_s += abs(profile_predicted - measured)

    def snapshot(self) -> dict:
        """Flat: `<stage>_s`, `<stage>_count`, `drafted_<stage>_s` and the scalar fields."""
        out = {k: v for k, v in vars(self).items() if not isinstance(v, dict)}
        for stage in Stage:
            out[f"{stage}_s"] = self.seconds.get(stage, 0.0)
            out[f"{stage}_count"] = self.counts.get(stage, 0)
            out[f"drafted_{stage}_s"] = self.drafted.get(stage, 0.0)
        return out
