"""Wall-clock accounting of decoding rounds: per-phase sums (the benchmark's inputs), the last
round's phase times (the cost model's online observations), and how well the cost model predicted
each round."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

# phase name -> the counter it bumps (besides `<phase>_s`)
_COUNTERS = {
    "draft": "draft_forwards",
    "bonus": "bonus_steps",
    "verify_forward": "verify_forwards",
    "target_forward": "target_forwards",
    "round": "rounds",
    "prefill": "prefills",
    "plan": "plans",
}


@dataclass
class StepTimers:
    """Seconds per phase summed over rounds, and the cost model's prediction errors."""

    draft_s: float = 0.0  # N draft forwards with their sampling
    draft_forwards: int = 0
    bonus_s: float = 0.0  # draft steps for q at the bonus position (rows with w < 1)
    bonus_steps: int = 0
    verify_forward_s: float = 0.0  # target forwards over N+1 positions (N >= 1), with p
    verify_forwards: int = 0
    target_forward_s: float = 0.0  # target forwards over 1 position (N = 0 rounds), with p
    target_forwards: int = 0
    verify_call_s: float = 0.0  # weights (head), verifier.verify, reading the results back
    round_s: float = 0.0
    rounds: int = 0
    prefill_s: float = 0.0  # prompt prefills (outside rounds: the cost model does not predict them)
    prefills: int = 0
    plan_s: float = 0.0  # the draft-length planner's decisions, once per step (outside rounds)
    plans: int = 0
    grammar_s: float = 0.0  # `response_format` masks (inside the phases above; `grammar.py`)
    grammar_masks: int = 0  # masks computed (one per constrained row and position)
    draft_tokens: int = 0  # Σ N over rounds and rows (mean N = draft_tokens / row_rounds)
    row_rounds: int = 0  # Σ rows over rounds
    # Predictions made before each round (scheduler): the live cost model, and the start-up
    # profile alone; Σ|predicted − measured| over the rounds that had a prediction.
    predicted_rounds: int = 0
    predicted_round_s: float = 0.0
    measured_predicted_round_s: float = 0.0
    abs_error_s: float = 0.0
    profile_predicted_round_s: float = 0.0
    profile_abs_error_s: float = 0.0
    last: dict = field(default_factory=dict, repr=False)  # the last round's phase -> seconds

    def reset(self) -> None:
        self.__init__()

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device, count: int = 1):
        """Time a phase; on CUDA the device is synchronised first so kernels count where they run."""
        last = self.last
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        last[name] = dt
        setattr(self, f"{name}_s", getattr(self, f"{name}_s") + dt)
        if name in _COUNTERS:
            setattr(self, _COUNTERS[name], getattr(self, _COUNTERS[name]) + count)

    def record_prediction(self, measured: float, predicted: float, profile_predicted: float) -> None:
        self.predicted_rounds += 1
        self.measured_predicted_round_s += measured
        self.predicted_round_s += predicted
        self.abs_error_s += abs(predicted - measured)
        self.profile_predicted_round_s += profile_predicted
        self.profile_abs_error_s += abs(profile_predicted - measured)

    def snapshot(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "last"}
