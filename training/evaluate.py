"""Score a model on the task suite: batched greedy generation, then each task's own scorer.

Generation is greedy (temperature 0) in float32 with a fixed batch composition, so the same
weights give the same completions on every run of this code on one machine; on a different CPU,
float reductions may differ in the last bits, which can flip an argmax only at near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.data import prompt_text
from training.tasks import Example, score


@dataclass(frozen=True)
class TaskScore:
    task: str
    n: int
    mean: float
    scores: tuple[float, ...]  # per example, in input order

    def as_dict(self) -> dict:
        return {"task": self.task, "n": self.n, "mean": round(self.mean, 4)}


@torch.no_grad()
def greedy_complete(
    model, tokenizer, examples: list[Example], max_new_tokens: int = 64, batch: int = 32
) -> list[str]:
    """Greedy completions (special tokens stripped) for each example's chat prompt."""
    tokenizer.padding_side = "left"  # generation appends on the right
    out: list[str] = []
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        enc = tokenizer(
            [prompt_text(tokenizer, e) for e in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = gen[:, enc["input_ids"].shape[1] :]
        out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return out


def score_task(model, tokenizer, examples: list[Example], **gen_kwargs) -> TaskScore:
    completions = greedy_complete(model, tokenizer, examples, **gen_kwargs)
    scores = tuple(score(e, c) for e, c in zip(examples, completions, strict=True))
    return TaskScore(examples[0].task, len(examples), sum(scores) / len(scores), scores)
