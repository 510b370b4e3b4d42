"""Fail loudly when the plugin's hooks are not live in an SGLang process.

SGLang 0.5.23's `load_plugins` (srt/plugins/__init__.py) logs and swallows exceptions raised by a
plugin's `register()`, and `HookRegistry.apply_hooks` (srt/plugins/hook_registry.py) logs and
swallows exceptions raised while patching a target. Either leaves a healthy-looking server that
verifies losslessly and ignores w. So every process that needs the hooks checks them itself,
after `apply_hooks` has run there, and refuses to continue when one is missing:

    launcher   the argument hook (`args_hook`, run inside `ServerArgs.resolve_once`, after
               `load_plugins`) calls `verify_live("launcher")`. If the argument hook itself is
               not live, stock SGLang refuses STANDALONE + rejection sampling with
               NotImplementedError, so startup fails either way.
    scheduler  a BEFORE hook on `Scheduler.__init__` (`SCHEDULER_INIT`; `run_scheduler_process`
               calls `load_plugins()` and then builds the Scheduler, after configuring logging)
               calls `verify_live("scheduler")`. The raise makes SGLang log "Scheduler hit an
               exception" and SIGQUIT the launcher, which kills the server: non-zero exit.

Terms
    spec      `(target, hook, hook type name)` as registered with HookRegistry.
    live      the attribute at `target` on the real module/class, or a function it wraps through
              `__wrapped__`, closes over `hook` (HookRegistry's wrappers keep the hook in their
              closure and the wrapped function in `__wrapped__`); and, for module-level
              functions, no module in `sys.modules` still holds the function our wrapper wraps
              (a `from X import f` copy that HookRegistry's propagation missed would bypass us).

Whatever `register()` itself fails on (a bad DIALSPEC_DEFAULT_W, an unreadable head) is turned
into the same two checkpoints by `register_failure`, so the server stops with that message.
"""

from __future__ import annotations

import logging
import pkgutil
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"

Spec = tuple[str, Callable, str]

_expected: list[Spec] = []  # what register() registered in this process
_failure: str | None = None  # why register() could not set the plugin up, if it could not


class HooksNotLive(RuntimeError):
    """A hook the plugin registered is not in effect in this process."""


def expect(specs: Iterable[Spec]) -> None:
    """Record the hooks register() registered in this process (checked by `verify_live`)."""
    global _failure
    _expected[:] = list(specs)
    _failure = None


def _closes_over(fn: Any, hook: Callable) -> bool:
    cells = getattr(fn, "__closure__", None) or ()
    for cell in cells:
        try:
            if cell.cell_contents is hook:
                return True
        except ValueError:  # an empty cell
            continue
    return False


def _our_wrapper(attr: Any, hook: Callable) -> Any | None:
    """The function in `attr`'s `__wrapped__` chain that closes over `hook`, or None."""
    fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    seen = 0
    while fn is not None and seen < 32:  # a chain longer than 32 wrappers is not ours
        if _closes_over(fn, hook):
            return fn
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def _raw_attribute(target: str) -> tuple[Any, Any]:
    """`(owner, attribute)` for a dotted target, reading class dicts so descriptors stay raw."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return owner, klass.__dict__[name]
    return owner, getattr(owner, name)


def _stale_copies(original: Any, wrapper: Any) -> list[str]:
    """Modules that still bind `original` (our wrapper's inner function) under some name."""
    holders = []
    for mod in list(sys.modules.values()):
        if not isinstance(mod, types.ModuleType):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        holders += [f"{mod.__name__}.{name}" for name, value in items if value is original]
    return holders


def missing_hooks(specs: Iterable[Spec]) -> list[str]:
    """One `target (why)` entry per spec that is not live in this process."""
    missing = []
    for target, hook, _kind in specs:
        try:
            owner, attr = _raw_attribute(target)
        except Exception as exc:  # import errors included: the target is unusable either way
            missing.append(f"{target} (cannot resolve: {type(exc).__name__}: {exc})")
            continue
        wrapper = _our_wrapper(attr, hook)
        if wrapper is None:
            missing.append(f"{target} (not patched)")
            continue
        inner = getattr(wrapper, "__wrapped__", None)
        if isinstance(owner, types.ModuleType) and inner is not None:
            stale = _stale_copies(inner, wrapper)
            if stale:
                missing.append(f"{target} (unpatched copies in {', '.join(stale)})")
    return missing


def verify_live(where: str) -> None:
    """Raise HooksNotLive (one line) unless every registered hook is live in this process."""
    if _failure is not None:
        message = f"dialspec SGLang plugin ({where}): setup failed: {_failure}"
        logger.error(message)
        raise HooksNotLive(message)
    missing = missing_hooks(_expected)
    if missing:
        message = (
            f"dialspec SGLang plugin ({where}): hooks not live, refusing to serve (w would be ignored): "
            + "; ".join(missing)
            + " (see SGLang's 'Failed to apply hooks' log lines)"
        )
        logger.error(message)
        raise HooksNotLive(message)
    logger.info("dialspec SGLang plugin (%s): all %d hooks live", where, len(_expected))


def scheduler_init_check(*_args: Any, **_kwargs: Any) -> None:
    """BEFORE hook on `Scheduler.__init__`: the scheduler process's checkpoint."""
    verify_live("scheduler")


def register_failure(message: str, args_target: str) -> list[Spec]:
    """Specs that stop startup with `message` (used when register() cannot build its hooks).

    An AROUND hook on `args_target` (args_hook.TARGET, passed in so that this module does not
    import args_hook, which imports it) refuses STANDALONE in the launcher and the scheduler
    checkpoint refuses in the scheduler, both with `message`.
    """
    global _failure
    _expected.clear()
    _failure = message

    def failing_args_hook(original_fn: Callable, server_args: Any) -> None:
        verify_live("launcher")  # raises with the setup failure

    return [
        (args_target, failing_args_hook, "AROUND"),
        (SCHEDULER_INIT, scheduler_init_check, "BEFORE"),
    ]
