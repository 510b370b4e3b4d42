"""Prompt sources: the embedded pair's task-suite prompts, or a JSONL file.

    suite   `--prompts suite[:task,task]` (default: all of math, summary, code): `n` prompts per
            task from the task suite's test split as shipped beside the embedded pair
            (`models/embedded/prompts.jsonl`, written by `dialspec pair prompts`), interleaved
            (math, summary, code, math, ...), each sent as one user message. A non-zero seed
            picks a different deterministic sample of that file.
    JSONL   `--prompts FILE.jsonl`: one JSON object per line with either `"prompt": "text"` or
            `"messages": [{"role": ..., "content": ...}, ...]`, optionally `"max_tokens": int`
            (overrides `--max-tokens` for that prompt). Blank lines are skipped.

Requests cycle through the prompts in order, so a run longer than the prompt list reuses them.
This package talks to servers over HTTP only: the suite is read as a data file, not imported.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SUITE_FILE = Path(__file__).resolve().parent.parent / "models" / "embedded" / "prompts.jsonl"


class PromptError(ValueError):
    """The prompt source cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class Prompt:
    uid: str
    messages: tuple[dict, ...]  # chat form
    max_tokens: int | None = None

    @property
    def text(self) -> str:
        """Completion-endpoint form: the user turns joined (no chat template)."""
        return "\n".join(str(m.get("content", "")) for m in self.messages)


def load_suite(tasks: list[str] | None, n: int, seed: int, path: Path = SUITE_FILE) -> list[Prompt]:
    """`n` prompts of each task from the suite file, interleaved; seed 0 takes them in file order."""
    if not path.is_file():
        raise PromptError(f"the task-suite prompts ({path}) are missing; use --prompts FILE.jsonl")
    by_task: dict[str, list[Prompt]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            prompt = Prompt(obj["uid"], ({"role": "user", "content": obj["prompt"]},))
            by_task.setdefault(obj["task"], []).append(prompt)
    names = tasks or sorted(by_task)
    unknown = [t for t in names if t not in by_task]
    if unknown:
        raise PromptError(f"unknown suite task {unknown[0]!r}; choose from {', '.join(sorted(by_task))}")
    short = [t for t in names if len(by_task[t]) < n]
    if short:
        raise PromptError(f"the suite has {len(by_task[short[0]])} {short[0]} prompts, fewer than {n}")
    per_task = [by_task[t] if seed == 0 else random.Random(seed).sample(by_task[t], n) for t in names]
    return [examples[i] for i in range(n) for examples in per_task]


def load_jsonl(path: Path) -> list[Prompt]:
    """Prompts from a JSONL file (format in the module docstring)."""
    if not path.is_file():
        raise PromptError(
            f"prompt file {path} does not exist; pass --prompts suite or an existing .jsonl file"
        )
    out: list[Prompt] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(
                    f"{where} is not valid JSON ({exc.msg}); one JSON object per line"
                ) from None
            if not isinstance(obj, dict):
                raise PromptError(f"{where} must be a JSON object with 'prompt' or 'messages'")
            if isinstance(obj.get("messages"), list) and obj["messages"]:
                msgs = obj["messages"]
                if not all(isinstance(m, dict) and "content" in m for m in msgs):
                    raise PromptError(f"{where}: every message needs 'role' and 'content'")
                messages = tuple({"role": m.get("role", "user"), "content": m["content"]} for m in msgs)
            elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
                messages = ({"role": "user", "content": obj["prompt"]},)
            else:
                raise PromptError(f"{where} needs a non-empty 'prompt' string or 'messages' list")
            max_tokens = obj.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise PromptError(f"{where}: max_tokens must be a positive integer")
            out.append(Prompt(str(obj.get("id", f"line-{lineno}")), messages, max_tokens))
    if not out:
        raise PromptError(f"prompt file {path} holds no prompts")
    return out


def load_prompts(spec: str, n: int, seed: int) -> list[Prompt]:
    """`suite`, `suite:math,code`, or a path to a JSONL file."""
    if spec == "suite" or spec.startswith("suite:"):
        tasks = [t.strip() for t in spec.partition(":")[2].split(",") if t.strip()] or None
        return load_suite(tasks, n, seed)
    return load_jsonl(Path(spec))
