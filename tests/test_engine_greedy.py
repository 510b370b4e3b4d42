"""w = 1 with greedy decoding is exactly target-only greedy decoding, alone and batched.

Runs on the shipped embedded pair when `models/embedded` exists, otherwise on the tiny pair (never
skipped). The reference is HF `generate` (greedy) on the target alone, plus our autoregressive mode.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from server.engine.protocol import GenerationRequest, SamplingOptions
from verifier.dial import Verification

EMBEDDED = Path(__file__).resolve().parents[1] / "models" / "embedded"
PROMPTS = ["Tom has 12 apples", "def add(a, b):", "Summary: the council", "The quick brown fox"]


def near_draft(target: Path, out: Path, noise: float = 0.6, seed: int = 0) -> Path:
    """A draft that is the target with a perturbed LM head: it agrees often but not always, so
    rounds accept 0..N drafts and every cache rollback path runs (unlike two unrelated models)."""
    model = AutoModelForCausalLM.from_pretrained(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["pair", "near"])
def pair(request, tiny_pair, tmp_path_factory):
    if request.param == "near":
        target = Path(tiny_pair[0])
        return target, near_draft(target, tmp_path_factory.mktemp("near")), 40
    if (EMBEDDED / "target" / "config.json").exists() and (EMBEDDED / "draft" / "config.json").exists():
        return EMBEDDED / "target", EMBEDDED / "draft", 24
    return Path(tiny_pair[0]), Path(tiny_pair[1]), 40


async def _generate(engine, ids, mode, max_tokens, n=None):
    req = GenerationRequest(
        "r",
        tuple(ids),
        SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        Verification(mode=mode, weight=1.0, num_draft=n),
    )
    tokens, last = [], None
    async for chunk in engine.generate(req):
        tokens += chunk.token_ids
        last = chunk
    return tokens, last


def test_greedy_w1_equals_target_greedy(pair):
    target, draft, max_tokens = pair

    async def main():
        engine = EmbeddedEngine(
            EmbeddedEngineConfig(target, draft, num_draft=4, max_batch=4, max_context=512)
        )
        await engine.start()
        try:
            prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
            alone_ar = [(await _generate(engine, ids, "autoregressive", max_tokens))[0] for ids in prompts]
            alone_sd = [await _generate(engine, ids, "speculative", max_tokens) for ids in prompts]
            batched = await asyncio.gather(
                *[
                    _generate(engine, ids, "speculative", max_tokens, n)
                    for ids, n in zip(prompts, [4, 4, 2, 6], strict=True)
                ]
            )
            mixed = await asyncio.gather(  # speculative and autoregressive rows in the same steps
                *[
                    _generate(engine, ids, m, max_tokens)
                    for ids, m in zip(prompts, ["speculative", "autoregressive"] * 2, strict=True)
                ]
            )
            return prompts, alone_ar, alone_sd, batched, mixed
        finally:
            await engine.stop()

    prompts, alone_ar, alone_sd, batched, mixed = asyncio.run(main())
    if draft.parent.name.startswith("near"):  # the near draft must exercise partial acceptance
        per_pos = [sum(x) for x in zip(*(r[1].stats.accepted_per_position for r in alone_sd), strict=True)]
        assert 0 < per_pos[-1] < per_pos[0], per_pos
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                pad_token_id=0, min_new_tokens=max_tokens,
            )  # fmt: skip
        reference = out[0, len(ids) :].tolist()
        assert alone_ar[i] == reference, f"prompt {i}: autoregressive differs from HF greedy"
        assert alone_sd[i][0] == reference, f"prompt {i}: SD (w=1) alone differs"
        assert batched[i][0] == reference, f"prompt {i}: SD (w=1) batched differs"
        assert mixed[i][0] == reference, f"prompt {i}: mixed-mode batch differs"
        stats = alone_sd[i][1].stats
        assert stats.verify_steps >= 1 and stats.draft_tokens == 4 * stats.drafts
        assert alone_sd[i][1].finish_reason == "length" and alone_sd[i][1].completion_tokens == max_tokens
