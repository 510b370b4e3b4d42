"""OpenAI's `system_fingerprint` for the embedded engine: one short id for everything that decides
what a seeded (or greedy) request's tokens are, so that two responses with the same seed and the
same fingerprint can be expected to match, and a changed fingerprint says why they may not.

What goes in (`fingerprint_of`, published beside it in `EngineInfo.runtime`):
    the numerics     the pair's shapes, the device (CPU model or GPU name), the dtype, the CPU
                     threads, torch's version and the code digest of the engine and the verifier
                     (`cost_profile.cache_key`: what a cached cost model is valid for, the same facts)
    the weights      sha256 over both models' weight files (`head_store.pair_fingerprint`) and the
                     learned head's tensors, if one is loaded
    the schedule     how N is chosen (pinned N, or adaptive up to `max_num_draft`), where undrafted
                     tokens are drawn from, the first token from the prefill or not; and with the
                     adaptive N, a digest of the start-up cost profile that seeded rows plan from
                     (`planner/draft_planner.py`): a restart loads a cached one unchanged (same
                     fingerprint, same seeded outputs), or measures it again without a cost cache
                     (a new fingerprint, as its seeded outputs may move). A pinned N keeps it (and
                     them) across restarts of the same config.

Whether the same fingerprint also means the same output whatever the batch depends on the dtype:
README, "Seeds" (float32 yes, as tested; bfloat16 no).
"""

from __future__ import annotations

import hashlib
import json

import torch

from server.engine.embedded.planner.cost_profile import cache_key
from server.engine.head_store import pair_fingerprint

PREFIX = "fp_"  # OpenAI's shape: "fp_" and a short hex digest


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _head_digest(head) -> str | None:
    if head is None:
        return None
    if isinstance(head, torch.nn.Module):
        h = hashlib.sha256()
        for name, tensor in sorted(head.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]
    return f"{type(head).__module__}.{getattr(head, '__qualname__', type(head).__qualname__)}"  # a callable


def system_fingerprint(models, config, profile) -> dict:
    """`{"system_fingerprint": "fp_…", "fingerprint_of": {...}}` for `EngineInfo.runtime`; `models`:
    the loaded pair (`models.Models`), `config`: the resolved `EmbeddedEngineConfig`, `profile`: the
    start-up cost model (`CostModel`) the planner was built on."""
    adaptive = config.num_draft is None
    parts = {
        "engine": "embedded",
        **cache_key(models),
        "weights": pair_fingerprint(config.target_path, config.draft_path)[:16],
        "head": _head_digest(models.head),
        "draft_length": "adaptive" if adaptive else config.num_draft,
        "max_num_draft": config.max_num_draft,
        "undrafted_from": "p" if config.p_when_undrafted else "nu",
        "first_token_from_prefill": config.first_token_from_prefill,
        "forced_tv": config.forced_tv,  # a bench's timing engine: its output follows no law
        "profile": _digest(profile.to_dict()["points"])[:16] if adaptive else None,
    }
    parts = json.loads(json.dumps(parts, default=str))  # JSON-ready, as `runtime` is served
    return {"system_fingerprint": PREFIX + _digest(parts)[:12], "fingerprint_of": parts}
