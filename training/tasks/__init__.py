"""dialspec's generated three-task suite: `math`, `summary`, `code` (GSM8K / CNNDM / MBPP stand-ins).

`TASKS[name]` is a `Task(name, make_one, score)`; `load(task, split, n, seed)` returns a
deterministic list of `Example`s; `score(example, completion)` dispatches to the task's scorer.
Training and evaluation both use these functions, so the numbers in the model card are the
numbers the recipe optimised against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from training.tasks import code, math, summary
from training.tasks.base import SPLITS, Example, generate_split, split_of


@dataclass(frozen=True)
class Task:
    name: str
    make_one: Callable
    score: Callable[[Example, str], float]
    metric: str  # what `score` means, for reports


TASKS: dict[str, Task] = {
    "math": Task("math", math.make_one, math.score, "exact answer accuracy"),
    "summary": Task("summary", summary.make_one, summary.score, "ROUGE-2 F1"),
    "code": Task("code", code.make_one, code.score, "pass@1"),
}


def load(task: str, split: str, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of `task` from `split`, deterministic in (task, split, n, seed)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    return generate_split(task, TASKS[task].make_one, split, n, seed)


def score(example: Example, completion: str) -> float:
    return TASKS[example.task].score(example, completion)


__all__ = ["SPLITS", "TASKS", "Example", "Task", "load", "score", "split_of"]
