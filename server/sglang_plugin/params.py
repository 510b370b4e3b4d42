"""Per-request dialspec parameters as they travel inside SGLang, and the plugin's server settings.

A request carries its dial in `sampling_params.custom_params` (a JSON dict SGLang passes through
`/generate` and the OpenAI endpoints untouched). The keys and their meaning are owned by
`verifier.dial` (`Verification.to_custom_params` / `from_custom_params`):

    dialspec_w        float in [0, 1]: the static ensemble weight on the target (1 = lossless).
    dialspec_dial     float in [0, 1], only for learned requests: the learned head's dial input.
    dialspec_mode     "speculative" (default) or "autoregressive". SGLang's speculative mode is
                      server-wide, so "autoregressive" is served as w = 1: the output
                      distribution is then exactly the target's, which is what the mode means.

Server settings come from environment variables so that every SGLang process (launcher,
scheduler subprocesses) sees the same values without extra CLI flags:

    DIALSPEC_SGLANG_PLUGIN   "1" turns the plugin on; anything else leaves SGLang stock.
    DIALSPEC_DEFAULT_W       default w for requests that send none (default 1.0, lossless).
    DIALSPEC_HEAD_PATH       optional learned head (see learned_head.py).

No SGLang or torch import: this module is read by the launcher CLI too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verifier.dial import (
    WIRE_DIAL,
    WIRE_MODE,
    WIRE_W,
    DialError,
    Verification,
    check_unit,
    from_custom_params,
)

logger = logging.getLogger(__name__)

ENV_ENABLE = "DIALSPEC_SGLANG_PLUGIN"
ENV_DEFAULT_W = "DIALSPEC_DEFAULT_W"
ENV_HEAD_PATH = "DIALSPEC_HEAD_PATH"
KEY_W, KEY_DIAL, KEY_MODE = WIRE_W, WIRE_DIAL, WIRE_MODE  # owned by verifier.dial


@dataclass(frozen=True)
class PluginSettings:
    enabled: bool
    default_w: float = 1.0
    head_path: str | None = None


def settings_from_env(environ: Mapping[str, str] | None = None) -> PluginSettings:
    """Read the plugin settings; a malformed default weight is a startup error, not a guess."""
    env = os.environ if environ is None else environ
    enabled = env.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on")
    raw_w = env.get(ENV_DEFAULT_W, "1.0")
    try:
        default_w = check_unit(float(raw_w), ENV_DEFAULT_W)
    except (ValueError, DialError):
        raise ValueError(f"{ENV_DEFAULT_W}={raw_w!r}: expected a number in [0, 1]") from None
    return PluginSettings(enabled=enabled, default_w=default_w, head_path=env.get(ENV_HEAD_PATH) or None)


@dataclass(frozen=True)
class RowParams:
    """What the verify step needs from one request."""

    weight: float  # static w (also the learned rows' fallback)
    dial: float | None = None  # learned head input; None = static w

    @property
    def learned(self) -> bool:
        return self.dial is not None


def row_params(custom_params: Mapping[str, Any] | None, default_w: float) -> RowParams:
    """Extract one request's dial. Bad values fall back to the server default (logged, not
    raised: the gateway validates, and a verify step must never fail a batch)."""
    try:
        v = from_custom_params(custom_params, default_w)
    except DialError as exc:
        logger.warning("dialspec: ignoring invalid custom_params (%s); using w = %s", exc, default_w)
        return RowParams(weight=default_w)
    return RowParams(weight=v.weight, dial=v.dial)


def batch_row_params(reqs: Sequence[Any], default_w: float) -> list[RowParams]:
    """Row i's params from `reqs[i].sampling_params.custom_params` (SGLang's `Req` objects)."""
    out = []
    for req in reqs:
        sp = getattr(req, "sampling_params", None)
        out.append(row_params(getattr(sp, "custom_params", None), default_w))
    return out


def custom_params_for(verify: Verification) -> dict:
    """The `custom_params` dict a client sends (used by the gateway's SGLang engine)."""
    return verify.validate().to_custom_params()
