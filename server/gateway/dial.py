"""The quality dial: what a client asks for (`quality`, model-name tier, `verifier`, `mode`) ->
the engine's `VerifyOptions`.

Terms:
    quality  a number in [0, 1]; 1 = lossless (output distributed exactly as the target model),
             0 = every draft accepted (output = the draft model).
    tier     a named quality from settings (`lite` 0.25, `standard` 0.5, `pro` 0.75, `exact` 1.0 by
             default); selectable by `quality: "<tier>"` or by the model name `<pair>:<tier>`.
    "auto"   the learned head picks a per-token weight w_t (DIVERSED); needs `EngineInfo.has_head`.
    w        the ensemble weight on the target, nu = w*p + (1-w)*q.

Mapping (ensemble verifier, the default): w = quality ** dial_gamma, with dial_gamma = 1 by default.
Why linear: per position the expected acceptance is 1 - w*TV(p, q) and the bias is
TV(nu, p) = (1 - w)*TV(p, q) (DESIGN.md section 1), so with w = quality both speed-up and fidelity
move linearly with the dial and quality is directly "the fraction of the target's say".

Baseline verifiers, for comparison runs only (the dial still runs 0..1, 1 = strictest):
    lossy    Leviathan lenience l = max(quality, lossy_min_lenience) (l = 1 is lossless);
    cascade  alpha = (1 - quality) * cascade_alpha_max (larger alpha trusts the draft more);
    typical  Medusa thresholds are engine defaults; quality is recorded but does not change them.
`mode: "autoregressive"` runs the target alone (no drafts): the speed baseline.

Precedence: an explicit `quality` in the body beats the tier in the model name, which beats
`default_quality` from settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.protocol import EngineInfo, VerifyOptions
from server.gateway.errors import bad_request
from server.gateway.settings import GatewaySettings

VERIFIERS = ("ensemble", "lossy", "cascade", "typical")
MODES = ("speculative", "autoregressive")

# Metric label for a numeric quality: keeps label cardinality at (#tiers + 3).
CUSTOM = "custom"
AUTO = "auto"
AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class Dial:
    """The resolved dial for one request."""

    tier: str  # a tier name, "custom" (numeric quality), "auto" or "autoregressive": the metric label
    quality: float | None  # the number the dial landed on (None for autoregressive)
    policy: str  # verifier policy name, or "autoregressive"
    verify: VerifyOptions


def _tier_quality(name: str, settings: GatewaySettings, param: str) -> float:
    if name not in settings.tiers:
        tiers = ", ".join(sorted(settings.tiers))
        raise bad_request(
            f"unknown quality tier {name!r}; use a number in [0, 1], 'auto', or one of: {tiers}",
            param=param,
            code="invalid_quality",
        )
    return settings.tiers[name]


def resolve(
    quality: float | str | None,
    *,
    model_tier: str | None,
    verifier: str | None,
    mode: str | None,
    num_draft: int | None,
    settings: GatewaySettings,
    info: EngineInfo,
) -> Dial:
    """Map the request's dial fields to VerifyOptions; raises APIError(400) on a bad value."""
    if mode == AUTOREGRESSIVE:
        return Dial(AUTOREGRESSIVE, None, AUTOREGRESSIVE, VerifyOptions(mode="autoregressive"))
    policy = verifier or "ensemble"

    param = "quality"
    if quality is None:
        if model_tier is not None:
            quality, param = model_tier, "model"
        else:
            quality, param = settings.default_quality, "quality"
    if isinstance(quality, bool):  # JSON true/false would otherwise pass as 1/0
        raise bad_request("quality must be a number in [0, 1] or a tier name", param="quality")

    learned = False
    if isinstance(quality, str):
        if quality == AUTO:
            if not info.has_head:
                raise bad_request(
                    "quality 'auto' needs the learned head, which this server was started without "
                    "(start it with --head, or pick a number or a tier)",
                    param="quality",
                    code="head_unavailable",
                )
            if policy != "ensemble":
                raise bad_request("quality 'auto' works only with the ensemble verifier", param="verifier")
            tier, q, learned = AUTO, settings.auto_weight, True
        else:
            tier, q = quality, _tier_quality(quality, settings, param)
    else:
        q = float(quality)
        if not 0.0 <= q <= 1.0:
            raise bad_request(f"quality must be in [0, 1], got {q}", param="quality", code="invalid_quality")
        tier = CUSTOM

    if policy == "ensemble":
        verify = VerifyOptions(policy="ensemble", weight=q**settings.dial_gamma, learned=learned)
    elif policy == "lossy":
        verify = VerifyOptions(policy="lossy", lenience=max(q, settings.lossy_min_lenience))
    elif policy == "cascade":
        verify = VerifyOptions(policy="cascade", alpha=(1.0 - q) * settings.cascade_alpha_max)
    else:
        verify = VerifyOptions(policy="typical")
    if num_draft is not None:
        verify = VerifyOptions(**{**verify.__dict__, "num_draft": num_draft})
    return Dial(tier, q, policy, verify)


def split_model_name(name: str, served: str, settings: GatewaySettings, has_head: bool = False) -> str | None:
    """`<pair>` -> None, `<pair>:<tier>` (or `<pair>:auto` with a head) -> that quality; anything
    else is not ours (LookupError: the caller answers 404)."""
    if name == served:
        return None
    pair, sep, tier = name.rpartition(":")
    if sep and pair == served and (tier in settings.tiers or (has_head and tier == AUTO)):
        return tier
    raise LookupError(name)


def model_names(served: str, settings: GatewaySettings, has_head: bool = False) -> list[str]:
    """What /v1/models lists: the pair itself (default quality), one name per tier, and
    `<pair>:auto` when the learned head is loaded."""
    tiers = [*settings.tiers, AUTO] if has_head else list(settings.tiers)
    return [served] + [f"{served}:{tier}" for tier in tiers]
