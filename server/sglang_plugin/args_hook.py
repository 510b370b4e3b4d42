"""Startup validation: let STANDALONE use SGLang's rejection-sampling verify, refuse what breaks it.

Hook point (SGLang 0.5.23): `sglang.srt.arg_groups.speculative_hook._handle_eagle_family`, the
per-algorithm resolver that `SpeculativeAlgorithm.handle_server_args` imports at call time for
EAGLE/EAGLE3/STANDALONE. Stock, it raises NotImplementedError for STANDALONE with
`--speculative-use-rejection-sampling`, because only EAGLE drafts were known to hand the kernel a
target-vocab q. A STANDALONE draft is a full model over the same vocabulary (SGLang checks vocab
compatibility when it builds the worker), and `EagleDraftWorker` already builds q through
`sample_draft_proposal` under rejection sampling, so the restriction does not apply to it.

The AROUND hook, for STANDALONE while the plugin is on:
  1. refuses topk > 1, block verification, accept thresholds != 1, adaptive speculation and
     deterministic inference off-CUDA (the chain kernel is topk = 1 only and ignores thresholds;
     block verification changes the acceptance rule away from the one ν substitutes into);
  2. declares rejection sampling off while the stock resolver runs (so its EAGLE-only check
     passes and everything else it resolves: max running requests, auto N, draft-token count);
  3. re-checks the resolved topk and declares rejection sampling on;
  4. checks that every hook the plugin registered is live in this (the launcher) process
     (`liveness.verify_live`), since SGLang swallows hook-application errors.

Declarations are SGLang's own mechanism (`declare_resolution`, last writer wins), so the
resolved record reads `speculative_use_rejection_sampling=True` everywhere downstream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from server.sglang_plugin.liveness import verify_live
from server.sglang_plugin.params import settings_from_env

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.arg_groups.speculative_hook._handle_eagle_family"
SOURCE = "dialspec.sglang_plugin"


class DialspecConfigError(ValueError):
    """An SGLang setting the ensemble verifier cannot honour; raised at startup."""


def _refuse(message: str) -> None:
    raise DialspecConfigError(f"dialspec SGLang plugin: {message}")


def cuda_graph_phases_on(cfg: Any) -> list[str]:
    """The phases ("decode", "prefill") whose CUDA graphs stay on.

    From SGLang's resolved `cuda_graph_config` when it is resolved (the pipeline resolves it
    before the speculative handlers), else from the flags with SGLang's precedence
    (`parse_cuda_graph_config`): explicit JSON > `--cuda-graph-backend-<phase>` >
    `--disable-<phase>-cuda-graph` / `--disable-cuda-graph`.
    """
    config = getattr(cfg, "cuda_graph_config", None)
    on = []
    for phase in ("decode", "prefill"):
        resolved = getattr(config, phase, None)
        if hasattr(resolved, "backend"):
            backend = resolved.backend
        else:
            explicit = config.get(phase, {}).get("backend") if isinstance(config, dict) else None
            backend = explicit or getattr(cfg, f"cuda_graph_backend_{phase}", None)
            if backend is None:
                off = getattr(cfg, f"disable_{phase}_cuda_graph", False) or getattr(
                    cfg, "disable_cuda_graph", False
                )
                backend = "disabled" if off else "default"
        if str(backend) != "disabled":
            on.append(phase)
    return on


def check_standalone_args(cfg: Any) -> None:
    """Refuse configurations the chain rejection kernel cannot verify against ν.

    `cfg` is any attribute view of ServerArgs (SGLang's resolving view in practice).
    """
    topk = cfg.speculative_eagle_topk
    if topk is not None and int(topk) != 1:
        _refuse(f"--speculative-eagle-topk must be 1 (chain verification), got {topk}")
    if cfg.speculative_use_block_verification:
        _refuse("--speculative-use-block-verification changes the acceptance rule; turn it off")
    single, acc = cfg.speculative_accept_threshold_single, cfg.speculative_accept_threshold_acc
    if single != 1.0 or acc != 1.0:
        _refuse(
            "--speculative-accept-threshold-single/--speculative-accept-threshold-acc must be 1.0; "
            f"got {single}/{acc} (the quality dial replaces these server-wide relaxations)"
        )
    if getattr(cfg, "speculative_adaptive", False):
        _refuse("--speculative-adaptive is not supported (N must stay fixed per server)")
    on = cuda_graph_phases_on(cfg) if settings_from_env().head_path else []
    if on:
        # Capture uses Python forward hooks, which do not run when a CUDA graph is replayed: the
        # decode phase covers the draft's decode and draft-extend graphs and the target-verify
        # graph, the prefill phase the (breakable) prefill graphs of target and draft.
        _refuse(
            "the learned head (DIALSPEC_HEAD_PATH) needs every CUDA graph off (--disable-cuda-graph); "
            f"still on: {', '.join(on)}"
        )
    device = str(getattr(cfg, "device", None) or "cuda")
    if getattr(cfg, "enable_deterministic_inference", False) and not device.startswith("cuda"):
        _refuse("deterministic rejection sampling needs a CUDA device")


def handle_eagle_family_around(original_fn: Callable[[Any], None], server_args: Any) -> None:
    """AROUND hook for `_handle_eagle_family(server_args)`; see the module docstring."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolved_view, resolving_view

    cfg = resolving_view(server_args)
    if cfg.speculative_algorithm != "STANDALONE" or not settings_from_env().enabled:
        return original_fn(server_args)
    check_standalone_args(cfg)
    declare_resolution(server_args, SOURCE, speculative_use_rejection_sampling=False)
    original_fn(server_args)
    check_standalone_args(resolved_view(server_args))
    declare_resolution(server_args, SOURCE, speculative_use_rejection_sampling=True)
    verify_live("launcher")
    logger.info("dialspec: STANDALONE verification uses the ensemble rejection sampler (topk=1)")
    return None
