"""Proof that dialspec's plugin is live on an SGLang runtime: the w = 0 acceptance probe.

SGLang loads plugins and applies their hooks while swallowing every exception, so a runtime
whose hooks failed to apply looks healthy (`/health` 200) and serves plain lossless speculative
decoding, ignoring w. The probe tells the two apart from outside:

    probe     one `/generate` request at temperature 1 (no top-k/top-p), `ignore_eos`,
              `max_new_tokens` = `tokens`, with `custom_params` w = 0.
    patched   at w = 0 the ensemble target is ν = q, so the chain rejection test
              `coin·q(x) < ν(x) = q(x)` accepts every draft: `meta_info` reports
              `spec_num_correct_drafts == spec_num_proposed_drafts`.
    stock     the unpatched verifier accepts draft x with probability min(1, p(x)/q(x)) < 1
              for a real pair, so all of ~50 drafts being accepted is a very rare event (for a
              pair accepting 90 % per draft: 0.9^55 ≈ 0.3 %); and the probe repeats.

A result is a one-line reason (not ready) or None (ready). No torch import.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from verifier.dial import Verification

PROBE_PROMPT = "Count slowly from one to one hundred, one number per line:"
NOT_PROBED = "the dialspec plugin probe has not run yet"


@dataclass(frozen=True)
class ProbeConfig:
    """`interval` seconds between probes; `tokens` generated per probe; `min_drafts` proposed
    drafts below which a probe is inconclusive (too short to tell stock from patched)."""

    interval: float = 60.0
    tokens: int = 64
    min_drafts: int = 32


def probe_body(prompt_ids: list[int], tokens: int) -> dict[str, Any]:
    """The `/generate` body of one probe (native SGLang API, not streamed)."""
    return {
        "input_ids": list(prompt_ids),
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": tokens,
            "ignore_eos": True,
            "custom_params": Verification(weight=0.0).validate().to_custom_params(),
        },
        "stream": False,
        "rid": f"dialspec-probe-{uuid.uuid4().hex}",
    }


def judge_probe(meta: dict[str, Any], min_drafts: int) -> str | None:
    """None when `meta` (a probe's `meta_info`) proves the plugin live, else the reason."""
    proposed = meta.get("spec_num_proposed_drafts")
    correct = meta.get("spec_num_correct_drafts")
    if not isinstance(proposed, int) or not isinstance(correct, int) or proposed <= 0:
        return (
            "the SGLang runtime reports no speculative counters (spec_num_proposed_drafts): "
            "it is not serving STANDALONE speculative decoding"
        )
    if correct != proposed:
        return (
            f"dialspec's plugin is not live on the SGLang runtime: at w = 0 it accepted {correct} of "
            f"{proposed} drafts (with the plugin every draft is accepted); check the runtime log for "
            "'Failed to apply hooks' / 'Failed to execute general plugin'"
        )
    if proposed < min_drafts:
        return f"the plugin probe was inconclusive: only {proposed} drafts proposed (need {min_drafts})"
    return None


async def run_probe(client: httpx.AsyncClient, prompt_ids: list[int], config: ProbeConfig) -> str | None:
    """Send one probe on `client` (base URL = the runtime); never raises."""
    try:
        resp = await client.post("/generate", json=probe_body(prompt_ids, config.tokens))
    except httpx.HTTPError as exc:
        return f"SGLang runtime unreachable during the plugin probe: {exc!r}"
    if resp.status_code != 200:
        return f"the plugin probe failed: SGLang /generate HTTP {resp.status_code}: {resp.text.strip()[:200]}"
    try:
        data = resp.json()
    except json.JSONDecodeError:
        return f"the plugin probe got a non-JSON answer: {resp.text.strip()[:200]}"
    if isinstance(data, list):  # a router may wrap single requests in a list
        data = data[0] if data else {}
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        return "the plugin probe's answer has no meta_info"
    return judge_probe(meta, config.min_drafts)
