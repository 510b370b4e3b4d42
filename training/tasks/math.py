"""`math`: 2-3 step arithmetic word problems (the project's GSM8K stand-in).

A problem tracks one quantity through events (buying, finding, giving away, eating...). Numbers
have 1-2 digits; every operand is 1-9 and every running total stays in [0, 60], so the solution
needs digit-level addition/subtraction with carries but no long multiplication -- learnable by a
few-million-parameter model in minutes, while a much smaller draft stays visibly worse.

Reference format (one line per step, then the answer line GSM8K uses):
    12 + 7 = 19
    19 - 5 = 14
    #### 14
Score: exact match of the integer after the last `####` (1.0 or 0.0).
"""

from __future__ import annotations

import random
import re

from training.tasks.base import Example

NAMES = ["Tom", "Ana", "Ben", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Raj", "Kim"]
ITEMS = ["apples", "coins", "books", "stamps", "cards", "shells", "pens", "marbles", "eggs", "cups"]
GAINS = ["buys {n} more", "finds {n} more", "gets {n} from a friend", "wins {n} more"]
LOSSES = ["gives away {n}", "loses {n}", "sells {n}", "uses {n}"]
_MAX_TOTAL = 60
_ANSWER = re.compile(r"####\s*(-?\d+)")


def make_one(rng: random.Random) -> Example:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(5, 40)
    sentences = [f"{name} has {total} {item}."]
    lines = []
    for step in range(rng.choice((2, 3))):
        n = rng.randint(1, 9)
        # Gains are impossible near the cap and losses below n; otherwise a fair coin.
        gain = total + n <= _MAX_TOTAL and (total - n < 0 or rng.random() < 0.5)
        verb = rng.choice(GAINS if gain else LOSSES).format(n=n)
        lead = "Then" if step else "First"
        sentences.append(f"{lead} {name} {verb}.")
        new = total + n if gain else total - n
        lines.append(f"{total} {'+' if gain else '-'} {n} = {new}")
        total = new
    sentences.append(f"How many {item} does {name} have now?")
    lines.append(f"#### {total}")
    return Example("math", "", " ".join(sentences), "\n".join(lines), {"answer": total})


def extract_answer(completion: str) -> int | None:
    """The integer after the last `####`, or None when the completion has no final answer."""
    found = _ANSWER.findall(completion)
    return int(found[-1]) if found else None


def score(example: Example, completion: str) -> float:
    """Exact final answer: 1.0 if the last `#### <n>` equals the reference answer, else 0.0."""
    return float(extract_answer(completion) == example.meta["answer"])
