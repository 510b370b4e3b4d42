"""Prompt sources: the embedded task suite (`training.tasks`) or a JSONL file.

    suite   `--prompts suite[:task,task]` (default: all of math, summary, code): `n` test-split
            examples per task, generated deterministically from the seed and interleaved
            (math, summary, code, math, ...), sent as one user message each.
    JSONL   `--prompts FILE.jsonl`: one JSON object per line with either `"prompt": "text"` or
            `"messages": [{"role": ..., "content": ...}, ...]`, optionally `"max_tokens": int`
            (overrides `--max-tokens` for that prompt). Blank lines are skipped.

Requests cycle through the prompts in order, so a run longer than the prompt list reuses them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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


def load_suite(tasks: list[str] | None, n: int, seed: int) -> list[Prompt]:
    """`n` test-split examples of each task from the embedded suite, interleaved."""
    try:
        from training import tasks as suite
    except ImportError:  # pragma: no cover - only in a checkout without training/
        raise PromptError(
            "the embedded task suite (training/tasks) is not available; use --prompts FILE.jsonl"
        ) from None
    names = tasks or sorted(suite.TASKS)
    unknown = [t for t in names if t not in suite.TASKS]
    if unknown:
        raise PromptError(f"unknown suite task {unknown[0]!r}; choose from {', '.join(sorted(suite.TASKS))}")
    per_task = [suite.load(t, "test", n, seed) for t in names]
    out: list[Prompt] = []
    for i in range(n):
        for examples in per_task:
            ex = examples[i]
            out.append(Prompt(ex.uid, tuple(ex.messages())))
    return out


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
