"""Runtime hooks on SGLang 0.5.23's speculative verify step (scheduler process, GPU).

Data flow for one verify step of a batch of B requests with N drafts each:

    run_eagle_verify -> eagle_sample(verify_input, batch, logits_output, ...)   [hooked: AROUND]
        reads batch.reqs[i].sampling_params.custom_params -> w [B] (or [B, N] from the head)
        greedy rows (top_k == 1): target logits at draft slots := log ν   (in place)
        publishes the kernel weights for this step (greedy rows: 1, already handled)
      -> chain_speculative_sampling_triton(target_probs=..., draft_probs=..., ...)   [AROUND]
        target_probs[:, :N] := ν = w·p + (1−w)·q   (see ensemble.py), then the stock kernel
    after eagle_sample, return_logprob only: sampled rows' draft slots := T·log ν, so SGLang's
        compute_spec_logprobs reports log ν there as it does for greedy rows (docs/sglang.md)

The two hooks talk through a thread-local because the kernel call sits inside eagle_sample and
receives no batch; a scheduler runs one verify at a time per thread.

All-greedy batches: stock SGLang skips building q for them (`EagleDraftWorker.draft_forward` and
the draft CUDA graph's greedy variant), but argmax ν needs q. Two more hooks keep q: the draft
forward sees `is_all_greedy = False` (greedy rows still propose their argmax, because
`sample_draft_proposal` honours top_k == 1 per row) and the draft graph runner replays the
non-greedy variant.

Nothing here imports SGLang at module import; hooks run only inside SGLang's processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from server.sglang_plugin.ensemble import _LOG_FLOOR, greedy_nu_logits, mix_target_probs
from server.sglang_plugin.params import PluginSettings, batch_row_params

logger = logging.getLogger(__name__)

EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
CHAIN_KERNEL = "sglang.kernels.ops.speculative.reject_sampling.chain_speculative_sampling_triton"
DRAFT_FORWARD = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft_forward"
GRAPH_VARIANT = (
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner._sampling_variant"
)

_step = threading.local()  # .weights: [B] or [B, N] tensor for the kernel hook, else None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """A per-step condition must not flood the scheduler log."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _is_standalone() -> bool:
    from sglang.srt.runtime_context import get_spec

    return get_spec().speculative_algorithm == "STANDALONE"


def row_weights(
    batch: Any, settings: PluginSettings, device: torch.device, num_draft: int, head=None
) -> torch.Tensor:
    """`[B]` static weights from the batch's requests, or `[B, N]` when a learned head is on and
    some row asked for it. Rows that did not ask, and rows the head cannot serve this step
    (states missing or misaligned, or the head failed), keep their static w."""
    params = batch_row_params(batch.reqs, settings.default_w)
    static = torch.tensor([p.weight for p in params], dtype=torch.float32, device=device)  # [B]
    if head is None or not any(p.learned for p in params):
        return static
    learned_rows = torch.tensor([p.learned for p in params], device=device)  # [B]
    dial = torch.tensor([p.dial if p.learned else p.weight for p in params], device=device)  # [B]
    rids = [req.rid for req in batch.reqs]
    try:
        w_t, ok = head.weights(rids, dial, num_draft)  # [B, N], [B]
    except Exception as exc:  # a failing head costs quality control, never the batch
        head.log.warn("head", f"dialspec learned head failed ({exc!r}); using the requests' static w")
        return static
    use = learned_rows & ok.to(device)  # [B]
    if bool((learned_rows & ~use).any()):
        head.log.warn("states", "dialspec learned head: no aligned states for some rows; static w used")
    return torch.where(use.unsqueeze(1), w_t.to(device), static.unsqueeze(1).expand(-1, num_draft))


def _original_logprobs_requested() -> bool:
    """SGLANG_RETURN_ORIGINAL_LOGPROB: the operator asked for the target's raw log-probs."""
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get())


def make_eagle_sample_hook(settings: PluginSettings, head=None) -> Callable:
    """AROUND hook for `eagle_sample(verify_input, batch, logits_output, ...)`.

    Log-probs (`return_logprob`): SGLang computes them after eagle_sample, from
    `logits_output.next_token_logits` (`compute_spec_logprobs`: log_softmax of the logits, over
    the row's temperature unless the batch is all greedy). The hook leaves there, at draft slots
    0..N−1, logits whose log-probs are log ν: greedy rows get log ν from the greedy edit itself,
    sampled rows T·log ν (see `logprob_logits`). Slot N keeps the target's logits, so bonus
    tokens report log p. Rows with w = 1 everywhere are untouched (stock).
    """

    def eagle_sample_around(original_fn, verify_input, batch, logits_output, *args, **kwargs):
        if batch.forward_mode.is_idle() or not _is_standalone():
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        bs = len(batch.reqs)
        n1 = verify_input.draft_token_num  # N + 1 slots
        raw = logits_output.next_token_logits  # [B*(N+1), V]
        logprobs = bool(getattr(batch, "return_logprob", False))
        keep_raw = logprobs and _original_logprobs_requested()
        logits = raw.clone() if keep_raw else raw  # edited for sampling; raw kept for "original"
        w = row_weights(batch, settings, logits.device, n1 - 1, head)  # [B] or [B, N]
        w2 = w if w.dim() == 2 else w.unsqueeze(1).expand(bs, n1 - 1)  # [B, N]
        q = verify_input.draft_probs  # [B, N, V] or None
        greedy = (batch.sampling_info.top_ks <= 1).view(-1).to(logits.device)  # [B]
        if bool(greedy.any()):
            if q is None:
                _warn_once("dialspec: no draft probs for greedy rows; verifying them losslessly (w = 1)")
            else:
                view = logits.view(bs, n1, -1)  # [B, N+1, V]
                rows = greedy.nonzero().squeeze(-1)
                view[rows] = greedy_nu_logits(view[rows], q[rows], w2[rows])
        _step.weights = torch.where(greedy.unsqueeze(1), torch.ones_like(w2), w2)  # [B, N]
        logits_output.next_token_logits = logits
        try:
            result = original_fn(verify_input, batch, logits_output, *args, **kwargs)
        finally:
            _step.weights = None
            if keep_raw:
                logits_output.next_token_logits = raw
        if logprobs and not keep_raw and q is not None:
            sampled = ~greedy & (w2 < 1.0).any(dim=1)  # [B]
            if bool(sampled.any()):
                temps = batch.sampling_info.temperatures.view(-1).to(logits.device)  # [B]
                out = logits_output.next_token_logits.clone().view(bs, n1, -1)  # [B, N+1, V]
                rows = sampled.nonzero().squeeze(-1)
                out[rows] = logprob_logits(out[rows], q[rows], w2[rows], temps[rows])
                logits_output.next_token_logits = out.view(bs * n1, -1)
        return result

    return eagle_sample_around


def logprob_logits(
    logits: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """`[R, N+1, V]` logits whose SGLang log-probs at slots 0..N−1 are log ν; slot N unchanged.

    `logits` `[R, N+1, V]` are the (penalised) target logits; p = softmax(logits / T) is SGLang's
    log-prob distribution (before top-k/top-p); ν = w·p + (1−w)·q via `mix_target_probs`.
    `compute_spec_logprobs` takes log_softmax(x / T) of a sampled row, and
    log_softmax(T·log ν / T) = log ν because ν sums to 1.
    """
    t = temperatures.to(logits.dtype).view(-1, 1, 1)  # [R, 1, 1]
    p = (logits.float() / t.float()).softmax(dim=-1)  # [R, N+1, V]
    nu = mix_target_probs(p, draft_probs.float(), weights)  # [R, N+1, V]; slot N = p
    n = draft_probs.shape[1]
    out = logits.clone()
    out[:, :n] = (t.float() * nu[:, :n].clamp_min(_LOG_FLOOR).log()).to(logits.dtype)
    return out


def chain_kernel_around(original_fn, *args, **kwargs):
    """Substitute ν for p at draft slots when eagle_sample published weights for this step."""
    w = getattr(_step, "weights", None)
    if w is not None and "target_probs" in kwargs and kwargs.get("draft_probs") is not None:
        kwargs["target_probs"] = mix_target_probs(kwargs["target_probs"], kwargs["draft_probs"], w)
    return original_fn(*args, **kwargs)


def draft_forward_around(original_fn, self, forward_batch, *args, **kwargs):
    """Build q for all-greedy batches too (greedy ν needs it); restore the flag afterwards."""
    info = getattr(forward_batch, "sampling_info", None)
    if info is None or not info.is_all_greedy or not _is_standalone():
        return original_fn(self, forward_batch, *args, **kwargs)
    info.is_all_greedy = False
    try:
        return original_fn(self, forward_batch, *args, **kwargs)
    finally:
        info.is_all_greedy = True


def graph_variant_around(original_fn, self, forward_batch, *args, **kwargs):
    """Replay the draft graph that produces q, never the greedy variant that skips it."""
    if _is_standalone():
        return None
    return original_fn(self, forward_batch, *args, **kwargs)
