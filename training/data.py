"""Turn task examples into model inputs: chat-format prompt ids plus completion ids ending in eos.

Terms
    prompt ids      the chat template rendered with `add_generation_prompt=True`, i.e. exactly what
                    an engine feeds the model for a `/v1/chat/completions` request.
    completion ids  `reference` tokenized on its own, then `<|eos|>`. Tokenizing prompt and
                    completion separately matches inference, where generation starts at the
                    boundary.
    loss mask       training scores only completion tokens: the prompts are given at inference,
                    and every CPU-second spent modelling them is one not spent on the answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from training.tasks import Example


@dataclass(frozen=True)
class Encoded:
    prompt: list[int]
    completion: list[int]  # ends with eos


def prompt_text(tokenizer, example: Example) -> str:
    return tokenizer.apply_chat_template(example.messages(), add_generation_prompt=True, tokenize=False)


def encode(tokenizer, examples: list[Example]) -> list[Encoded]:
    prompts = tokenizer([prompt_text(tokenizer, e) for e in examples], add_special_tokens=False)
    comps = tokenizer([e.reference for e in examples], add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return [Encoded(p, c + [eos]) for p, c in zip(prompts["input_ids"], comps["input_ids"], strict=True)]


def collate(batch: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` (-100 outside completions)."""
    seqs = [e.prompt + e.completion for e in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (e, s) in enumerate(zip(batch, seqs, strict=True)):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
        labels[row, len(e.prompt) : len(s)] = torch.tensor(e.completion)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class MixtureSampler:
    """Endless batches drawn from per-task pools with fixed mixture weights, one task per batch.

    One task per batch keeps sequence lengths similar (little padding); a seeded RNG makes the
    batch sequence a pure function of the seed.
    """

    def __init__(self, pools: dict[str, list[Encoded]], weights: dict[str, float], batch: int, seed: int):
        self.pools, self.batch = pools, batch
        self.names = sorted(pools)
        self.weights = [weights[n] for n in self.names]
        self.rng = random.Random(seed)

    def __iter__(self):
        return self

    def __next__(self) -> list[Encoded]:
        task = self.rng.choices(self.names, self.weights)[0]
        return self.rng.sample(self.pools[task], self.batch)
