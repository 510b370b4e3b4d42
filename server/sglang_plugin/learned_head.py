"""Learned-head mode: capture final-norm states of target and draft inside SGLang, predict w per token.

Terms (shapes)
    B         requests in a verify batch (`batch.reqs` order); N draft length.
    rid       a request's id (`Req.rid`, `ForwardBatch.rids`): the key that survives batch changes.
    h_target  `[B, N, Ht]` target final-norm states at the verify slots that score drafts 1..N.
    h_draft   `[B, N, Hd]` draft final-norm states at the positions that produced drafts 1..N.
    dial      `[B]` each request's static w, handed to the head as its quality-dial input.
    head      callable `(h_draft, h_target, dial) -> w [B, N]` in [0, 1] (the DIVERSED head,
              `verifier.head.WeightHead`; loaded from DIALSPEC_HEAD_PATH in the runtime).

How states are found (see `hidden_layout` for SGLang 0.5.23's flat layouts):
  * `make_load_model_hook` (AFTER `ModelRunner.load_model`) puts a forward hook on each model's
    final norm (`model.model.norm`, which sees exactly the LM-head inputs; SGLang's own
    hidden-state capture is off for STANDALONE).
  * `make_forward_hook` (AROUND `ModelRunner.forward`) reads what that norm produced during this
    forward and files it by request id: draft forwards into `DraftChains`, the target's
    TARGET_VERIFY forward as the current verify states.
  * the verify hook calls `LearnedHead.weights(rids, dial, N)`, which returns w for the batch and
    which rows it could align (a host list); the caller keeps the static w for the others.

Python forward hooks do not run when a CUDA graph is replayed, so the argument hook requires all
CUDA graphs off with a head (`--disable-cuda-graph`); a forward that captured nothing anyway
invalidates the requests it carried instead of misaligning them. Nothing here may raise into
SGLang's scheduler: failures degrade to the static w with a rate-limited warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from server.sglang_plugin.hidden_layout import DraftChains, draft_rows, verify_rows

logger = logging.getLogger(__name__)

Head = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RateLimitedLog:
    """Warn at most once per `period` seconds per key, counting what was held back."""

    def __init__(self, period: float = 60.0):
        self.period = period
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.period) >= self.period:
            held = self._held.pop(key, 0)
            logger.warning("%s%s", message, f" ({held} similar messages held back)" if held else "")
            self._last[key] = now
        else:
            self._held[key] = self._held.get(key, 0) + 1


def find_final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a decoder: `model.norm` (Llama/Qwen/Mistral layout, HF and SGLang)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(model).__name__} has no `.model.norm`; learned-head capture needs one")
    return norm


class HiddenCapture:
    """Keeps the output of a module's most recent forward (`[T, H]` in SGLang, `[B, T, H]` in HF)."""

    def __init__(self, module: nn.Module):
        self.last: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output  # SGLang's fused add-norm: (out, res)
        self.last = out.detach()

    def remove(self) -> None:
        self._handle.remove()


def run_head(head: Head, h_draft: torch.Tensor, h_target: torch.Tensor, dial: torch.Tensor) -> torch.Tensor:
    """Call the head and check its contract; returns `[B, N]` float32 clamped to [0, 1]."""
    r, n = h_target.shape[:2]
    if tuple(h_draft.shape[:2]) != (r, n) or tuple(dial.shape) != (r,):
        raise ValueError(
            f"head inputs disagree: h_draft {tuple(h_draft.shape)}, h_target {tuple(h_target.shape)}, "
            f"dial {tuple(dial.shape)}"
        )
    with torch.no_grad():
        w = head(h_draft.float(), h_target.float(), dial.float())
    if tuple(w.shape) != (r, n):
        raise ValueError(f"head must return [B, N]={(r, n)}, got {tuple(w.shape)}")
    return torch.nan_to_num(w.float(), nan=1.0).clamp(0.0, 1.0)  # NaN -> lossless


class LearnedHead:
    """Ties the target/draft captures and the per-request draft chains to a head."""

    def __init__(self, head: Head, max_age: int = 16):
        self.head = head
        self.target: HiddenCapture | None = None
        self.draft: HiddenCapture | None = None
        self.chains = DraftChains(max_age=max_age)
        self.verify_states: torch.Tensor | None = None  # [B·(N+1) (+pad), Ht] of the last verify
        self.verify_rids: list[str] = []
        self.log = RateLimitedLog()

    def attach(self, model: nn.Module, is_draft: bool) -> None:
        capture = HiddenCapture(find_final_norm(model))
        if is_draft:
            self.draft = capture
        else:
            self.target = capture

    # -- called around every ModelRunner.forward --------------------------------------------

    def before_forward(self, is_draft: bool) -> None:
        capture = self.draft if is_draft else self.target
        if capture is not None:
            capture.last = None  # whatever the norm produces next belongs to this forward

    def after_forward(self, is_draft: bool, forward_batch: Any) -> None:
        """File this forward's norm output by request id. Never raises."""
        rids = list(getattr(forward_batch, "rids", None) or [])
        try:
            self._observe(is_draft, forward_batch, rids)
        except Exception as exc:  # misalignment must degrade to static w, not kill the scheduler
            self.chains.invalidate(rids)
            self.log.warn("observe", f"dialspec learned head: could not file hidden states ({exc!r})")

    def _observe(self, is_draft: bool, forward_batch: Any, rids: list[str]) -> None:
        mode = getattr(forward_batch.forward_mode, "name", "")
        capture = self.draft if is_draft else self.target
        states = capture.last if capture is not None else None
        if not is_draft:
            if mode == "TARGET_VERIFY":
                self.chains.advance()
                self.verify_states, self.verify_rids = states, rids
            return
        layout = draft_rows(forward_batch)
        if layout is None:
            return
        if states is None:  # a CUDA-graph replay, or a model whose norm was bypassed
            self.chains.invalidate(rids)
            self.log.warn("graph", "dialspec learned head: a draft forward captured no states (CUDA graph?)")
            return
        kind, rows = layout
        self.chains.record(kind, rids, states.reshape(-1, states.shape[-1]), rows)

    # -- called by the verify hook ------------------------------------------------------------

    def weights(self, rids: Sequence[str], dial: torch.Tensor, n: int) -> tuple[torch.Tensor, list[bool]]:
        """`(w [B, N] on dial's device, ok [B] host bools)` for this verify step's requests; rows
        with ok False carry no usable states (their w is meaningless). Raises only on head errors.

        Which rows are usable is known on the host (request ids, chain lengths); the device work
        is a fixed sequence over all B rows (rows without states get zero states), so nothing is
        read back and no index list is copied to the device."""
        b = len(rids)
        ok = [False] * b
        w = torch.ones(b, n, dtype=torch.float32, device=dial.device)
        states = self.verify_states
        if states is None or list(rids) != self.verify_rids:
            return w, ok
        flat = states.reshape(-1, states.shape[-1])  # [B·(N+1) (+pad), Ht]
        if flat.shape[0] < b * (n + 1):
            return w, ok
        chains, ok = self.chains.take(rids, n)
        if not any(ok):
            return w, ok
        some = next(c for c in chains if c is not None)  # [N, Hd]
        h_d = torch.stack([c if c is not None else torch.zeros_like(some) for c in chains])  # [B, N, Hd]
        h_t = flat[verify_rows(b, n, flat.device)]  # [B, N, Ht]
        w = run_head(self.head, h_d.to(h_t.device), h_t, dial.to(h_t.device)).to(dial.device)
        return w, ok


def load_head(path: str) -> Head:
    """The head at `path`: a `server.engine.head_store.save_head` directory (head.json + head.safetensors,
    the format `dialspec train` writes), or else a TorchScript file (`torch.jit.save`) for heads
    built outside dialspec. Pair checks are the caller's: the runtime knows no pair name."""
    from pathlib import Path

    if Path(path).is_dir():
        from server.engine.head_store import load_head as load_weight_head
        from verifier.head import wants_stats

        head = load_weight_head(path)
        if wants_stats(head):  # refused at startup, not served with the statistics missing
            raise ValueError(
                f"the head at {path} reads position statistics (inputs={head.config.inputs!r}); the "
                "SGLang plugin hands heads hidden states only: train one with --set head_inputs=states"
            )
        return head
    head = torch.jit.load(path, map_location="cpu")
    head.eval()
    return head


def make_load_model_hook(learned: LearnedHead) -> Callable:
    """AFTER hook for `ModelRunner.load_model`: attach the capture to the model just loaded."""

    def after_load_model(result, runner, *args, **kwargs):
        learned.attach(runner.model, is_draft=bool(getattr(runner, "is_draft_worker", False)))
        head, param = learned.head, next(runner.model.parameters(), None)
        if isinstance(head, nn.Module) and param is not None:
            learned.head = head.to(param.device)
        return result

    return after_load_model


def make_forward_hook(learned: LearnedHead) -> Callable:
    """AROUND hook for `ModelRunner.forward(forward_batch, ...)`: file the states it produced."""

    def forward_around(original_fn, runner, forward_batch, *args, **kwargs):
        is_draft = bool(getattr(runner, "is_draft_worker", False))
        learned.before_forward(is_draft)
        out = original_fn(runner, forward_batch, *args, **kwargs)
        learned.after_forward(is_draft, forward_batch)
        return out

    return forward_around
