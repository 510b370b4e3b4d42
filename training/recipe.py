"""The embedded pair's training recipe: tokenizer, then draft and target, each from scratch.

Both models are `LlamaForCausalLM` trained on the same generated task mixture with the same
tokenizer; they differ only in size and training budget, which is what makes the target
measurably stronger than the draft (the gap speculative decoding exploits).

Schedule: linear warmup, then cosine decay. Progress is `max(step / max_steps, elapsed / budget)`,
so on a fast machine the run is step-deterministic and on a slow or shared one it still ends, with
the learning rate annealed, inside its wall-clock budget (`minutes`).

Run: `dialspec pair train --out models/embedded` (or `python -m training.recipe`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import LlamaConfig, LlamaForCausalLM

from training.data import MixtureSampler, collate, encode
from training.tasks import load
from training.tokenizer import save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one model (GQA Llama; embeddings tied to save parameters)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    max_positions: int = 256

    def config(self, tokenizer) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )


@dataclass(frozen=True)
class TrainSpec:
    """Optimisation of one model. `minutes` is a wall-clock budget, `max_steps` the nominal length."""

    max_steps: int
    minutes: float
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0


DRAFT_STEPS = 1100  # see the draft_train comment below


@dataclass(frozen=True)
class RecipeConfig:
    seed: int = 0
    # One intra-op thread: these matmuls are tiny, and on a shared 2-core box OpenMP barriers made
    # 2 threads ~7x slower per step than 1 (measured: 4.7 s vs 0.67 s for a 1.8M model).
    threads: int = 1
    vocab_size: int = 1024
    pool: dict = field(default_factory=lambda: {"math": 40000, "summary": 20000, "code": 8000})
    # Math gets the most updates: carrying digits is the slowest skill to learn; summaries and
    # code are mostly slot copying.
    mixture: dict = field(default_factory=lambda: {"math": 0.6, "summary": 0.2, "code": 0.2})
    target: ModelSpec = ModelSpec(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688)
    draft: ModelSpec = ModelSpec(layers=2, hidden=96, heads=4, kv_heads=2, ffn=256)
    # Measured on the shared 2-core box: lr 3e-3 made the 3M target plateau (loss ~0.95 at step
    # 450); 1e-3 reached 0.37. Multi-digit arithmetic "clicks" only after ~1000-1500 steps, so
    # the target's budget is mostly step count.
    target_train: TrainSpec = TrainSpec(max_steps=2400, minutes=44.0, lr=1e-3, warmup=100)
    # The draft is deliberately short-trained: at 1400 steps it already solves ~99% of `code`
    # (no quality gap left for speculative decoding to matter); at DRAFT_STEPS it is clearly weaker
    # on every task while still agreeing with the target on most template tokens.
    draft_train: TrainSpec = TrainSpec(max_steps=DRAFT_STEPS, minutes=14.0, lr=3e-3, warmup=60)


def _lr_factor(progress: float, step: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_model(
    model, sampler, spec: TrainSpec, pad_id: int, label: str, log, ckpt: Path | None = None
) -> dict:
    """Train in place; returns a summary (steps, tokens, final loss, seconds).

    With `ckpt`, the model is also saved there every 200 steps so a long run can be evaluated
    (and salvaged) while it is still going.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    model.train()
    start, tokens, ema, step = time.time(), 0, None, 0
    budget = spec.minutes * 60
    columns = [
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns) as bar:
        task = bar.add_task(label, total=1000, info="")
        while True:
            progress = max(step / spec.max_steps, (time.time() - start) / budget)
            if progress >= 1.0:
                break
            for group in opt.param_groups:
                group["lr"] = spec.lr * _lr_factor(progress, step, spec.warmup)
            batch = collate(next(sampler), pad_id)
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += int(batch["attention_mask"].sum())
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            step += 1
            info = f"step {step} loss {ema:.3f}"
            bar.update(task, completed=int(progress * 1000), info=info)
            if step % 50 == 0:
                log(f"{label} {info} tokens {tokens} elapsed {time.time() - start:.0f}s")
            if ckpt is not None and step % 200 == 0:
                model.save_pretrained(ckpt)
    model.eval()
    return {
        "steps": step,
        "tokens": tokens,
        "final_loss": round(ema, 4),
        "seconds": round(time.time() - start),
    }


def build_data(cfg: RecipeConfig, log):
    """Tokenizer trained on the train split, and the encoded per-task training pools."""
    pools = {t: load(t, "train", n, seed=cfg.seed) for t, n in cfg.pool.items()}
    texts = [s for exs in pools.values() for e in exs[:4000] for s in (e.prompt, e.reference)]
    tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size)
    log(f"tokenizer: {len(tokenizer)} tokens")
    return tokenizer, {t: encode(tokenizer, exs) for t, exs in pools.items()}


def train_role(role: str, cfg: RecipeConfig, tokenizer, pools, out_dir: Path, log) -> dict:
    """Train the `role` ("draft" or "target") model and save it as a bf16 HF dir with tokenizer."""
    spec = cfg.target if role == "target" else cfg.draft
    tspec = cfg.target_train if role == "target" else cfg.draft_train
    torch.manual_seed(cfg.seed + (0 if role == "target" else 1))
    model = LlamaForCausalLM(spec.config(tokenizer))
    params = sum(p.numel() for p in model.parameters())
    log(f"{role}: {params / 1e6:.2f}M parameters")
    sampler = MixtureSampler(pools, cfg.mixture, tspec.batch, seed=cfg.seed + 17)
    ckpt = Path(out_dir) / f"{role}-checkpoint"
    summary = train_model(model, sampler, tspec, tokenizer.pad_token_id, role, log, ckpt)
    summary["parameters"] = params
    dest = Path(out_dir) / role
    model.to(torch.bfloat16).save_pretrained(dest)
    save_tokenizer(tokenizer, dest)
    (dest / "training.json").write_text(
        json.dumps({"spec": asdict(spec), "train": asdict(tspec), **summary}, indent=1)
    )
    if ckpt.exists():  # the mid-run checkpoint is superseded by the final weights
        shutil.rmtree(ckpt)
    log(f"{role}: saved to {dest} ({summary})")
    return summary


def default_log_file(out_dir: Path):
    path = Path(out_dir) / "train.log"
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with path.open("a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    return log


def run(out_dir: Path, cfg: RecipeConfig = RecipeConfig(), roles=("draft", "target")) -> dict:
    """The whole recipe, training only: `training.scorecard.score_pair` evaluates the pair and
    `training.model_card` writes its card."""
    torch.set_num_threads(cfg.threads)
    log = default_log_file(out_dir)
    tokenizer, pools = build_data(cfg, log)
    return {role: train_role(role, cfg, tokenizer, pools, out_dir, log) for role in roles}


if __name__ == "__main__":
    import sys

    run(Path(sys.argv[1]), roles=tuple(sys.argv[2:]) or ("draft", "target"))
