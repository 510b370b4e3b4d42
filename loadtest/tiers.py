"""The tier mix: which `quality` each request asks for, in what proportion.

Syntax (`--tiers`): comma-separated `name[:weight]` items, e.g. `lite:0.3,standard:0.4,pro:0.3`.
    name    a tier name (`lite`, `standard`, `pro`, `exact`, `auto`, or any tier the server
            defines) sent as the string `quality`, or a number in [0, 1] sent as a numeric
            `quality`.
    weight  a positive number; weights are normalised to proportions, so `lite:1,pro:3` means
            25% / 75%. A bare name has weight 1, so `lite,pro` is an even split.
No mix at all means requests carry no `quality` (the server's default); that group is called
`default` in reports.

Assignment is a seeded draw per request index (`assign`), so the same seed gives the same
sequence of tiers, independent of timing.

The floor mix (`--floors`, dialspec's brownout) has the same syntax; each name is sent as
`min_quality`, and the name `none` sends no floor (the request is never served lower). Floors are
drawn independently of tiers (their own seeded stream).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

DEFAULT_GROUP = "default"
NO_FLOOR = "none"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TierMixError(ValueError):
    """A malformed `--tiers` value; the message says what to write instead."""


@dataclass(frozen=True)
class Tier:
    name: str  # label in reports: the tier name, or the number as written
    quality: str | float | None  # what is sent as `quality` (None: the field is omitted)
    share: float  # proportion in the mix, shares sum to 1


def _quality(name: str) -> str | float:
    try:
        value = float(name)
    except ValueError:
        return name
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise TierMixError(f"numeric quality {name!r} must lie in [0, 1]")
    return value


def parse_tier_mix(text: str | None) -> list[Tier]:
    """Parse `--tiers`; None or empty -> one `default` tier that sends no `quality`."""
    if text is None or not text.strip():
        return [Tier(DEFAULT_GROUP, None, 1.0)]
    items: list[tuple[str, float]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise TierMixError(f"empty item in tier mix {text!r}; write e.g. lite:0.3,standard:0.7")
        name, sep, weight_text = item.rpartition(":") if ":" in item else (item, "", "")
        name = name.strip()
        if not name or not _NAME.match(name):
            raise TierMixError(f"bad tier name in {item!r}; write name:weight, e.g. lite:0.3")
        if sep:
            try:
                weight = float(weight_text)
            except ValueError:
                raise TierMixError(
                    f"bad weight {weight_text!r} in {item!r}; write name:weight with a number, e.g. pro:0.3"
                ) from None
        else:
            weight = 1.0
        if not math.isfinite(weight) or weight <= 0:
            raise TierMixError(f"weight of {name!r} must be a positive number, got {weight_text!r}")
        if any(n == name for n, _ in items):
            raise TierMixError(f"tier {name!r} appears twice in {text!r}; list each tier once")
        items.append((name, weight))
    total = sum(w for _, w in items)
    return [Tier(name, _quality(name), w / total) for name, w in items]


def parse_floor_mix(text: str | None) -> list[Tier] | None:
    """Parse `--floors` (None: no request sends a floor); the name `none` sends none."""
    if text is None or not text.strip():
        return None
    return [Tier(t.name, None if t.name == NO_FLOOR else t.quality, t.share) for t in parse_tier_mix(text)]


def format_tier_mix(tiers: list[Tier]) -> str:
    return ",".join(f"{t.name}:{t.share:.3g}" for t in tiers)


def assign(tiers: list[Tier], n: int, seed: int, stream: str = "tiers") -> list[Tier]:
    """The tier of each of `n` requests: independent draws with the mix's shares, seeded
    (`stream` keeps two mixes drawn with one seed independent of each other)."""
    rng = random.Random(f"{stream}:{seed}")
    return rng.choices(tiers, weights=[t.share for t in tiers], k=n)
