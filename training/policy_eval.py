"""The `dialspec eval` runs: every task x every verification policy on the embedded engine.

Terms
    policy        one row of the paper's Table 1: `ar` (target only), `sd` (lossless, w = 1),
                  `sd_lossy` (Leviathan lenience l), `cascade` (SpecCascade, α), `static` (the
                  ensemble at a fixed w, swept), `learned` (the head at a dial point d).
    acceptance    accepted draft tokens / proposed draft tokens, summed over a policy's requests.
    score         mean task score (math: exact answer, summary: ROUGE-2 F1, code: pass@1).
    time/token    a policy's batch wall time / its completion tokens; every request of a policy
                  is submitted at once, so the engine batches them (up to `max_batch`).
    norm_time     time/token divided by AR's time/token on the same task (AR = 1; < 1 is faster).
    mean_tv       mean TV(p_t, q_t) over the SD completions' positions (teacher-forced): the slope
                  of the theory line `acceptance = 1 − w·TV` (exact per position; averaged here).
Every policy sees the same prompts with the same per-request seeds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from server.engine.embedded import EmbeddedEngine
from server.engine.protocol import GenerationRequest, SamplingOptions, VerifyOptions
from training import tasks
from training.rollout import BatchRun, generate_batch, rollout_engine, teacher_force
from verifier.dial import PolicyKind


@dataclass
class EvalConfig:
    target_path: str = ""
    draft_path: str = ""
    pair_name: str = ""
    head_path: str | None = None  # None: no learned rows
    tasks: tuple[str, ...] = ("math", "summary", "code")
    split: str = "test"
    limit: int = 16  # prompts per task
    num_draft: int = 5
    max_tokens: int = 64  # the suite's references are <= ~40 tokens
    temperature: float = 1.0
    w_sweep: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)  # w = 1 is the SD row
    dials: tuple[float, ...] = (0.25, 0.5, 0.75)
    lenience: float = 0.5
    alpha: float = 0.5
    seed: int = 0
    max_batch: int = 8
    dtype: str | None = None  # None: the engine's default (float32 on CPU); "auto": measured


@dataclass(frozen=True)
class PolicySpec:
    name: str  # unique label, e.g. "static w=0.25"
    family: str  # ar | sd | sd_lossy | cascade | static | learned
    verify: VerifyOptions
    x: float | None = None  # w (static/sd) or the dial d (learned)


def policy_specs(cfg: EvalConfig, with_head: bool) -> list[PolicySpec]:
    n = cfg.num_draft
    specs = [
        PolicySpec("AR", "ar", VerifyOptions(mode="autoregressive")),
        PolicySpec("SD", "sd", VerifyOptions(weight=1.0, num_draft=n), 1.0),
        PolicySpec(
            f"SD lossy l={cfg.lenience:g}",
            "sd_lossy",
            VerifyOptions(policy=PolicyKind.LOSSY, lenience=cfg.lenience, num_draft=n),
        ),
        PolicySpec(
            f"SpecCascade a={cfg.alpha:g}",
            "cascade",
            VerifyOptions(policy=PolicyKind.CASCADE, alpha=cfg.alpha, num_draft=n),
        ),
    ]
    specs += [
        PolicySpec(f"static w={w:g}", "static", VerifyOptions(weight=w, num_draft=n), w) for w in cfg.w_sweep
    ]
    if with_head:
        specs += [
            PolicySpec(f"learned d={d:g}", "learned", VerifyOptions(weight=d, dial=d, num_draft=n), d)
            for d in cfg.dials
        ]
    return specs


def _seed(task: str, i: int, base: int) -> int:
    return (base * 1_000_003 + sum(map(ord, task)) * 10_007 + i) % (2**62)


def _summarise(spec: PolicySpec, examples, run: BatchRun, ar_tpt: float | None) -> dict:
    scores = [tasks.score(ex, r.text) for ex, r in zip(examples, run.rollouts, strict=True)]
    stats = [r.stats for r in run.rollouts if r.stats is not None]
    proposed = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    w_count = sum(s.weight_count for s in stats)
    tokens = max(1, run.completion_tokens)
    tpt = run.wall_s / tokens
    mean = sum(scores) / len(scores)
    var = sum((s - mean) ** 2 for s in scores) / max(1, len(scores) - 1)
    return {
        "policy": spec.name,
        "family": spec.family,
        "x": spec.x,
        "acceptance": accepted / proposed if proposed else None,
        "score": mean,
        "score_se": math.sqrt(var / len(scores)),
        "mean_w": sum(s.weight_sum for s in stats) / w_count if w_count else None,
        "completion_tokens": run.completion_tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else None,
        "time_per_token_s": tpt,
        "norm_time": tpt / ar_tpt if ar_tpt else 1.0,
        "verify_rounds": sum(s.verify_steps for s in stats),
    }


def run_eval(cfg: EvalConfig, head=None, progress=None) -> dict:
    """Run every (task, policy); returns the JSON-ready results (see `eval_report` for the artefacts)."""
    engine = rollout_engine(cfg, head)
    specs = policy_specs(cfg, head is not None)
    engine.start_sync()
    results: dict = {"config": asdict(cfg), "tasks": {}}
    try:
        _warmup(engine, cfg)
        for task in cfg.tasks:
            examples = tasks.load(task, cfg.split, cfg.limit, cfg.seed)
            prompts = [tuple(engine.encode_chat(ex.messages())) for ex in examples]
            rows, ar_tpt, mean_tv = [], None, None
            for spec in specs:
                sampling = [
                    SamplingOptions(
                        temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=_seed(task, i, cfg.seed)
                    )
                    for i in range(len(prompts))
                ]
                reqs = [
                    GenerationRequest(f"{task}-{i}", p, s, spec.verify)
                    for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
                ]
                run = generate_batch(engine, reqs)
                row = _summarise(spec, examples, run, ar_tpt)
                if spec.family == "ar":
                    ar_tpt = row["time_per_token_s"]
                if spec.family == "sd":
                    mean_tv = _mean_tv(engine, run, cfg.temperature)
                rows.append(row)
                if progress:
                    progress(task, row)
            results["tasks"][task] = {
                "metric": tasks.TASKS[task].metric,
                "prompts": len(examples),
                "mean_tv": mean_tv,
                "policies": rows,
            }
    finally:
        if engine.scheduler is not None:
            engine.scheduler.stop()
            engine.scheduler = None
    return results


def _warmup(engine: EmbeddedEngine, cfg: EvalConfig) -> None:
    """One short speculative and one AR request, so first-call costs stay out of the timings."""
    ids = tuple(engine.encode_chat([{"role": "user", "content": "Hello"}]))
    sampling = SamplingOptions(max_tokens=8, seed=0)
    generate_batch(
        engine,
        [
            GenerationRequest("warm-sd", ids, sampling, VerifyOptions(num_draft=cfg.num_draft)),
            GenerationRequest("warm-ar", ids, sampling, VerifyOptions(mode="autoregressive")),
        ],
    )


@torch.no_grad()
def _mean_tv(engine: EmbeddedEngine, run: BatchRun, temperature: float) -> float:
    models = engine.scheduler.models
    forced = teacher_force(models.target, models.draft, run.rollouts, temperature)
    return float(forced.tv.sum() / forced.mask.sum().clamp_min(1))
