"""dialspec's verifier: pure tensor functions for ensemble (DIVERSED) speculative verification.

Entry point: `verify(target_probs, draft_probs, draft_tokens, weights, ...)` — see its docstring.
No I/O and no model code lives here; engines call these functions on CPU or CUDA tensors.
"""

from verifier.chain import PAD_TOKEN, VerifyResult, verify
from verifier.policies import Policy, PolicyBatch, PolicyKind
from verifier.sampling import logits_to_probs, sample_inverse_cdf
from verifier.theory import (
    acceptance_rate_from_length,
    cost_model_speedup,
    ensemble_bias,
    expected_acceptance,
    expected_accepted_length,
    expected_accepted_length_constant,
    tokens_per_target_forward,
    tv_distance,
)

__all__ = [
    "PAD_TOKEN",
    "Policy",
    "PolicyBatch",
    "PolicyKind",
    "VerifyResult",
    "acceptance_rate_from_length",
    "cost_model_speedup",
    "ensemble_bias",
    "expected_acceptance",
    "expected_accepted_length",
    "expected_accepted_length_constant",
    "logits_to_probs",
    "sample_inverse_cdf",
    "tokens_per_target_forward",
    "tv_distance",
    "verify",
]
