"""The cost model's shape (`cost_model.py`): rounds timed stage by stage on dummy inputs at start,
within a time budget, and cached as JSON per pair shape + device + dtype + threads + engine code.
A cached shape needs no re-timing: the live speed factor reads this host's speed now from the
first rounds."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from server.engine.embedded.model.kv_cache import KVCache
from server.engine.embedded.model.llama import Transformer
from server.engine.embedded.planner.cost_model import CostModel, Stage


class ProfiledPair(Protocol):
    """What profiling reads of the engine's `models.Models` (the planner sits below it)."""

    target: Transformer
    draft: Transformer
    target_cache: KVCache
    draft_cache: KVCache
    device: torch.device
    num_threads: int | None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ROOT = Path(__file__).resolve().parents[4]


def timed_sources(root: Path = ROOT) -> list[Path]:
    """The sources cached timings were measured with: the embedded engine (its model, round,
    planner, ...; not its bench, which only reads the engine) and the verifier."""
    embedded = root / "server" / "engine" / "embedded"
    engine = [f for f in embedded.rglob("*.py") if "bench" not in f.relative_to(embedded).parts]
    return sorted([*engine, *(root / "verifier").rglob("*.py")])


@functools.cache
def code_digest(root: Path = ROOT) -> str:
    """A digest of `timed_sources`: an edit there (another kernel path, a cheaper transform)
    invalidates cached cost models and dtype choices instead of leaving decisions measured on
    older code (a cached dtype probe once kept float32 for a pair that runs 2x faster in bfloat16).
    Paths are hashed relative to the root: several of these files share a name (`__init__.py`)."""
    h = hashlib.sha256()
    for f in timed_sources(root):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_key(models: ProfiledPair) -> dict:
    """What a cached model is valid for: the pair's shapes, device, dtype, threads, torch, code."""
    t, d = models.target, models.draft
    return {
        "target": vars(t.args),
        "draft": vars(d.args),
        "device": device_name(models.device),
        "dtype": str(t.embed.weight.dtype),
        "threads": models.num_threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "code": code_digest(),
    }


def cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"cost-{digest}.json"


CHEAP_REPS = 9
WARM_UP_S = 0.1
PASSES = 2


class _Stages:
    """The round's stages on dummy inputs, in the engine's own caches (free before serving)."""

    def __init__(self, models: ProfiledPair):
        self.m = models
        self.dev = models.device
        self.vocab = models.target.args.vocab_size
        self.ctx = min(64, models.target_cache.shape.max_seq // 2)  # a short chat's context

    def _forward(self, model, cache, r: int, t: int) -> torch.Tensor:
        from verifier import logits_to_probs

        tokens = torch.randint(0, self.vocab, (r, t), device=self.dev)  # [R, T]
        slots = torch.arange(r, device=self.dev)  # [R]
        starts = torch.full((r,), self.ctx, dtype=torch.long, device=self.dev)  # [R]
        return logits_to_probs(model.logits(model(tokens, slots, starts, cache, True)))  # [R, T, V]

    @torch.inference_mode()
    def run(self, stage: Stage, r: int, t: int) -> None:
        from verifier import sample_inverse_cdf, verify

        m = self.m
        if stage == Stage.CATCH_UP:  # one draft forward over r tokens of one row, no logits
            tokens = torch.randint(0, self.vocab, (1, r), device=self.dev)  # [1, M]
            zero = torch.zeros(1, dtype=torch.long, device=self.dev)  # [1]
            m.draft(tokens, zero, zero, m.draft_cache, True)
        elif stage == Stage.SCORE:
            self._forward(m.target, m.target_cache, r, t)
        elif stage == Stage.DRAFT:
            q = self._forward(m.draft, m.draft_cache, r, 1)[:, 0]  # [R, V]
            sample_inverse_cdf(q, torch.rand(r, device=self.dev))
        elif stage == Stage.CHECK:  # inputs made outside the clock would be fairer; they are small
            p = torch.rand(r, t + 1, self.vocab, device=self.dev).softmax(-1)  # [R, n+1, V]
            q = torch.rand(r, t, self.vocab, device=self.dev).softmax(-1)  # [R, n, V]
            x = torch.randint(0, self.vocab, (r, t), device=self.dev)  # [R, n]
            res = verify(p, q, x, 0.5, uniforms=torch.rand(r, t + 1, device=self.dev), validate=False)
            res.num_accepted.tolist(), res.tokens.tolist()
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def _timed(self, stage: Stage, r: int, t: int, times: int = 1) -> float:
        t0 = time.perf_counter()
        for _ in range(times):
            self.run(stage, r, t)
        return time.perf_counter() - t0

    def round(self, r: int, n: int) -> dict[tuple[Stage, int, int], float]:
        """One round of R rows at draft length n, each stage timed in a round's order: n draft
        steps (their mean, at T = n), the target's forward over n + 1 tokens, the check. (Each in
        a loop of its own, a stage keeps its weights in cache: docs/algorithm.md, "Why rounds".)"""
        out = {(Stage.DRAFT, r, n): self._timed(Stage.DRAFT, r, 1, n) / n} if n else {}
        out[Stage.SCORE, r, n + 1] = self._timed(Stage.SCORE, r, n + 1)
        out[Stage.CHECK, r, n] = self._timed(Stage.CHECK, r, n)
        return out

    def measure(self, stage: Stage, r: int, n: int, reps: int, warm_up: bool = True) -> dict:
        """{(stage, R, T): median seconds} of `reps` runs in a row of a round (`Stage.ROUND` at
        R, n) or of one stage, after one untimed run if `warm_up`: in a row, as a batch at that n
        runs them (a plan compares streams of rounds at one n or another)."""

        def once() -> dict:
            return self.round(r, n) if stage == Stage.ROUND else {(stage, r, n): self._timed(stage, r, n)}

        if warm_up:
            once()
        runs = [once() for _ in range(reps)]
        return {key: sorted(run[key] for run in runs)[len(runs) // 2] for key in runs[0]}


def _plan(max_batch: int, max_n: int, catch_up: int = 64) -> list[tuple[Stage, int, int]]:
    """Profile points (rounds at R, n and a catch-up over M tokens), most useful first: batch 1
    (latency) at n = 0, 1 and N_max (a fixed + per-token cost needs two points), a catch-up over a
    prompt's worth (a long forward may run at another speed per token than decode steps: bf16 on
    matrix units does), the largest batch, then the points between."""
    rmax, mids, R = max_batch, [r for r in (2, 4) if 1 < r < max_batch], Stage.ROUND
    order = [
        (R, 1, 0), (R, 1, 1), (R, 1, max_n), (Stage.CATCH_UP, catch_up, 1),
        (R, rmax, 0), (R, rmax, 1), (R, rmax, max_n),
        *[(R, 1, n) for n in range(2, max_n)],
        *[(R, r, n) for r in mids for n in (0, 1, max_n)],
        *[(R, rmax, n) for n in range(2, max_n)],
    ]  # fmt: skip
    return list(dict.fromkeys(order))


def _guess(model: CostModel, stage: Stage, r: int, n: int) -> float:
    """The seconds a point will take, from the points measured so far (no factors or overheads
    yet: a round is its stages' shapes)."""
    return model.round_time(r, n) if stage == Stage.ROUND else model.shape(stage, r, n)


def profile(models: ProfiledPair, max_batch: int, max_num_draft: int, budget_s: float = 3.0) -> CostModel:
    """Time rounds and a catch-up (`_plan`) within about `budget_s` seconds (the first point
    always; a point whose predicted cost would overrun the budget is skipped).

    Before the clock starts, rounds run for `WARM_UP_S` (at least two): the first pays one-off
    costs (first touch of the weights' pages, allocator growth: seconds for a real-size model on
    CPU), the next ones the host's ramp to speed (the embedded target's first ~8 forwards run up
    to 2.5x slower). Cheap points (< 20 ms) are the median of `CHEAP_REPS` runs after a warm-up
    run; expensive ones one run (host noise is a smaller share of a long forward, and the live
    factors follow the host). The plan runs `PASSES` times, the budget filling the first pass
    first, and each point keeps its fastest: a stall of the host during one pass reads as a
    dearer point, and seeded rows plan on these points for the engine's life (and, cached, for
    later ones). Over 12 fresh profiles of the embedded pair: the plain round at batch 1 spread
    4.5 % (sd / mean) with one pass, 2.9 % with two; seeded pro drafted in 1 of 12 with one, 0
    with two, and standard's N was 3-5 against always 3 (its best: docs/bench/planner-ab.md)."""
    stages = _Stages(models)
    model = CostModel({"source": "profile", "budget_s": budget_s})
    t_warm = time.perf_counter()
    stages.round(1, 1)
    t_first = time.perf_counter()
    while time.perf_counter() - t_first < WARM_UP_S:
        stages.round(1, 1)
    t_start = time.perf_counter()
    for stage, r, n in _plan(max_batch, max_num_draft, stages.ctx) * PASSES:
        guess = _guess(model, stage, r, n)
        cheap = guess < 0.02
        reps = CHEAP_REPS if cheap else 1
        if model.points and time.perf_counter() - t_start + guess * (reps + cheap) > budget_s:
            continue
        for (s, rr, t), seconds in stages.measure(stage, r, n, reps, warm_up=cheap).items():
            model.set(s, rr, t, min(seconds, model.points.get(s, {}).get((rr, t), math.inf)))
    model.meta["warm_up_s"] = round(t_start - t_warm, 3)
    model.meta["profile_s"] = round(time.perf_counter() - t_start, 3)
    return model


def load_or_profile(
    models: ProfiledPair,
    max_batch: int,
    max_num_draft: int,
    budget_s: float,
    cache_dir: Path | None,
    overheads: Callable[[CostModel], None] | None = None,
) -> CostModel:
    """The cached shape for this pair shape + device + dtype + threads + code, else a fresh
    profile, completed by `overheads` (the engine's own time, `overhead_profile.py`) and written
    to the cache when `cache_dir` is set."""
    key = cache_key(models)
    path = cache_path(cache_dir, key) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            model = CostModel.from_dict(json.loads(path.read_text()))
            model.meta.update(source="cache", path=str(path))
            return model
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass  # unreadable or another format: profile again and overwrite
    model = profile(models, max_batch, max_num_draft, budget_s)
    if overheads is not None:
        t0 = time.perf_counter()
        overheads(model)
        model.meta["overheads_s"] = round(time.perf_counter() - t0, 3)
    model.meta.update(device=key["device"], dtype=key["dtype"], threads=key["threads"])
    if path is not None:
        save(model, path)
    return model


def save(model: CostModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=1) + "\n")
    tmp.replace(path)
