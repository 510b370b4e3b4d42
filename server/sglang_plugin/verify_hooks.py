"""Runtime hooks on SGLang 0.5.23's speculative verify step (scheduler process, GPU).

One verify step of a batch of B requests with N drafts each:

    EagleDraftWorker.draft(batch)                                       [hooked: AROUND]
        all-greedy batch with some row w < 1: runs with `is_all_greedy = False` so the draft
        builds q (stock skips it and replays the greedy graph); otherwise stock
    run_eagle_verify -> eagle_sample(verify_input, batch, logits_output, grammar_mask, ...)   [AROUND]
        every row w = 1 (decided on the host, below): the stock call, nothing else
        else: publishes this step (weights, greedy rows, the logits SGLang is about to penalise
        and mask in place), and for an all-greedy batch sets `is_all_greedy = False` so SGLang
        takes its rejection-sampling branch; SGLang then adds penalties, logit_bias and the
        grammar mask to the logits, builds p (softmax / top-k / top-p) and calls
      -> chain_speculative_sampling_triton(target_probs=p, draft_probs=q, ...)   [AROUND]
        p[:, :N] := ν̃ in place (ensemble.nu_into_target_probs_), then the stock kernel
    after eagle_sample, return_logprob only: draft slots with w < 1 := T·log ν̃, so SGLang's
        compute_spec_logprobs reports log ν̃ there (docs/sglang.md)

No host-device synchronisation on this path: whether a batch is all w = 1, which rows are
greedy, and each row's w come from `batch.reqs[i].sampling_params` (host objects SGLang already
holds), computed once per batch composition (`StepPlanner`) and uploaded with one pinned,
non-blocking copy when the composition changes; every per-step operation is a device op whose
sequence depends only on shapes and those host facts (tests/test_sglang_hot_path.py watches).

The hooks talk through a thread-local because the kernel call sits inside eagle_sample and
receives no batch; a scheduler runs one verify at a time per thread.

Nothing here imports SGLang at module import; hooks run only inside SGLang's processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from server.sglang_plugin.ensemble import nu_into_target_probs_, nu_logprob_logits_
from server.sglang_plugin.params import PluginSettings, RowParams, batch_row_params

logger = logging.getLogger(__name__)

EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
CHAIN_KERNEL = "sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton"
DRAFT = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft"

TOP_K_ALL = 1 << 30  # SGLang's "no top-k"
_step = threading.local()  # .ctx: the VerifyStep of the eagle_sample call in flight, else None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A per-step condition must not flood the scheduler log."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _is_standalone() -> bool:
    from sglang.srt.runtime_context import get_spec

    return get_spec().speculative_algorithm == "STANDALONE"


def upload(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    """Host values -> a `[len(rows), B]` float32 tensor on `device`, as SGLang builds its own
    per-batch tensors: pinned host memory and a non-blocking copy, so the CPU never waits."""
    host = torch.tensor(rows, dtype=torch.float32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass
class BatchPlan:
    """What the verify step needs from a batch's requests, on the host and (once) on a device."""

    rows: list[RowParams]
    greedy: list[bool]  # SGLang's greedy: top_k == 1 (temperature 0 is rewritten to that)
    has_head: bool
    _device: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    @property
    def learned(self) -> list[bool]:
        return [r.learned and self.has_head for r in self.rows]

    @property
    def stock(self) -> bool:
        """Every row verifies at w = 1 (no learned row that could lower it): SGLang unchanged."""
        return all(r.weight >= 1.0 for r in self.rows) and not any(self.learned)

    @property
    def any_greedy(self) -> bool:
        return any(self.greedy)

    def on(self, device: torch.device) -> torch.Tensor:
        """`[4, B]` float32 on `device`: static w, greedy, learned, dial. Uploaded once."""
        if device not in self._device:
            dial = [r.dial if r.dial is not None else r.weight for r in self.rows]
            host = [[r.weight for r in self.rows], self.greedy, self.learned, dial]
            self._device[device] = upload(host, device)
        return self._device[device]


class StepPlanner:
    """Builds `BatchPlan`s from `batch.reqs`, keeping the last one while the batch's requests
    stay the same (a request's w, dial and greediness never change during its life)."""

    def __init__(self, settings: PluginSettings, head=None):
        self.settings, self.head = settings, head
        self._key: tuple | None = None
        self._plan: BatchPlan | None = None

    def plan(self, reqs: Sequence[Any]) -> BatchPlan:
        key = tuple((getattr(req, "rid", None), id(req)) for req in reqs)  # rids are unique per request
        if key != self._key or self._plan is None:
            rows = batch_row_params(reqs, self.settings.default_w)
            greedy = [getattr(req.sampling_params, "top_k", TOP_K_ALL) <= 1 for req in reqs]  # as SGLang
            self._key, self._plan = key, BatchPlan(rows, greedy, has_head=self.head is not None)
        return self._plan

    def weights(self, batch: Any, plan: BatchPlan, device: torch.device, num_draft: int) -> torch.Tensor:
        """`[B, N]` w on `device`: static per row, or the learned head's per token where it has
        states for a learned row (others keep their static w)."""
        packed = plan.on(device)  # [4, B]
        static = packed[0].unsqueeze(1).expand(-1, num_draft)  # [B, N]
        if not any(plan.learned):
            return static
        head = self.head
        try:
            w_t, ok = head.weights([req.rid for req in batch.reqs], packed[3], num_draft)  # [B, N], host
        except Exception as exc:  # a failing head costs quality control, never the batch
            head.log.warn("head", f"dialspec learned head failed ({exc!r}); using the requests' static w")
            return static
        if any(learned and not good for learned, good in zip(plan.learned, ok, strict=True)):
            head.log.warn("states", "dialspec learned head: no aligned states for some rows; static w used")
        use = (packed[2] > 0.5) & head_rows_ok(ok, device)  # [B]
        return torch.where(use.unsqueeze(1), w_t, static)


_BOOLS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def head_rows_ok(ok: Sequence[bool], device: torch.device) -> torch.Tensor:
    """`[B]` bool on `device` from a host list without a copy per step: a stack of two device
    scalars made once per device (the head's row set changes every step)."""
    if device not in _BOOLS:
        _BOOLS[device] = (torch.zeros((), dtype=torch.bool, device=device),
                          torch.ones((), dtype=torch.bool, device=device))  # fmt: skip
    false, true = _BOOLS[device]
    return torch.stack([true if good else false for good in ok])


def row_weights(batch: Any, settings: PluginSettings, device: torch.device, num_draft: int, head=None):
    """`[B, N]` weights for one batch (a fresh planner: for tests and one-off callers)."""
    planner = StepPlanner(settings, head)
    return planner.weights(batch, planner.plan(batch.reqs), device, num_draft)


@dataclass
class VerifyStep:
    """What the kernel hook needs from the eagle_sample call in flight."""

    weights: torch.Tensor  # [B, N]
    greedy: torch.Tensor  # [B] bool
    any_greedy: bool
    logits: torch.Tensor | None  # [B·(N+1), V], penalised and masked in place by SGLang; None: no mask
    bias: torch.Tensor | None  # [B, V] sampling_info.logit_bias


def _original_logprobs_requested() -> bool:
    """SGLANG_RETURN_ORIGINAL_LOGPROB: the operator asked for the target's raw log-probs."""
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get())


def make_eagle_sample_hook(
    settings: PluginSettings, head=None, planner: StepPlanner | None = None
) -> Callable:
    """AROUND hook for `eagle_sample(verify_input, batch, logits_output, ...)` (module doc)."""
    planner = planner or StepPlanner(settings, head)

    def eagle_sample_around(original_fn, verify_input, batch, logits_output, *args, **kwargs):
        if batch.forward_mode.is_idle() or not _is_standalone():
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        plan = planner.plan(batch.reqs)
        q = verify_input.draft_probs  # [B, N, V] or None
        if plan.stock:
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        if q is None:  # only if the draft ran without our draft hook
            _warn_once("dialspec: no draft probs in this verify step; verifying it losslessly (w = 1)")
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        n = verify_input.draft_token_num - 1
        logits = logits_output.next_token_logits  # [B*(N+1), V]
        info = batch.sampling_info
        w = planner.weights(batch, plan, logits.device, n)  # [B, N]
        greedy = plan.on(logits.device)[1] > 0.5  # [B]
        bias = getattr(info, "logit_bias", None)
        _step.ctx = VerifyStep(w, greedy, plan.any_greedy, logits, bias)
        all_greedy = info.is_all_greedy
        info.is_all_greedy = False  # greedy rows need the chain kernel (argmax ν̃ needs q)
        try:
            result = original_fn(verify_input, batch, logits_output, *args, **kwargs)
        finally:
            _step.ctx = None
            info.is_all_greedy = all_greedy
        if getattr(batch, "return_logprob", False) and not _original_logprobs_requested():
            b = w.shape[0]
            temps = info.temperatures.reshape(b)  # [B]; greedy rows have T = 1
            nu_logprob_logits_(logits.view(b, n + 1, -1), q, w, temps, bias=bias)
        return result

    return eagle_sample_around


def chain_kernel_around(original_fn, *args, **kwargs):
    """Write ν̃ over p at draft slots (in place) when eagle_sample's hook published a step."""
    step = getattr(_step, "ctx", None)
    target, draft = kwargs.get("target_probs"), kwargs.get("draft_probs")
    if step is not None and target is not None and draft is not None:
        b, n1, v = target.shape
        nu_into_target_probs_(
            target, draft, step.weights, bias=step.bias,
            logits=None if step.logits is None else step.logits.view(b, n1, v),
            greedy=step.greedy, any_greedy=step.any_greedy,
        )  # fmt: skip
    return original_fn(*args, **kwargs)


def make_draft_hook(settings: PluginSettings, head=None, planner: StepPlanner | None = None) -> Callable:
    """AROUND hook for `EagleDraftWorker.draft(batch, ...)`: an all-greedy batch with some row
    w < 1 drafts as a sampled batch, so q exists (greedy rows still propose argmax q:
    `sample_draft_proposal` honours top_k == 1 per row) and the draft CUDA graph replayed is the
    one that builds q. All-w = 1 batches keep the stock greedy path and graph."""
    planner = planner or StepPlanner(settings, head)

    def draft_around(original_fn, worker, batch, *args, **kwargs):
        info = getattr(batch, "sampling_info", None)
        if info is None or not info.is_all_greedy or batch.forward_mode.is_idle() or not _is_standalone():
            return original_fn(worker, batch, *args, **kwargs)
        if planner.plan(batch.reqs).stock:
            return original_fn(worker, batch, *args, **kwargs)
        info.is_all_greedy = False
        try:
            return original_fn(worker, batch, *args, **kwargs)
        finally:
            info.is_all_greedy = True

    return draft_around
