"""Learned-head mode: capture final-norm hidden states of target and draft, predict per-token w.

Terms (shapes)
    R         rows (requests) in a verify batch; N draft length.
    h_target  `[R, N, Ht]` target final-norm states at the slots that score draft tokens 1..N
              (verify forward rows `r*(N+1) + i`, i < N).
    h_draft   `[R, N, Hd]` draft final-norm states at the positions that produced drafts 1..N.
    dial      `[R]` the request's static w, handed to the head as its quality-dial input.
    head      callable `(h_draft, h_target, dial) -> w [R, N]` in [0, 1] (the DIVERSED head,
              `verifier.head.WeightHead`; loaded from DIALSPEC_HEAD_PATH in the runtime).

Capture uses forward hooks on the final norm module (`model.norm` in Llama-style models, HF or
SGLang), which sees exactly the LM-head inputs; SGLang's own hidden-state capture is off for
STANDALONE, and forcing it would change CUDA-graph shapes.

Draft alignment: draft 1 is produced by the draft's extend pass after the previous verify, draft
i > 1 by draft decode step i−1. `DraftStates` keeps the last row per request of each draft
forward since the last verify and takes the most recent N. This alignment is the part least
covered: it is unit-tested on CPU against an HF model but has not run inside SGLang on a GPU
(see docs/sglang.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import nn

Head = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def find_final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a decoder: `model.norm` (Llama/Qwen/Mistral layout, HF and SGLang)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(model).__name__} has no `.model.norm`; learned-head capture needs one")
    return norm


class HiddenCapture:
    """Keeps the output of a module's most recent forward (`[T, H]` or `[B, T, H]`)."""

    def __init__(self, module: nn.Module):
        self.last: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        self.last = out.detach()
        self.on_capture(self.last)

    def on_capture(self, states: torch.Tensor) -> None:  # subclasses record history
        pass

    def remove(self) -> None:
        self._handle.remove()


class DraftStates(HiddenCapture):
    """Draft-side capture: the last-position state per request of each recent draft forward."""

    def __init__(self, module: nn.Module, max_steps: int):
        super().__init__(module)
        self.steps: deque[torch.Tensor] = deque(maxlen=max_steps)  # each [R, Hd]

    def on_capture(self, states: torch.Tensor) -> None:
        last = states[:, -1] if states.dim() == 3 else states  # [R, Hd] (flat: one row/request)
        self.steps.append(last)

    def take(self, rows: int, n: int) -> torch.Tensor:
        """`[R, N, Hd]` from the N most recent forwards (oldest first); rows beyond R are padding."""
        if len(self.steps) < n:
            raise RuntimeError(f"learned head: {len(self.steps)} draft states captured, need {n}")
        return torch.stack([s[:rows] for s in list(self.steps)[-n:]], dim=1)


def target_states(verify_states: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """`[R, N, Ht]` from the verify forward's flat `[R*(N+1) (+pad), Ht]` final-norm output."""
    flat = verify_states.reshape(-1, verify_states.shape[-1])[: rows * (n + 1)]
    return flat.view(rows, n + 1, -1)[:, :n]


def run_head(head: Head, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor) -> torch.Tensor:
    """Call the head and check its contract; returns `[R, N]` float32 clamped to [0, 1]."""
    r, n = h_target.shape[:2]
    if tuple(h_draft.shape[:2]) != (r, n) or tuple(dial.shape) != (r,):
        raise ValueError(
            f"head inputs disagree: h_draft {tuple(h_draft.shape)}, h_target {tuple(h_target.shape)}, "
            f"dial {tuple(dial.shape)}"
        )
    with torch.no_grad():
        w = head(h_draft.float(), h_target.float(), dial.float())
    if tuple(w.shape) != (r, n):
        raise ValueError(f"head must return [R, N]={(r, n)}, got {tuple(w.shape)}")
    return torch.nan_to_num(w.float(), nan=1.0).clamp(0.0, 1.0)  # NaN -> lossless, never a crash


class LearnedHead:
    """Ties target and draft captures to a head; `weights(dial)` is what verify_hooks calls."""

    # More draft forwards than any sane N; only the most recent N are read.
    MAX_DRAFT_STEPS = 64

    def __init__(self, head: Head):
        self.head = head
        self.target: HiddenCapture | None = None
        self.draft: DraftStates | None = None

    def attach(self, model: nn.Module, is_draft: bool) -> None:
        norm = find_final_norm(model)
        if is_draft:
            self.draft = DraftStates(norm, max_steps=self.MAX_DRAFT_STEPS)
        else:
            self.target = HiddenCapture(norm)

    def weights(self, dial: torch.Tensor, num_draft: int) -> torch.Tensor:
        """`[R, N]` per-token w for the current verify step; `dial` is `[R]`."""
        if self.target is None or self.draft is None or self.target.last is None:
            raise RuntimeError("learned head: target/draft capture not attached or empty")
        rows, n = dial.shape[0], num_draft
        h_t = target_states(self.target.last, rows, n)  # [R, N, Ht]
        h_d = self.draft.take(rows, n).to(h_t.device)  # [R, N, Hd]
        return run_head(self.head, h_d, h_t, dial.to(h_t.device))


def load_head(path: str) -> Head:
    """The head at `path`: a `server.engine.head_store.save_head` directory (head.json + head.safetensors,
    the format `dialspec train` writes), or else a TorchScript file (`torch.jit.save`) for heads
    built outside dialspec. Pair checks are the caller's: the runtime knows no pair name."""
    from pathlib import Path

    if Path(path).is_dir():
        from server.engine.head_store import load_head as load_weight_head

        return load_weight_head(path)
    head = torch.jit.load(path, map_location="cpu")
    head.eval()
    return head


def make_load_model_hook(learned: LearnedHead) -> Callable:
    """AFTER hook for `ModelRunner.load_model`: attach the capture to the model just loaded."""

    def after_load_model(result, runner, *args, **kwargs):
        learned.attach(runner.model, is_draft=bool(getattr(runner, "is_draft_worker", False)))
        head = learned.head
        if isinstance(head, nn.Module):
            learned.head = head.to(next(runner.model.parameters()).device)
        return result

    return after_load_model
