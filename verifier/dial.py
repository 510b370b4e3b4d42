"""The quality dial: the one owner of what a request's quality means, from HTTP body to kernel.

Torch-free, so the gateway, the SGLang launcher and the load tester can import it without torch.

Terms
    quality   the number a client turns, in [0, 1]: 1 = lossless (output distributed exactly as the
              target model), 0 = every draft accepted (output = the draft model).
    tier      a named quality (`DEFAULT_TIERS`: lite 0.25, standard 0.5, pro 0.75, exact 1.0),
              selected by `quality: "<tier>"` or by the model name `<pair>:<tier>`.
    w         the ensemble weight on the target: verification is against ν = w·p + (1−w)·q
              (`verifier.policies.ensemble_mix`). w = 1 is exact speculative decoding.
    dial      d in [0, 1], the learned head's conditioning input: the head turns (hidden states, d)
              into a per-token w_t. Set only for learned requests (`quality: "auto"` uses the
              head's own `default_dial` unless the server overrides it).
    γ         `gamma`: w = quality ** γ (γ = 1 keeps w = quality).
    policy    `PolicyKind`: how drafts are judged. One enum from the HTTP edge (`verifier` field,
              parsed once by `PolicyKind.parse`) to the verifier's rule table.

Why w = quality (γ = 1): per position the expected acceptance is 1 − w·TV(p, q) and the bias is
TV(ν, p) = (1 − w)·TV(p, q) (docs/algorithm.md), so speed-up and fidelity both move linearly with
the dial and quality reads as "the target's share of the say".

Baselines (comparison runs; the dial still runs 0..1 with 1 the strictest):
    LOSSY    Leviathan lenience l = max(quality, lossy_min_lenience) (l = 1 is lossless)
    CASCADE  SpecCascade α = (1 − quality)·cascade_alpha_max (larger α trusts the draft more)
    TYPICAL  Medusa thresholds are fixed; the quality is recorded but changes nothing.

Precedence: an explicit `quality` beats the tier in the model name, which beats the default.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

Mode = Literal["speculative", "autoregressive"]

DEFAULT_TIERS: Mapping[str, float] = {"lite": 0.25, "standard": 0.5, "pro": 0.75, "exact": 1.0}
AUTO = "auto"  # quality: the learned head's per-token w_t
CUSTOM = "custom"  # metric label of a numeric quality (keeps label cardinality at #tiers + 3)
AUTOREGRESSIVE = "autoregressive"  # label and mode: the target alone, no drafts
RESERVED_TIER_NAMES = frozenset({AUTO, CUSTOM, AUTOREGRESSIVE})
DEFAULT_AUTO_DIAL = 0.5  # the head's default dial point unless its config says otherwise

# SGLang wire format: per-request keys inside `sampling_params.custom_params`.
WIRE_W = "dialspec_w"  # static w in [0, 1]
WIRE_DIAL = "dialspec_dial"  # the learned head's dial d; present iff the request is learned
WIRE_MODE = "dialspec_mode"  # "speculative" | "autoregressive"


class PolicyKind(enum.IntEnum):
    """Verification policies; the integer is the value verifier tensors carry per row."""

    ENSEMBLE = 0  # DIVERSED: ν = w·p + (1−w)·q
    LOSSY = 1  # Leviathan lenience
    CASCADE = 2  # SpecCascade [OPT]
    TYPICAL = 3  # Medusa typical acceptance

    @property
    def wire(self) -> str:
        """The name clients and reports use: 'ensemble', 'lossy', 'cascade', 'typical'."""
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> PolicyKind:
        try:
            return cls[name.upper()]
        except KeyError:
            raise DialError(
                f"unknown verifier {name!r}; use one of: {', '.join(POLICY_NAMES)}", param="verifier"
            ) from None


POLICY_NAMES = tuple(k.wire for k in PolicyKind)


class DialError(ValueError):
    """A dial value that cannot be served; `param` and `code` name it for an API error."""

    def __init__(self, message: str, param: str = "quality", code: str = "invalid_quality"):
        super().__init__(message)
        self.param, self.code = param, code


def check_unit(value, name: str = "quality") -> float:
    """`value` as a float in [0, 1], or DialError. Booleans are refused (JSON true is not 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise DialError(f"{name} must be a number in [0, 1], got {value!r}", param=name)
    if not 0.0 <= value <= 1.0:
        raise DialError(f"{name} must lie in [0, 1], got {value}", param=name)
    return float(value)


def check_policy_params(lenience: float, alpha: float, epsilon: float, delta: float) -> None:
    """The baseline policies' ranges, checked here only (`Verification.validate` and
    `verifier.policies.Policy` both call this): DialError naming the first one out of range."""
    if not 0.0 < lenience <= 1.0:
        raise DialError(f"lenience must lie in (0, 1], got {lenience}", "lenience")
    if not alpha >= 0.0:
        raise DialError(f"alpha must be >= 0, got {alpha}", "alpha")
    if not (0.0 <= epsilon <= 1.0 and delta >= 0.0):
        raise DialError("typical thresholds need 0 <= epsilon <= 1, delta >= 0", "verifier")


@dataclass(frozen=True)
class Verification:
    """How one request's drafts are verified: what an engine needs from the dial.

    `weight` is the static w; `dial` is set only for learned requests (the head's input, the
    head then predicts w_t and `weight` is not used). Built by `resolve` (validated there) or by
    callers that construct requests directly (engines call `validate` on admission).
    """

    mode: Mode = "speculative"
    policy: PolicyKind = PolicyKind.ENSEMBLE
    weight: float = 1.0  # ENSEMBLE: static w on the target; 1 = lossless
    dial: float | None = None  # learned head input d; None = static w
    lenience: float = 0.5  # LOSSY: l in (0, 1]
    alpha: float = 0.5  # CASCADE: α >= 0
    epsilon: float = 0.09  # TYPICAL: hard threshold in [0, 1] (Medusa's posterior_threshold)
    delta: float = 0.3  # TYPICAL: entropy-scaled threshold >= 0 (Medusa's posterior_alpha)
    num_draft: int | None = None  # N for this request; None = engine default

    @property
    def learned(self) -> bool:
        return self.dial is not None

    def validate(self, max_num_draft: int | None = None) -> Verification:
        """Raise DialError for anything out of range; returns self."""
        if self.mode not in ("speculative", AUTOREGRESSIVE):
            raise DialError(f"mode must be 'speculative' or 'autoregressive', got {self.mode!r}", "mode")
        if not isinstance(self.policy, PolicyKind):
            raise DialError(f"policy must be a PolicyKind, got {self.policy!r}", "verifier")
        check_unit(self.weight, "weight")
        if self.dial is not None:
            check_unit(self.dial, "dial")
            if self.policy != PolicyKind.ENSEMBLE:
                raise DialError("a learned dial works only with the ensemble verifier", "verifier")
        check_policy_params(self.lenience, self.alpha, self.epsilon, self.delta)
        n = self.num_draft
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise DialError(f"num_draft must be an integer >= 1, got {n!r}", "num_draft", "invalid_num_draft")
        if n is not None and max_num_draft is not None and n > max_num_draft:
            raise DialError(
                f"num_draft must lie in [1, {max_num_draft}], got {n}", "num_draft", "invalid_num_draft"
            )
        return self

    # -- SGLang wire format -----------------------------------------------------------------
    def to_custom_params(self) -> dict:
        """The `custom_params` keys the SGLang plugin reads (ensemble only: SGLang has no
        baseline policies, and engines refuse those requests before they get here)."""
        out: dict = {WIRE_W: self.weight, WIRE_MODE: self.mode}
        if self.dial is not None:
            out[WIRE_DIAL] = self.dial
        return out


def from_custom_params(params: Mapping | None, default_w: float = 1.0) -> Verification:
    """Inverse of `to_custom_params`, as the plugin reads a request inside SGLang. Raises DialError
    on a malformed value (the plugin decides how to degrade); absent keys take the defaults."""
    params = params or {}
    mode = params.get(WIRE_MODE, "speculative")
    if mode == AUTOREGRESSIVE:  # speculation is server-wide in SGLang: w = 1 is the target's law
        return Verification(mode=AUTOREGRESSIVE, weight=1.0)
    weight = check_unit(params.get(WIRE_W, default_w), WIRE_W)
    dial = params.get(WIRE_DIAL)
    return Verification(mode=mode, weight=weight, dial=None if dial is None else check_unit(dial, WIRE_DIAL))


@dataclass(frozen=True)
class DialConfig:
    """The server's dial settings (the gateway's settings file fills these)."""

    tiers: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_quality: str | float = "exact"  # lossless unless the client turns the dial
    gamma: float = 1.0  # w = quality ** gamma
    auto_dial: float | None = None  # dial for quality "auto"; None = the head's default_dial
    lossy_min_lenience: float = 0.05
    cascade_alpha_max: float = 1.0

    def __post_init__(self):
        for name, q in self.tiers.items():
            check_unit(q, f"tier {name!r}")
            if ":" in name or name in RESERVED_TIER_NAMES:
                raise DialError(f"tier name {name!r} is reserved or contains ':'", "tiers")
        if isinstance(self.default_quality, str):
            if self.default_quality not in self.tiers and self.default_quality != AUTO:
                raise DialError(f"default_quality {self.default_quality!r} is not a tier", "default_quality")
        else:
            check_unit(self.default_quality, "default_quality")
        if not self.gamma > 0:
            raise DialError(f"gamma must be > 0, got {self.gamma}", "gamma")
        if self.auto_dial is not None:
            check_unit(self.auto_dial, "auto_dial")
        if not 0.0 < self.lossy_min_lenience <= 1.0:
            raise DialError("lossy_min_lenience must lie in (0, 1]", "lossy_min_lenience")
        if not self.cascade_alpha_max >= 0.0:
            raise DialError("cascade_alpha_max must be >= 0", "cascade_alpha_max")


@dataclass(frozen=True)
class DialPoint:
    """A resolved dial: the metric label, the quality it landed on, and the verification."""

    label: str  # a tier name, "custom", "auto" or "autoregressive"
    quality: float | None  # None for autoregressive
    verification: Verification

    @property
    def policy_name(self) -> str:
        v = self.verification
        return AUTOREGRESSIVE if v.mode == AUTOREGRESSIVE else v.policy.wire


def verification_for(policy: PolicyKind, quality: float, config: DialConfig) -> Verification:
    """quality -> the policy's knob (w, lenience or α): the one place the mapping is written."""
    if policy == PolicyKind.ENSEMBLE:
        return Verification(policy=policy, weight=quality**config.gamma)
    if policy == PolicyKind.LOSSY:
        return Verification(policy=policy, lenience=max(quality, config.lossy_min_lenience))
    if policy == PolicyKind.CASCADE:
        return Verification(policy=policy, alpha=(1.0 - quality) * config.cascade_alpha_max)
    return Verification(policy=policy)


def resolve(
    quality: float | str | None = None,
    *,
    model_tier: str | None = None,
    policy: PolicyKind = PolicyKind.ENSEMBLE,
    mode: Mode = "speculative",
    num_draft: int | None = None,
    config: DialConfig = DialConfig(),
    head_dial: float | None = None,
) -> DialPoint:
    """The request's dial fields -> DialPoint. `head_dial` is the loaded head's default dial
    (None = no head: quality "auto" is refused). Raises DialError naming the bad field."""
    if mode == AUTOREGRESSIVE:  # the quality is ignored, but must still be one the API allows
        known = quality in config.tiers or (quality == AUTO and head_dial is not None)
        if isinstance(quality, str) and not known:
            _unknown_tier(quality, config, "quality")
        if quality is not None and not isinstance(quality, str):
            check_unit(quality)
        return DialPoint(AUTOREGRESSIVE, None, Verification(mode=AUTOREGRESSIVE))
    param = "quality"
    if quality is None:
        quality, param = (model_tier, "model") if model_tier is not None else (config.default_quality, param)
    if isinstance(quality, str):
        if quality == AUTO:
            if head_dial is None:
                raise DialError(
                    "quality 'auto' needs the learned head, which this server was started without "
                    "(start it with --head, or pick a number or a tier)",
                    code="head_unavailable",
                )
            if policy != PolicyKind.ENSEMBLE:
                raise DialError("quality 'auto' works only with the ensemble verifier", "verifier")
            dial = config.auto_dial if config.auto_dial is not None else head_dial
            v = Verification(dial=dial, weight=dial**config.gamma)  # weight: a fallback, reported
            return DialPoint(AUTO, dial, replace(v, num_draft=num_draft).validate())
        if quality not in config.tiers:
            _unknown_tier(quality, config, param)
        label, q = quality, config.tiers[quality]
    else:
        label, q = CUSTOM, check_unit(quality)
    v = replace(verification_for(policy, q, config), num_draft=num_draft)
    return DialPoint(label, q, v.validate())


def _unknown_tier(quality: str, config: DialConfig, param: str):
    tiers = ", ".join(sorted(config.tiers))
    raise DialError(
        f"unknown quality tier {quality!r}; use a number in [0, 1], 'auto', or one of: {tiers}", param
    )


# -- model names -----------------------------------------------------------------------------------
def tier_from_model_name(name: str, served: str, config: DialConfig, has_head: bool = False) -> str | None:
    """`<pair>` -> None, `<pair>:<tier>` (or `<pair>:auto` with a head) -> that tier; any other
    name is not ours (LookupError: the caller answers 404)."""
    if name == served:
        return None
    pair, sep, tier = name.rpartition(":")
    if sep and pair == served and (tier in config.tiers or (has_head and tier == AUTO)):
        return tier
    raise LookupError(name)


def model_names(served: str, config: DialConfig, has_head: bool = False) -> list[str]:
    """The served names: the pair (default quality), one per tier, and `<pair>:auto` with a head."""
    tiers = [*config.tiers, AUTO] if has_head else list(config.tiers)
    return [served] + [f"{served}:{tier}" for tier in tiers]


# -- brownout: serving a request below its quality, never below its floor ---------------------------
# Under overload the gateway may serve a request at a lower quality than it asked for, down to the
# floor the client allowed (`min_quality`; server/gateway/brownout.py decides when). The rungs it
# steps over and what a lowered request becomes are dial concepts, so they are written here.
def ladder(config: DialConfig) -> tuple[float, ...]:
    """The qualities brownout steps through, highest first: every tier's and 0 (the draft alone)."""
    return tuple(sorted({*config.tiers.values(), 0.0}, reverse=True))


def resolve_floor(min_quality: float | str | None, point: DialPoint, config: DialConfig) -> float | None:
    """The lowest quality a request allows: `min_quality` (a number in [0, 1] or a tier name), by
    default the requested quality itself (brownout never touches it). None for requests brownout
    cannot lower (autoregressive mode, when no floor is sent). Raises DialError naming `min_quality`."""
    if min_quality is None:
        return point.quality
    v = point.verification

    def error(message: str) -> DialError:
        return DialError(message, param="min_quality", code="invalid_min_quality")

    if v.mode == AUTOREGRESSIVE or v.policy != PolicyKind.ENSEMBLE or v.learned:
        raise error(
            "min_quality works with a number or a tier as quality on the ensemble verifier "
            f"(this request is {point.policy_name}, quality {point.label!r}); remove min_quality"
        )
    if isinstance(min_quality, str):
        if min_quality not in config.tiers:
            raise error(f"unknown min_quality tier {min_quality!r}; use a number in [0, 1] or one of: "
                        f"{', '.join(sorted(config.tiers))}")  # fmt: skip
        floor = config.tiers[min_quality]
    else:
        try:
            floor = check_unit(min_quality, "min_quality")
        except DialError as exc:
            raise error(str(exc)) from None
    if floor > point.quality:
        raise error(
            f"min_quality {floor:g} is above the requested quality {point.quality:g}; a floor must be "
            "at or below the quality it protects"
        )
    return floor


def lowered_quality(quality: float, floor: float, level: int, rungs: tuple[float, ...]) -> float:
    """The quality brownout level `level` serves a request at (`rungs` = `ladder(...)`).

    A request's room is the number of rungs strictly below its quality and at or above its floor.
    Level k lowers a request with room r by k − (K − r) rungs, clamped to [0, r], where K =
    len(rungs) − 1 is the most room any request can have: at low levels only the requests whose
    floors leave the most room give, each level asks one more rung of everyone who has it, and at
    level K every request sits at the lowest rung its floor allows. Never below `floor`; level 0
    (or a floor at the quality) returns `quality` itself."""
    below = [q for q in rungs if floor <= q < quality]  # descending: the request's room
    steps = min(max(level - (len(rungs) - 1 - len(below)), 0), len(below))
    return below[steps - 1] if steps else quality


def at_quality(point: DialPoint, quality: float, config: DialConfig) -> DialPoint:
    """`point` served at another quality on the ensemble verifier (its N kept): labelled with the
    tier at that quality, or 'custom'."""
    if quality == point.quality:
        return point
    label = next((name for name, q in config.tiers.items() if q == quality), CUSTOM)
    v = replace(
        verification_for(PolicyKind.ENSEMBLE, quality, config), num_draft=point.verification.num_draft
    )
    return DialPoint(label, quality, v)
