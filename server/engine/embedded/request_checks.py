"""What the embedded engine refuses before a row exists. The engine is also an API for direct Python
callers (training, evaluation, the bench), so it checks what the gateway checked too: the sampling
options, the prompt's ids and length, what the request asks of the pair (a head, log-probs, a
grammar) and its `Verification`'s ranges (`Verification.validate`, their one owner).
"""

from __future__ import annotations

from server.engine.protocol import (
    EngineError,
    GenerationRequest,
    SamplingOptions,
    check_sampling,
    logprobs_refusal,
)
from verifier.dial import DialError


def checked_sampling(
    request: GenerationRequest,
    *,
    vocab_size: int,
    max_context: int,
    max_num_draft: int,
    has_head: bool,
    structured_output: bool,
    forced_tv: float | None,
) -> SamplingOptions:
    """`request.sampling` normalised (`check_sampling`), or EngineError 'invalid_request' saying
    why the engine cannot serve `request`."""
    try:
        sampling = check_sampling(request.sampling, vocab_size)
    except ValueError as exc:
        raise EngineError(str(exc), "invalid_request") from None
    bad = _refusal(request, sampling, vocab_size, max_context, has_head, forced_tv)
    if not bad and request.response_format is not None and not structured_output:
        bad = "response_format needs xgrammar: install dialspec[structured]"
    else:
        try:  # a Verification out of range is reported over the problems above
            request.verify.validate(max_num_draft)
        except DialError as exc:
            bad = str(exc)
    if bad:
        raise EngineError(bad, "invalid_request")
    return sampling


def _refusal(
    request: GenerationRequest,
    sampling: SamplingOptions,
    vocab_size: int,
    max_context: int,
    has_head: bool,
    forced_tv: float | None,
) -> str | None:
    """The first problem with the prompt, the length or what the request asks of the pair, or None."""
    prompt = request.prompt_token_ids
    if not prompt:
        return "prompt is empty"
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        return f"prompt token ids must be integers in [0, {vocab_size})"
    if len(prompt) + sampling.max_tokens > max_context:
        return (
            f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds this engine's "
            f"max_context of {max_context} tokens; shorten the prompt or lower max_tokens"
        )
    if request.verify.learned and not has_head:
        return "learned weights requested but this engine has no weight head loaded"
    if request.logprobs is None:
        return None
    if forced_tv is not None:
        return "logprobs: this engine forces acceptance for timing (forced_tv); its tokens follow no law"
    return logprobs_refusal(request.logprobs, request.verify)
