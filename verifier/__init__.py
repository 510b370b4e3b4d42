"""dialspec's verifier: pure functions for ensemble (DIVERSED) speculative verification.

    verify(target_probs, draft_probs, draft_tokens, weights, ...)   chain.py: the batched rule
    ensemble_mix(p, q, w)                                            policies.py: ν = w·p + (1−w)·q
    PolicyKind, Verification, resolve, ...                           dial.py: what quality means
    WeightHead                                                       head.py: the learned w_t

No I/O and no model code lives here; engines call these functions on CPU or CUDA tensors.
`verifier.dial` is torch-free, so the torch modules load lazily: importing `verifier.dial` (the
gateway does) does not import torch.
"""

from __future__ import annotations

import importlib

from verifier.dial import PolicyKind

_LAZY = {
    "PAD_TOKEN": "verifier.chain",
    "VerifyResult": "verifier.chain",
    "verify": "verifier.chain",
    "Policy": "verifier.policies",
    "PolicyBatch": "verifier.policies",
    "ensemble_mix": "verifier.policies",
    "logits_to_probs": "verifier.sampling",
    "pick_tokens": "verifier.sampling",
    "sample_inverse_cdf": "verifier.sampling",
    "acceptance_rate_from_length": "verifier.theory",
    "cost_model_speedup": "verifier.theory",
    "ensemble_bias": "verifier.theory",
    "expected_acceptance": "verifier.theory",
    "expected_accepted_length": "verifier.theory",
    "expected_accepted_length_constant": "verifier.theory",
    "tokens_per_target_forward": "verifier.theory",
    "tv_distance": "verifier.theory",
    "tv_estimates": "verifier.theory",
}

__all__ = ["PolicyKind", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verifier' has no attribute {name!r}")
