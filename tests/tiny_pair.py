"""A tiny random-init draft/target pair for fast tests (the real embedded pair is much larger).

Both models are `LlamaForCausalLM` in HF format sharing one byte-level BPE tokenizer with a chat
template, so they load through the same code path as any real pair. Deterministic per seed.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from training.tokenizer import train_tokenizer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9.",
    "Tom has 12 apples and buys 7 more. How many apples? 12 + 7 = 19. #### 19",
    "def add(a, b):\n    return a + b\n",
    "Summary: the council approved a budget of 45 million on Monday. Ünïcödé ✓ 日本語",
]


def make_tokenizer(out_dir: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """The embedded pair's tokenizer recipe (digits split, same specials and chat template), trained
    on a tiny corpus."""
    tok = train_tokenizer(_CORPUS * 4, vocab_size=vocab_size)
    tok.save_pretrained(out_dir)
    return tok


def _save_model(out_dir: Path, tokenizer, seed: int, hidden: int, layers: int, heads: int, kv_heads: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper-than-default logits so p and q differ visibly
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def make_tiny_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write `root/target` and `root/draft`; returns their paths."""
    root = Path(root)
    tok = make_tokenizer(root / "tokenizer")
    target, draft = root / "target", root / "draft"
    _save_model(target, tok, seed, hidden=64, layers=2, heads=4, kv_heads=2)
    _save_model(draft, tok, seed + 1, hidden=32, layers=1, heads=2, kv_heads=1)
    (root / "pair.json").write_text(json.dumps({"name": "tiny-pair", "seed": seed}))
    return target, draft


def drafting_costs(max_batch: int, max_n: int):
    """A cost model (`planner.set_cost`) under which the planner's choice of N moves with a row's
    acceptance and with the batch: one row drafts from β ≈ 0.7 up (a draft step half the target's
    forward), and verification grows with rows × positions, so larger batches draft less. The tiny
    pair's own measured costs may make drafting never pay, which would leave N nothing to vary."""
    from server.engine.embedded.planner.cost_model import CostModel

    model = CostModel()
    for r in range(1, max_batch + 1):
        model.set("draft", r, 1, 2.2e-3)
        for t in range(1, max_n + 2):
            model.set("score", r, t, 4e-3 + 6e-4 * r * t)
    return model


@contextlib.contextmanager
def fixed_and_adaptive(pair, **config):
    """Two started embedded engines on `pair` with `config`: {"fixed": N = 3 (strict ν: every
    position drafted or drawn from ν), "adaptive": the default adaptive N under `drafting_costs`,
    seeded rows planned as for one row (so it drafts; bonuses and N = 0 rounds from p, quality 0
    draft-only)}; stopped on exit."""
    import asyncio

    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    engines = {
        "fixed": EmbeddedEngine(EmbeddedEngineConfig(*pair, num_draft=3, **config)),
        "adaptive": EmbeddedEngine(EmbeddedEngineConfig(*pair, num_draft=None, **config)),
    }
    for eng in engines.values():
        eng.start_sync()
    adaptive = engines["adaptive"]
    planner = adaptive.scheduler.models.planner
    planner.set_cost(drafting_costs(adaptive.config.max_batch, adaptive.config.max_num_draft))
    # Seeded rows are planned for a full batch, where this cost model never drafts: as for one row,
    # so that the seeded requests these tests send draft and the drafted paths are exercised.
    planner.alone_batch = 1
    try:
        yield engines
    finally:
        for eng in engines.values():
            asyncio.run(eng.stop())
