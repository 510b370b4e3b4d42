"""HF transformers baselines on the same requests: target-only `generate` and assisted generation."""

from __future__ import annotations

import time


def hf_run(target, draft, tok, prompts, max_tokens, temperature, num_draft, weight=None) -> tuple[int, float]:
    import torch

    sample = (
        dict(do_sample=temperature > 0, temperature=temperature) if temperature > 0 else {"do_sample": False}
    )
    common = dict(
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=tok.pad_token_id, **sample
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        if draft is None:  # batched target-only
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            target.generate(**enc.to(target.device), **common)
        else:  # assisted generation is batch-1 only: run sequentially
            for p in prompts:
                enc = tok([p], return_tensors="pt", add_special_tokens=False).to(target.device)
                extra = {"assistant_ensemble_weight": weight} if weight is not None else {}
                target.generate(
                    **enc, assistant_model=draft, num_assistant_tokens=num_draft,
                    num_assistant_tokens_schedule="constant", **extra, **common,
                )  # fmt: skip
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return max_tokens * len(prompts), time.perf_counter() - t0
