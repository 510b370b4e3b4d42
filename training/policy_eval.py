"""The `dialspec eval` runs: every task x every verification method, each swept over its own knob.

Terms
    method        a family of policies with one knob, swept: `static` (the ensemble at a fixed w),
                  `sd_lossy` (Leviathan lenience l), `cascade` (SpecCascade margin α), `typical`
                  (Medusa thresholds ε, δ scaled together), `learned` (a head at a dial point d;
                  ablation heads are `learned[<name>]`); plus the single points `ar` (target only)
                  and `sd` (lossless, w = 1: the strict end of static and lossy).
    acceptance    accepted draft tokens / proposed draft tokens, summed over a policy's requests;
                  rows also keep them per prompt, with per-prompt scores, for the paired bootstrap
                  of `training.frontiers`.
    score         mean task score (math: exact answer, summary: ROUGE-2 F1, code: pass@1).
    time/token    a policy's wall time / its completion tokens; the requests of one chunk are
                  submitted at once, so the engine batches them (up to `max_batch`).
    chunk         a slice of a task's prompts (`time_chunks` of them, each >= `max_batch` prompts).
                  Every policy runs chunk j before any policy runs chunk j + 1, in forward order on
                  even chunks and reversed on odd ones: a host whose speed drifts over minutes (this
                  one swings by up to 2x) slows every policy alike instead of whichever row ran
                  during the slow spell, and a linear drift cancels over each pair of chunks. Rows
                  keep each chunk's (seconds, tokens), so `training.frontiers` can resample chunks
                  to give the time axis an SE of its own.
    norm_time     time/token divided by AR's time/token on the same task (AR = 1; < 1 is faster).
    mean_tv       mean TV(p_t, q_t) over the SD completions' positions (teacher-forced): the slope
                  of the theory line `acceptance = 1 − w·TV` (exact per position; averaged here).
Every policy sees the same prompts with the same per-request seeds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from server.engine.embedded.engine import EmbeddedEngine
from server.engine.protocol import GenerationRequest, SamplingOptions
from training import tasks
from training.rollout import BatchRun, generate_batch, rollout_engine, teacher_force
from verifier.dial import PolicyKind, Verification


@dataclass
class EvalConfig:
    target_path: str = ""
    draft_path: str = ""
    pair_name: str = ""
    head_path: str | None = None  # None: no learned rows
    tasks: tuple[str, ...] = ("math", "summary", "code")
    split: str = "test"
    limit: int = 96  # prompts per task
    num_draft: int = 5
    max_tokens: int = 64  # the suite's references are <= ~40 tokens
    temperature: float = 1.0
    w_sweep: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)  # static; w = 1 is the SD row
    lenience_sweep: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75)  # lossy; l = 1 is SD
    # SpecCascade; α >= 1 never defers (max p − max q <= TV), so the sweep covers [0, 1]
    alpha_sweep: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
    typical_sweep: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0)  # scales Medusa's (ε, δ)
    # learned heads; for a head distilled from SpecCascade (training.distill, α(d) = 1 − 2d) the
    # points d <= 0.5 are the α of `alpha_sweep`
    dials: tuple[float, ...] = (0.0, 0.05, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
    seed: int = 0
    max_batch: int = 8
    dtype: str | None = None  # None: the engine's default (float32 on CPU); "auto": measured
    time_chunks: int = 8  # interleaved chunks per task (fewer if a chunk would hold < max_batch prompts)


TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3  # Medusa's defaults, scaled by `typical_sweep`


@dataclass(frozen=True)
class PolicySpec:
    name: str  # unique label, e.g. "static w=0.25"
    family: str  # ar | sd | static | sd_lossy | cascade | typical | learned | learned[<head>]
    verify: Verification
    x: float | None = None  # the knob: w, l, α, the typical scale, or the dial d
    head: str = ""  # which head a learned row uses ("" = the primary one)


def policy_specs(cfg: EvalConfig, heads: tuple[str, ...] = ()) -> list[PolicySpec]:
    """Every (method, knob) row; `heads` names the learned heads ("" = the primary head)."""
    n = cfg.num_draft
    specs = [
        PolicySpec("AR", "ar", Verification(mode="autoregressive")),
        PolicySpec("SD", "sd", Verification(weight=1.0, num_draft=n), 1.0),
    ]
    specs += [
        PolicySpec(f"static w={w:g}", "static", Verification(weight=w, num_draft=n), w) for w in cfg.w_sweep
    ]
    specs += [
        PolicySpec(
            f"SD lossy l={v:g}",
            "sd_lossy",
            Verification(policy=PolicyKind.LOSSY, lenience=v, num_draft=n),
            v,
        )
        for v in cfg.lenience_sweep
    ]
    specs += [
        PolicySpec(
            f"SpecCascade a={a:g}",
            "cascade",
            Verification(policy=PolicyKind.CASCADE, alpha=a, num_draft=n),
            a,
        )
        for a in cfg.alpha_sweep
    ]
    for k in cfg.typical_sweep:
        v = Verification(
            policy=PolicyKind.TYPICAL,
            epsilon=min(1.0, TYPICAL_EPSILON * k),
            delta=TYPICAL_DELTA * k,
            num_draft=n,
        )
        specs.append(PolicySpec(f"typical x{k:g}", "typical", v, k))
    for head in heads:
        family = "learned" if head == "" else f"learned[{head}]"
        specs += [
            PolicySpec(f"{family} d={d:g}", family, Verification(weight=d, dial=d, num_draft=n), d, head)
            for d in cfg.dials
        ]
    return specs


def _seed(task: str, i: int, base: int) -> int:
    return (base * 1_000_003 + sum(map(ord, task)) * 10_007 + i) % (2**62)


def chunk_bounds(prompts: int, chunks: int, max_batch: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk: `chunks` near-equal slices, fewer where a slice would hold
    fewer than `max_batch` prompts (a chunk smaller than a batch would time a half-empty engine)."""
    k = max(1, min(chunks, prompts // max(1, max_batch)))
    edges = [round(i * prompts / k) for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _summarise(spec: PolicySpec, examples, run: BatchRun, ar_tpt: float | None) -> dict:
    scores = [tasks.score(ex, r.text) for ex, r in zip(examples, run.rollouts, strict=True)]
    stats = [r.stats for r in run.rollouts]
    accepted = [s.accepted_tokens if s else 0 for s in stats]
    proposed = [s.draft_tokens if s else 0 for s in stats]
    w_count = sum(s.weight_count for s in stats if s)
    tokens = max(1, run.completion_tokens)
    tpt = run.wall_s / tokens
    mean = sum(scores) / len(scores)
    var = sum((s - mean) ** 2 for s in scores) / max(1, len(scores) - 1)
    return {
        "policy": spec.name,
        "family": spec.family,
        "x": spec.x,
        "acceptance": sum(accepted) / sum(proposed) if sum(proposed) else None,
        "score": mean,
        "score_se": math.sqrt(var / len(scores)),
        "mean_w": sum(s.weight_sum for s in stats if s) / w_count if w_count else None,
        "completion_tokens": run.completion_tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else None,
        "time_per_token_s": tpt,
        "norm_time": tpt / ar_tpt if ar_tpt else 1.0,
        "verify_rounds": sum(s.verify_steps for s in stats if s),
        "per_prompt": {"scores": scores, "accepted": accepted, "proposed": proposed},
    }


def run_eval(cfg: EvalConfig, heads: dict | None = None, progress=None) -> dict:
    """Run every (task, policy); `heads` maps a name to a loaded head ("" = the primary head,
    reported as `learned`). Returns the JSON-ready results (see `eval_report` for the artefacts)."""
    heads = heads or {}
    engine = rollout_engine(cfg, next(iter(heads.values()), None))
    specs = policy_specs(cfg, tuple(heads))
    engine.start_sync()
    results: dict = {"config": asdict(cfg), "tasks": {}}
    try:
        _warmup(engine, cfg)
        for task in cfg.tasks:
            examples = tasks.load(task, cfg.split, cfg.limit, cfg.seed)
            prompts = [tuple(engine.encode_chat(ex.messages())) for ex in examples]
            runs = _run_interleaved(engine, cfg, task, prompts, specs, heads, progress)
            rows, ar_tpt, mean_tv = [], None, None
            for spec, (run, chunks) in zip(specs, runs, strict=True):  # AR first: the time unit
                row = _summarise(spec, examples, run, ar_tpt)
                row["chunks"] = chunks
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


def _run_interleaved(engine, cfg: EvalConfig, task: str, prompts, specs, heads, progress):
    """Every spec on every prompt, chunk by chunk (see "chunk" in the module doc). Returns per spec
    (its BatchRun over all prompts in order, {"wall_s": [...], "tokens": [...]} per chunk)."""
    bounds = chunk_bounds(len(prompts), cfg.time_chunks, cfg.max_batch)
    rollouts: list[list] = [[] for _ in specs]
    chunks = [{"wall_s": [], "tokens": []} for _ in specs]
    sampling = [
        SamplingOptions(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=_seed(task, i, cfg.seed))
        for i in range(len(prompts))
    ]
    for j, (lo, hi) in enumerate(bounds):
        order = list(enumerate(specs)) if j % 2 == 0 else list(enumerate(specs))[::-1]
        for k, spec in order:
            if spec.family.startswith("learned"):
                engine.swap_head(heads[spec.head])
            ids = range(lo, hi)
            reqs = [GenerationRequest(f"{task}-{i}", prompts[i], sampling[i], spec.verify) for i in ids]
            run = generate_batch(engine, reqs)
            rollouts[k] += run.rollouts
            chunks[k]["wall_s"].append(run.wall_s)
            chunks[k]["tokens"].append(run.completion_tokens)
        if progress and len(bounds) > 1:
            progress(task, {"chunk": j + 1, "chunks": len(bounds)})
    return [(BatchRun(r, sum(c["wall_s"])), c) for r, c in zip(rollouts, chunks, strict=True)]


def _warmup(engine: EmbeddedEngine, cfg: EvalConfig) -> None:
    """One short speculative and one AR request, so first-call costs stay out of the timings."""
    ids = tuple(engine.encode_chat([{"role": "user", "content": "Hello"}]))
    sampling = SamplingOptions(max_tokens=8, seed=0)
    generate_batch(
        engine,
        [
            GenerationRequest("warm-sd", ids, sampling, Verification(num_draft=cfg.num_draft)),
            GenerationRequest("warm-ar", ids, sampling, Verification(mode="autoregressive")),
        ],
    )


@torch.no_grad()
def _mean_tv(engine: EmbeddedEngine, run: BatchRun, temperature: float) -> float:
    models = engine.scheduler.models
    forced = teacher_force(models.target, models.draft, run.rollouts, temperature)
    return float(forced.tv.sum() / forced.mask.sum().clamp_min(1))
