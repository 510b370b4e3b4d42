"""The start-up side of the cost model (`cost_model.py`): profiling the round's stages on dummy
inputs within a time budget, re-timing a cached model to this host's speed now, and the cache
itself (one JSON file per pair shape + device + dtype + threads + engine code)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import platform
import time
from pathlib import Path
from typing import Protocol

import torch

from server.engine.embedded.model.kv_cache import KVCache
from server.engine.embedded.model.llama import Transformer
from server.engine.embedded.planner.cost_model import CostModel


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    def run(self, kind: str, r: int, t: int) -> float | None:
        """Run one stage; the seconds of its timed part where it times itself (`first_draft`,
        `check`: the set-up around them is not the stage), else None (the caller times it)."""
        from verifier import sample_inverse_cdf, verify

        m = self.m
        with torch.inference_mode():
            if kind == "catch_up":  # one draft forward over r tokens of one row, no logits
                tokens = torch.randint(0, self.vocab, (1, r), device=self.dev)  # [1, M]
                zero = torch.zeros(1, dtype=torch.long, device=self.dev)  # [1]
                m.draft(tokens, zero, zero, m.draft_cache, True)
            elif kind == "score":
                self._forward(m.target, m.target_cache, r, t)
            elif kind == "draft":
                q = self._forward(m.draft, m.draft_cache, r, 1)[:, 0]  # [R, V]
                sample_inverse_cdf(q, torch.rand(r, device=self.dev))
            elif kind == "first_draft":  # a draft step timed from after a target forward, as in a round
                self._forward(m.target, m.target_cache, r, 2)
                _sync(self.dev)
                t0 = time.perf_counter()
                self.run("draft", r, 1)
                return time.perf_counter() - t0
            elif kind == "check":
                p = torch.rand(r, t + 1, self.vocab, device=self.dev).softmax(-1)  # [R, n+1, V]
                q = torch.rand(r, t, self.vocab, device=self.dev).softmax(-1)  # [R, n, V]
                x = torch.randint(0, self.vocab, (r, t), device=self.dev)  # [R, n]
                _sync(self.dev)
                t0 = time.perf_counter()
                res = verify(p, q, x, 0.5, uniforms=torch.rand(r, t + 1, device=self.dev), validate=False)
                res.num_accepted.tolist(), res.tokens.tolist()
                return time.perf_counter() - t0
        _sync(self.dev)
        return None

    def measure(self, kind: str, r: int, t: int, reps: int, warm_up: bool = True) -> float:
        """Median of `reps` timed runs (after one untimed run at this shape if `warm_up`)."""
        times = []
        for i in range(reps + warm_up):
            _sync(self.dev)
            t0 = time.perf_counter()
            inner = self.run(kind, r, t)
            dt = inner if inner is not None else time.perf_counter() - t0
            if i or not warm_up:
                times.append(dt)
        return sorted(times)[len(times) // 2]


def _plan(max_batch: int, max_n: int, catch_up: int = 64) -> list[tuple[str, int, int]]:
    """Profile points, most useful first: batch 1 (latency) at both ends of T (with the draft
    step, the two points a fixed + per-token cost needs), a catch-up over a prompt's worth
    (`catch_up` tokens: the level its curve is scaled to; where a long forward runs at another
    speed per token than decode steps, as bf16 on matrix units does, priced from the draft step's
    curve it read a lagging row's first round +63 % at Qwen2.5 shapes), then the largest batch,
    then the rest."""
    tmax, rmax = max_n + 1, max_batch
    mids = [r for r in (2, 4) if 1 < r < rmax]
    order = [
        ("score", 1, 1), ("draft", 1, 1), ("score", 1, tmax), ("check", 1, 1), ("catch_up", catch_up, 1),
        ("score", 1, 2), ("score", rmax, 1), ("draft", rmax, 1), ("score", rmax, tmax), ("score", rmax, 2),
        ("check", 1, max_n), ("check", rmax, max_n), ("check", rmax, 1),
        ("first_draft", 1, 1), ("first_draft", rmax, 1),
        *[("score", 1, t) for t in range(3, tmax)],
        *[(k, r, t) for r in mids for (k, t) in (("score", 1), ("draft", 1), ("score", 2), ("score", tmax))],
        *[("score", rmax, t) for t in range(3, tmax)],
    ]  # fmt: skip
    seen, out = set(), []
    for point in order:
        if point not in seen:
            seen.add(point)
            out.append(point)
    return out


def profile(models: ProfiledPair, max_batch: int, max_num_draft: int, budget_s: float = 3.0) -> CostModel:
    """Measure the stages within about `budget_s` seconds (the first point is always measured;
    a point whose predicted cost would overrun the budget is skipped).

    The first forward of each model runs before the clock starts: it pays one-off costs (first
    touch of the weights' pages, allocator growth) that on a real-size model on CPU take seconds
    and would otherwise leave no budget for the points. Cheap points (< 20 ms) are the median of 3
    runs after a warm-up run; expensive ones are one run (a warm-up would double their cost for
    little: host noise is a smaller share of a long forward, and rounds refine them online)."""
    stages = _Stages(models)
    model = CostModel({"source": "profile", "budget_s": budget_s})
    t_warm = time.perf_counter()
    stages.run("score", 1, 1)
    stages.run("draft", 1, 1)
    t_start = time.perf_counter()
    for kind, r, t in _plan(max_batch, max_num_draft, stages.ctx):
        guess = model.time(kind, r, t)
        if kind == "first_draft":  # it runs after an untimed target forward, which costs as much
            guess += model.time("score", r, 2)
        cheap = guess < 0.02
        runs = 4 if cheap else 1
        spent = time.perf_counter() - t_start
        if model.entries and spent + guess * runs > budget_s:
            continue
        model.set(kind, r, t, stages.measure(kind, r, t, 3 if cheap else 1, warm_up=cheap))
    model.meta["warm_up_s"] = round(t_start - t_warm, 3)
    model.meta["profile_s"] = round(time.perf_counter() - t_start, 3)
    return model


def load_or_profile(
    models: ProfiledPair, max_batch: int, max_num_draft: int, budget_s: float, cache_dir: Path | None
) -> CostModel:
    """The cached model for this pair shape + device + dtype + threads, else a fresh profile
    (written to the cache when `cache_dir` is set)."""
    key = cache_key(models)
    path = cache_path(cache_dir, key) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            model = CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            model = None  # unreadable or another format: profile again and overwrite
        if model is not None:
            model.meta.update(source="cache", path=str(path))
            recalibrate(model, models)
            return model
    model = profile(models, max_batch, max_num_draft, budget_s)
    model.meta.update(device=key["device"], dtype=key["dtype"], threads=key["threads"])
    if path is not None:
        save(model, path)
    return model


def recalibrate(model: CostModel, models: ProfiledPair) -> float:
    """Scale a cached model to this host's speed now; returns the factor (also in `meta`).

    A cache keeps the speeds of the minutes it was profiled in, and this host's speed swings by up
    to 2x. Rounds correct only the stages they exercise: decoding plainly re-times the target's
    1-token forward but never the draft or the longer forwards, so a model cached in a slow spell
    went on pricing drafting at the slow speed and the planner never drafted (seen: a fresh engine
    on a 2x-slow cache decoded 8 requests plainly where drafting ran 1.35x). The target's 1-token
    forward and a draft step are timed once more (median of 3 when cheap) and every entry is
    scaled by the geometric mean of measured / cached: the cached shape is kept, its level is
    this host's now."""
    stages = _Stages(models)
    stages.run("score", 1, 1)  # first-call costs out of the clock, as in `profile`
    stages.run("draft", 1, 1)
    logs = []
    for kind in ("score", "draft"):
        cached = model.time(kind, 1, 1)
        if cached > 0:
            cheap = cached < 0.02
            measured = stages.measure(kind, 1, 1, 3 if cheap else 1, warm_up=cheap)
            logs.append(math.log(max(measured, 1e-9) / cached))
    factor = math.exp(sum(logs) / len(logs)) if logs else 1.0
    model.scale(factor)
    model.meta["recalibrated"] = round(factor, 4)
    return factor


def save(model: CostModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=1) + "\n")
    tmp.replace(path)
