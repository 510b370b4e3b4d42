"""Prometheus `/metrics` scrape: the speculative-decoding counters and their delta over a phase.

Counters read (vLLM semantics, any prefix such as `dialspec:` or `vllm:`):
    <prefix>spec_decode_num_drafts_total           proposal rounds ("drafts")
    <prefix>spec_decode_num_draft_tokens_total     draft tokens proposed
    <prefix>spec_decode_num_accepted_tokens_total  draft tokens accepted
grouped by their `tier` label (series without one count under `all`; other labels are summed).

The delta (after - before) is the server's own count of what this phase caused, provided nobody
else sends traffic meanwhile; the report cross-checks it against the sum of the per-response
`dialspec` extensions.
"""

from __future__ import annotations

import re

import httpx

COUNTERS = {
    "spec_decode_num_drafts_total": "drafts",
    "spec_decode_num_draft_tokens_total": "draft_tokens",
    "spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
ALL = "all"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# tier -> {"drafts": x, "draft_tokens": y, "accepted_tokens": z}
SpecCounters = dict[str, dict[str, float]]


def parse_spec_counters(text: str) -> SpecCounters:
    """The speculative counters of a Prometheus text exposition, per tier."""
    out: SpecCounters = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group(1)
        key = next((v for suffix, v in COUNTERS.items() if name.endswith(suffix)), None)
        if key is None:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        tier = labels.get("tier", ALL)
        bucket = out.setdefault(tier, dict.fromkeys(COUNTERS.values(), 0.0))
        bucket[key] += value
    return out


def delta(before: SpecCounters, after: SpecCounters) -> SpecCounters:
    """after - before per tier and counter (a tier first seen after counts from zero)."""
    out: SpecCounters = {}
    for tier, counts in after.items():
        prev = before.get(tier, {})
        d = {k: v - prev.get(k, 0.0) for k, v in counts.items()}
        if any(d.values()):
            out[tier] = d
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> tuple[SpecCounters | None, str | None]:
    """(counters, None) or (None, why not): a missing `/metrics` never fails the run."""
    try:
        resp = await client.get(url, timeout=10.0)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return None, f"HTTP {resp.status_code} from {url}"
    return parse_spec_counters(resp.text), None
