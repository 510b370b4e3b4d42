"""The generated task suite: determinism, disjoint splits, and each scorer on known answers."""

from __future__ import annotations

import time

import pytest

from training.tasks import SPLITS, TASKS, load, score, split_of
from training.tasks.code import extract_code
from training.tasks.math import extract_answer
from training.tasks.sandbox import run_tests


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generation_is_deterministic_per_seed(task):
    a, b = load(task, "test", 20, seed=3), load(task, "test", 20, seed=3)
    assert [(e.prompt, e.reference, e.meta) for e in a] == [(e.prompt, e.reference, e.meta) for e in b]
    other = load(task, "test", 20, seed=4)
    assert [e.prompt for e in a] != [e.prompt for e in other]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_and_hash_assigned(task):
    prompts = {s: {e.prompt for e in load(task, s, 150 if s == "train" else 40)} for s in SPLITS}
    for s, ps in prompts.items():
        assert len(ps) == (150 if s == "train" else 40)  # distinct within a split
        assert all(split_of(p) == s for p in ps)
    assert not prompts["train"] & prompts["dev"]
    assert not prompts["train"] & prompts["test"]
    assert not prompts["dev"] & prompts["test"]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_reference_scores_full_marks(task):
    for e in load(task, "dev", 15):
        assert score(e, e.reference) == pytest.approx(1.0)


def test_math_format_and_scorer():
    e = load("math", "test", 1)[0]
    assert e.reference.splitlines()[-1] == f"#### {e.meta['answer']}"
    assert 0 <= e.meta["answer"] <= 60
    right = f"some steps\n#### {e.meta['answer']}"
    wrong = f"#### {e.meta['answer'] + 1}"
    assert score(e, right) == 1.0
    assert score(e, wrong) == 0.0
    assert score(e, "no final answer line") == 0.0
    # The last `####` counts, as in GSM8K.
    assert score(e, f"#### {e.meta['answer'] + 1}\n#### {e.meta['answer']}") == 1.0
    assert extract_answer("#### -3") == -3


def test_summary_rouge2():
    e = load("summary", "test", 1)[0]
    assert score(e, "completely unrelated words here") == 0.0
    half = " ".join(e.reference.split()[: len(e.reference.split()) // 2])
    assert 0.0 < score(e, half) < 1.0


def test_code_pass_and_fail():
    e = load("code", "test", 1)[0]
    name = e.meta["entry_point"]
    assert score(e, e.reference) == 1.0
    assert score(e, f"```python\n{e.reference}\n```") == 1.0  # fenced code is unwrapped
    assert score(e, f"def {name}(*a):\n    return None") == 0.0  # wrong answer
    assert score(e, "def broken(:\n") == 0.0  # syntax error
    assert score(e, f"def {name}(*a):\n    raise ValueError('no')") == 0.0  # raises
    assert extract_code("```python\nx = 1\n```") == "x = 1\n"


def test_sandbox_kills_infinite_loops_quickly():
    start = time.monotonic()
    assert run_tests("def f(x):\n    while True:\n        pass", ["assert f(1) == 1"], timeout_s=1.0) is False
    assert time.monotonic() - start < 5


def test_sandbox_blocks_network_subprocess_and_outside_writes(tmp_path):
    outside = tmp_path / "pwned.txt"
    assert not run_tests(f"open({str(outside)!r}, 'w').write('x')", [])
    assert not outside.exists()
    assert not run_tests("import socket\nsocket.socket().connect(('127.0.0.1', 9))", [])
    assert not run_tests("import subprocess\nsubprocess.run(['true'])", [])
    assert not run_tests("import os\nos.system('true')", [])
    # Writing inside the sandbox's own temp dir (its cwd) is allowed.
    assert run_tests("open('scratch.txt', 'w').write('ok')", ["assert open('scratch.txt').read() == 'ok'"])
