"""Write the shipped pair's metadata: `pair.json`, `MODEL_CARD.md` and `SHA256SUMS`.

Everything in the card is read from the training summaries (`<role>/training.json`) and from a
`training.scorecard.score_pair` result, so the card cannot drift from what was measured.
"""

from __future__ import annotations

import json
from pathlib import Path

from server.engine.model_pair import write_checksums
from training.scorecard import NUM_DRAFT, SLICE_N
from training.tasks import TASKS

PAIR_NAME = "dialspec-embedded"


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 1e6


def write_pair_files(pair_dir: Path, scores: dict) -> dict:
    pair_dir = Path(pair_dir)
    train = {r: json.loads((pair_dir / r / "training.json").read_text()) for r in ("target", "draft")}
    meta = {
        "name": PAIR_NAME,
        "num_draft": NUM_DRAFT,
        "target_params": train["target"]["parameters"],
        "draft_params": train["draft"]["parameters"],
        "dtype": "bfloat16",
        "scores": scores["scores"],
        "acceptance": scores["acceptance"]["overall"]["acceptance"],
        "slice": {"task": "math", "n": SLICE_N, **scores["slice"]},
    }
    (pair_dir / "pair.json").write_text(json.dumps(meta, indent=1) + "\n")
    (pair_dir / "MODEL_CARD.md").write_text(render_card(pair_dir, meta, train, scores))
    write_checksums(pair_dir)
    return meta


def render_card(pair_dir: Path, meta: dict, train: dict, scores: dict) -> str:
    """The card's markdown: each section from the measurements it reports."""
    return "\n".join(
        [
            _intro(meta),
            _models(pair_dir, meta, train, scores.get("cost_ms")),
            _DATA,
            _scores(meta, scores),
            _acceptance(scores),
            _provenance(train),
            _REPRODUCE,
        ]
    )


def _intro(meta: dict) -> str:
    return f"""# {meta["name"]} — dialspec's embedded draft/target pair

A from-scratch `LlamaForCausalLM` pair (bf16 safetensors, one shared byte-level BPE tokenizer with
digits split individually, chat template `<|user|>\\n...\\n<|assistant|>\\n`, completions end with
`<|eos|>`) trained on dialspec's generated three-task suite. It exists so that dialspec runs,
and is measured, with no GPU and no model hub. It is a toy: it knows only these task formats.
"""


def _models(pair_dir: Path, meta: dict, train: dict, cost: dict | None) -> str:
    cost = cost or {"target": float("nan"), "draft": float("nan")}

    def arch(role: str) -> str:
        sp, tr = train[role]["spec"], train[role]
        return (
            f"| {role} | {tr['parameters'] / 1e6:.2f}M | {sp['layers']} | {sp['hidden']} | "
            f"{sp['heads']}/{sp['kv_heads']} | {sp['ffn']} | {tr['steps']} | {tr['tokens'] / 1e6:.2f}M | "
            f"{tr['final_loss']:.3f} | {tr['seconds'] / 60:.1f} min | {_size_mb(pair_dir / role):.1f} MB |"
        )

    return f"""## Models

| role | params | layers | hidden | heads/kv | ffn | steps | train tokens | final loss | train time | size |
|---|---|---|---|---|---|---|---|---|---|---|
{arch("target")}
{arch("draft")}

Draft/target parameter ratio: {meta["draft_params"] / meta["target_params"]:.3f}. Cost of one KV-cached
one-token forward at batch 1 (fp32, 1 thread, best of 7 runs on the training box): target
{cost["target"]:.2f} ms, draft {cost["draft"]:.2f} ms ({cost["target"] / cost["draft"]:.1f}x).
"""


_DATA = """## Data

`training/tasks/` generates every example from seeds; an example's split (train 90% / dev 5% /
test 5% of prompt-hash space) is a hash of its prompt, so splits are disjoint by construction.
- `math`: 2-3 step word problems, operands 1-9, totals 0-60, worked solution ending `#### <n>`.
- `summary`: news-like article (3 key facts + 2 numeric distractors, shuffled) -> one sentence.
- `code`: spec from 8 templated families -> a one-line Python function; 4 hidden asserts.
Training mixture math/summary/code = 0.6/0.2/0.2, loss on completion tokens only.
"""


def _scores(meta: dict, scores: dict) -> str:
    s = scores["scores"]
    rows = "\n".join(
        f"| {t} | {TASKS[t].metric} | {s['target'][t]:.3f} | {s['draft'][t]:.3f} |" for t in TASKS
    )
    return f"""## Scores (test split, first {scores["n"]} examples per task, greedy, fp32)

| task | metric | target | draft |
|---|---|---|---|
{rows}

Reproducibility slice (tests/test_embedded_pair.py): greedy on the first {SLICE_N} math test problems,
target {sum(meta["slice"]["target"])}/{SLICE_N}, draft {sum(meta["slice"]["draft"])}/{SLICE_N}.
"""


def _acceptance(scores: dict) -> str:
    acc = scores["acceptance"]
    rows = "\n".join(
        f"| {t} | {a['accepted']} / {a['proposed']} | {a['acceptance']:.3f} |"
        for t, a in acc["per_task"].items()
    )
    o = acc["overall"]
    return f"""## Speculative acceptance (lossless, w = 1, temperature 1, N = {NUM_DRAFT})

Measured with `training.spec_reference` (reference loop over `verifier.verify`) on the first
{scores["accept_n"]} test prompts per task; acceptance = accepted drafts / proposed drafts.

| task | accepted / proposed | acceptance |
|---|---|---|
{rows}
| **all** | {o["accepted"]} / {o["proposed"]} | **{o["acceptance"]:.3f}** |
"""


def _provenance(train: dict) -> str:
    t_steps, t_max = train["target"]["steps"], train["target"]["train"]["max_steps"]
    d_max = train["draft"]["train"]["max_steps"]
    return f"""## Provenance

Draft and target are independent (each seeded on its own; same tokenizer, which is
deterministic), so the recipe trains them one after the other while the shipped pair was trained
as two parallel processes on a shared 2-core CPU, one intra-op thread each. The target stopped on
its 44-minute wall-clock budget at step {t_steps} of {t_max}; the draft is step-bound
({d_max} steps) on purpose: trained to ~1400 steps it already passes ~99% of `code`, which would
leave no quality gap for speculative decoding to matter. Full retrain: about 50 minutes on 2 cores
(draft ~3-8 min, target <= 44 min, data and tokenizer ~1.5 min, scoring ~1 min); per-step logs
are in `train.log`.
"""


_REPRODUCE = """## Reproduce

    dialspec pair train --out models/embedded     # tokenizer + draft + target, then scores this card
    dialspec pair score --pair models/embedded    # re-measure scores and acceptance only

Training is seeded, but its schedule also respects a wall-clock budget (see `training/recipe.py`),
so a much slower or faster machine takes a different number of steps and lands on slightly
different scores. `SHA256SUMS` covers every file; `server.engine.model_pair.verify_pair()` checks it.
"""
