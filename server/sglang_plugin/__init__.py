"""dialspec's SGLang plugin: ensemble (DIVERSED) verification for STANDALONE speculative decoding.

SGLang discovers `register` through the entry-point group `sglang.srt.plugins` (pyproject) and
calls it in every process (launcher, engine, scheduler) before serving. It registers nothing
unless `DIALSPEC_SGLANG_PLUGIN=1`, so an installed-but-inactive plugin leaves SGLang stock.

Hooks (HookRegistry targets, SGLang 0.5.23):
    args_hook.TARGET          AROUND  STANDALONE + rejection sampling allowed; bad settings refused
    verify_hooks.EAGLE_SAMPLE AROUND  per-row w from custom_params; all-w = 1 batches stock
    verify_hooks.CHAIN_KERNEL AROUND  target probs at draft slots := ν̃ (masked ensemble), in place
    verify_hooks.DRAFT        AROUND  all-greedy batches with some w < 1 build q
    learned_head (only with DIALSPEC_HEAD_PATH): AFTER ModelRunner.load_model (attach capture),
                              AROUND ModelRunner.forward (record states per request)
    liveness.SCHEDULER_INIT   BEFORE  the scheduler process refuses to start unless all are live

SGLang swallows exceptions from `register()` and from applying hooks; `liveness` turns both into
a failed startup (see that module).
"""

from __future__ import annotations

import logging
import os

from server.sglang_plugin import liveness
from server.sglang_plugin.params import ENV_DEFAULT_W, settings_from_env

logger = logging.getLogger(__name__)

LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


def hook_specs(settings=None) -> list[tuple[str, object, str]]:
    """`(target, hook, hook type name)` for every hook the plugin would register."""
    from server.sglang_plugin import args_hook, verify_hooks

    settings = settings or settings_from_env()
    head = None
    specs = []
    if settings.head_path:
        from server.sglang_plugin.learned_head import (
            LearnedHead,
            load_head,
            make_forward_hook,
            make_load_model_hook,
        )

        head = LearnedHead(load_head(settings.head_path))
        specs.append((LOAD_MODEL, make_load_model_hook(head), "AFTER"))
        specs.append((MODEL_FORWARD, make_forward_hook(head), "AROUND"))
    planner = verify_hooks.StepPlanner(settings, head)  # one per process: draft and verify agree
    specs += [
        (args_hook.TARGET, args_hook.handle_eagle_family_around, "AROUND"),
        (verify_hooks.EAGLE_SAMPLE, verify_hooks.make_eagle_sample_hook(settings, head, planner), "AROUND"),
        (verify_hooks.CHAIN_KERNEL, verify_hooks.chain_kernel_around, "AROUND"),
        (verify_hooks.DRAFT, verify_hooks.make_draft_hook(settings, head, planner), "AROUND"),
    ]
    return specs


def _args_target() -> str:
    from server.sglang_plugin import args_hook

    return args_hook.TARGET


def register() -> None:
    """Entry point called by `sglang.srt.plugins.load_plugins`. No-op unless enabled.

    Any setup error (a bad DIALSPEC_DEFAULT_W, an unreadable head) is not raised here, where
    SGLang would log and ignore it: it registers checkpoints that stop startup with the message.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        settings = settings_from_env()
    except ValueError as exc:
        if not settings_from_env({**os.environ, ENV_DEFAULT_W: "1"}).enabled:
            return  # plugin off: its settings are not our business
        specs = liveness.register_failure(str(exc), _args_target())
    else:
        if not settings.enabled:
            logger.debug("dialspec SGLang plugin inactive (set DIALSPEC_SGLANG_PLUGIN=1)")
            return
        try:
            specs = hook_specs(settings)
        except Exception as exc:  # e.g. the head file: reported at startup, not swallowed
            specs = liveness.register_failure(f"{type(exc).__name__}: {exc}", _args_target())
        else:
            specs.append((liveness.SCHEDULER_INIT, liveness.scheduler_init_check, "BEFORE"))
            liveness.expect(specs)
    for target, hook, kind in specs:
        HookRegistry.register(target, hook, HookType[kind])
    logger.info("dialspec SGLang plugin: registered %d hooks", len(specs))
