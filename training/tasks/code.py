"""`code`: a natural-language spec -> a small Python function (the project's MBPP stand-in).

Specs come from a family of templates (arithmetic maps, predicates, list and string helpers),
each with a few phrasings and random constants, so the model must map words and numbers to the
right expression. Every example carries hidden asserts computed from the reference solution.

Score: pass@1 -- 1.0 if the completion defines the function and passes every hidden assert when
run by `training.tasks.sandbox` (subprocess, timeout, no network, writes confined to a temp dir).
"""

from __future__ import annotations

import random

from training.tasks.base import Example
from training.tasks.sandbox import run_tests

FUNC_NAMES = ["f", "g", "h", "solve", "compute", "transform", "helper", "calc", "apply", "step", "fn", "go"]

# (phrasings, argument, body, python-callable builder, input maker). `{a}`, `{b}` are constants.
_FAMILIES = [
    (
        ["returns x * {a} + {b}", "returns x times {a} plus {b}", "multiplies x by {a} and adds {b}"],
        "x",
        "return x * {a} + {b}",
        lambda a, b: lambda x: x * a + b,
        lambda r: r.randint(-20, 20),
    ),
    (
        ["returns x - {a} but never less than {b}", "subtracts {a} from x with a floor of {b}"],
        "x",
        "return max(x - {a}, {b})",
        lambda a, b: lambda x: max(x - a, b),
        lambda r: r.randint(-20, 30),
    ),
    (
        ["returns True if x is divisible by {a}", "checks whether x is a multiple of {a}"],
        "x",
        "return x % {a} == 0",
        lambda a, b: lambda x: x % a == 0,
        lambda r: r.randint(0, 60),
    ),
    (
        [
            "returns the sum of the numbers in xs that are greater than {a}",
            "adds up every element of xs above {a}",
        ],
        "xs",
        "return sum(v for v in xs if v > {a})",
        lambda a, b: lambda xs: sum(v for v in xs if v > a),
        lambda r: [r.randint(0, 12) for _ in range(r.randint(0, 6))],
    ),
    (
        ["returns how many times {a} appears in the list xs", "counts the elements of xs equal to {a}"],
        "xs",
        "return xs.count({a})",
        lambda a, b: lambda xs: xs.count(a),
        lambda r: [r.randint(0, 9) for _ in range(r.randint(0, 8))],
    ),
    (
        ["returns the string s repeated {a} times", "repeats the string s {a} times"],
        "s",
        "return s * {a}",
        lambda a, b: lambda s: s * a,
        lambda r: r.choice(["ab", "x", "", "hey", "zz1"]),
    ),
    (
        ["returns the last {a} characters of the string s", "keeps only the final {a} characters of s"],
        "s",
        "return s[-{a}:]",
        lambda a, b: lambda s: s[-a:],
        lambda r: r.choice(["abcdefgh", "hello world", "xy", "python code"]),
    ),
    (
        ["returns a list of each element of xs plus {a}", "adds {a} to every number in xs"],
        "xs",
        "return [v + {a} for v in xs]",
        lambda a, b: lambda xs: [v + a for v in xs],
        lambda r: [r.randint(-5, 9) for _ in range(r.randint(0, 5))],
    ),
]


def make_one(rng: random.Random) -> Example:
    phrasings, arg, body, build, make_input = rng.choice(_FAMILIES)
    a, b = rng.randint(2, 12), rng.randint(0, 12)
    name = rng.choice(FUNC_NAMES)
    spec = rng.choice(phrasings).format(a=a, b=b)
    prompt = f"Write a Python function {name}({arg}) that {spec}."
    reference = f"def {name}({arg}):\n    {body.format(a=a, b=b)}"
    fn = build(a, b)
    inputs = []
    for _ in range(30):  # up to 4 distinct hidden inputs
        x = make_input(rng)
        if x not in inputs:
            inputs.append(x)
        if len(inputs) == 4:
            break
    tests = [f"assert {name}({x!r}) == {fn(x)!r}" for x in inputs]
    return Example("code", "", prompt, reference, {"tests": tests, "entry_point": name})


def extract_code(completion: str) -> str:
    """The program text: strips a ```python fence if the model wrote one."""
    text = completion.strip()
    if "```" in text:
        parts = text.split("```")
        text = parts[1] if len(parts) > 1 else text
        text = text.removeprefix("python").lstrip("\n")
    return text


def score(example: Example, completion: str, timeout_s: float = 3.0) -> float:
    """pass@1 of one completion: 1.0 when every hidden assert passes in the sandbox, else 0.0."""
    return float(run_tests(extract_code(completion), example.meta["tests"], timeout_s=timeout_s))
