"""What every task shares: the `Example` record, deterministic splits and the chat format.

Terms
    example     one chat prompt (a single user message) plus its reference completion.
    reference   the text a perfect model would write after `<|assistant|>\\n`; training targets are
                `reference + <|eos|>`. Scorers compare a model's completion against the example.
    split       "train", "dev" or "test". An example's split is a pure function of its prompt text
                (a hash), so the three splits are disjoint by construction and no generator can leak
                a test prompt into training however many examples it draws.
    seed        generation for (task, split, seed) is fully deterministic: same arguments, same list.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

SPLITS = ("train", "dev", "test")
# Per-mille of prompt-hash space per split. Test/dev are small slices of a huge space, so rejection
# sampling below stays cheap (most drawn prompts are train).
_SPLIT_BOUNDS = {"train": (0, 900), "dev": (900, 950), "test": (950, 1000)}


@dataclass(frozen=True)
class Example:
    task: str
    uid: str  # "<task>-<split>-<seed>-<index>", stable across runs
    prompt: str  # the user message
    reference: str  # the ideal completion (no eos)
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # answer / hidden tests

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]


def split_of(prompt: str) -> str:
    """The split a prompt belongs to, from a stable hash (independent of Python's hash seed)."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 1000
    for name, (lo, hi) in _SPLIT_BOUNDS.items():
        if lo <= bucket < hi:
            return name
    raise AssertionError("unreachable")


def generate_split(
    task: str, make_one: Callable[[random.Random], Example], split: str, n: int, seed: int = 0
) -> list[Example]:
    """`n` distinct examples of `task` whose prompts hash into `split`, drawn from one seeded RNG."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{task}:{split}:{seed}")
    out: list[Example] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise RuntimeError(f"{task}: could not draw {n} distinct {split} examples")
        ex = make_one(rng)
        if ex.prompt in seen or split_of(ex.prompt) != split:
            continue
        seen.add(ex.prompt)
        out.append(Example(task, f"{task}-{split}-{seed}-{len(out)}", ex.prompt, ex.reference, ex.meta))
    return out
