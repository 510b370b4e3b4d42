"""Measure a trained pair: per-task test scores for both models, and speculative acceptance.

`score_pair(dir)` returns the dict the model card and `pair.json` are written from:
    scores[role][task]    mean test-split score (greedy, fp32) on the first `n` test examples
    slice                 per-example greedy math results on the first `SLICE_N` test problems,
                          which tests recompute exactly (see tests/test_embedded_pair.py)
    cost_ms[role]         ms per KV-cached one-token forward at batch 1 (target/draft cost ratio)
    acceptance            lossless (w = 1) speculative acceptance at T = 1, N = 5, per task and
                          pooled, from `training.spec_reference` on the first `accept_n` test prompts
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.data import encode
from training.evaluate import score_task
from training.spec_reference import AcceptanceStats, measure_acceptance
from training.tasks import TASKS, load

SLICE_N = 20
NUM_DRAFT = 5
SEED = 0


def load_model(path: Path):
    """Load in float32: bf16 storage, fp32 math, so greedy results do not hinge on bf16 rounding."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def math_slice(model, tokenizer) -> list[int]:
    """Greedy correctness (0/1) on the first SLICE_N math test problems, one batch."""
    examples = load("math", "test", SLICE_N, seed=SEED)
    return [int(s) for s in score_task(model, tokenizer, examples, batch=SLICE_N).scores]


@torch.no_grad()
def decode_step_ms(model, prompt_len: int = 64, steps: int = 10, repeats: int = 7) -> float:
    """Milliseconds per KV-cached one-token forward at batch 1 (what one draft step costs).

    Best of `repeats` timed runs: on a shared CPU other processes only ever add time, so the
    minimum is the least noisy estimate of the model's own cost.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(10, model.config.vocab_size, (1, prompt_len), generator=gen)
    y = x[:, -1:]
    best = float("inf")
    for _ in range(repeats):
        cache = model(input_ids=x, use_cache=True).past_key_values
        model(input_ids=y, past_key_values=cache, use_cache=True)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            model(input_ids=y, past_key_values=cache, use_cache=True)
        best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


def score_pair(pair_dir: Path, n: int = 200, accept_n: int = 60, log=print) -> dict:
    pair_dir = Path(pair_dir)
    tokenizer = AutoTokenizer.from_pretrained(pair_dir / "target")
    models = {role: load_model(pair_dir / role) for role in ("target", "draft")}
    result: dict = {"scores": {}, "slice": {}, "n": n, "accept_n": accept_n}
    for role, model in models.items():
        result["scores"][role] = {}
        for task in TASKS:
            t0 = time.time()
            ts = score_task(model, tokenizer, load(task, "test", n, seed=SEED))
            result["scores"][role][task] = round(ts.mean, 4)
            log(f"{role} {task}: {ts.mean:.4f} ({time.time() - t0:.0f}s)")
        result["slice"][role] = math_slice(model, tokenizer)
    per_task, total = {}, AcceptanceStats(0, 0, 0, 0)
    for task in TASKS:
        t0 = time.time()
        prompts = [e.prompt for e in encode(tokenizer, load(task, "test", accept_n, seed=SEED))]
        stats = measure_acceptance(
            models["target"],
            models["draft"],
            prompts,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            num_draft=NUM_DRAFT,
            temperature=1.0,
            seed=SEED,
        )
        per_task[task] = stats.as_dict()
        total = AcceptanceStats(
            *(getattr(total, f) + getattr(stats, f) for f in ("proposed", "accepted", "rounds", "emitted"))
        )
        log(f"acceptance {task}: {stats.rate:.4f} ({time.time() - t0:.0f}s)")
    # Wall-clock, so machine-dependent: the card reports it as "measured on the training box".
    result["cost_ms"] = {role: round(decode_step_ms(m), 3) for role, m in models.items()}
    result["acceptance"] = {
        "per_task": per_task,
        "overall": total.as_dict(),
        "temperature": 1.0,
        "num_draft": NUM_DRAFT,
        "weight": 1.0,
    }
    return result
