"""`run_bench`: every method at every concurrency on the same requests, trials interleaved.

Trials interleave every method (engine and HF, whose models idle side by side) so that host noise
hits all of them alike, each trial starting at another point of the plan (`_rotated`); the fastest
trial of each (method, concurrency) row is kept. The engine
runs every tier with the adaptive draft length; `sweep` adds every fixed N in 0..N_max per tier
(pinned through the planner, so N = 0 means the same path with no drafts). `max_seconds` stops
starting new runs once spent (the report says what was skipped).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from server.engine.embedded.bench.hf_baselines import hf_run
from server.engine.embedded.bench.report import BenchRow, check_targets, engine_row
from server.engine.embedded.bench.workload import bench_prompts, engine_run, request_lengths

HF_METHODS = ("hf_generate", "hf_assisted", "hf_assisted_w0.5")
# Engine AR on HF generate's workload, every request at max_tokens: `generate` runs a batch to its
# longest request, so it cannot serve spread lengths, and the engine's AR on spread lengths pays a
# tail of part-empty steps that uniform lengths do not (AR / HF read 0.93-0.95 from that alone).
UNIFORM = "dialspec_ar_uniform"
TIERS = ("exact", "pro", "standard", "lite", "q0")  # the dial's tiers, and quality 0 (all accepted)


def tier_verification(tier: str):
    """The dial's Verification for a tier name ("q0": quality 0), via verifier.dial."""
    from verifier.dial import resolve

    return resolve(0.0 if tier == "q0" else tier).verification


@dataclass(frozen=True)
class BenchConfig:
    target_path: str
    draft_path: str
    concurrency: tuple[int, ...] = (1, 8)
    max_tokens: int = 24  # the mean; each request's own is spread (`workload.request_lengths`)
    length_spread: float = 0.25
    prompts: int = 8  # task-suite prompts in the workload
    waves: int | tuple[int, ...] = 1  # passes over the prompt list; or one per concurrency
    trials: int = 2  # interleaved repeats; the fastest is kept
    tiers: tuple[str, ...] = TIERS
    sweep: tuple[int, ...] = ()  # fixed Ns also run per tier (pinned through the planner)
    max_num_draft: int = 8
    temperature: float = 1.0
    include_hf: bool = True
    include_hf_assisted: bool = True
    device: str = "cpu"
    dtype: str | None = "auto"
    max_seconds: float | None = None
    profile_budget_s: float = 3.0
    cache_dir: str | None = None  # cost models / dtype choices (None: measured afresh)
    forced_tv: float | None = None  # accept drafts with probability 1 − w·TV (`EmbeddedEngineConfig`)
    response_format: str | None = None  # "json": every engine request follows `workload.BENCH_SCHEMA`
    seeded: bool = True  # seeded requests are planned alone (reproducible); unseeded ones jointly

    def output_format(self):
        """The engine requests' `response_format` (None: free text)."""
        from server.engine.embedded.bench.workload import BENCH_SCHEMA
        from server.engine.protocol import ResponseFormat

        return ResponseFormat("json_schema", BENCH_SCHEMA) if self.response_format == "json" else None

    def waves_at(self, c: int) -> int:
        """Passes over the prompt list at concurrency c. One per c lets high-c rows run as many
        rounds as c = 1 rows (8 clients finish 8 prompts in ~1/8 of the rounds): the cost model's
        round-time error needs rounds to be judged on, and c = 8 trials of ~6 rounds each read
        +-40 % from noise alone."""
        if isinstance(self.waves, int):
            return self.waves
        return self.waves[self.concurrency.index(c)]

    def engine_plan(self) -> list[tuple[str, str | None, object, int | None]]:
        """(method, tier, Verification, fixed N or None) for the embedded engine rows."""
        from verifier.dial import Verification

        ar = Verification(mode="autoregressive")
        # AR twice: the control's ratio to AR is this run's noise floor for every other ratio.
        plan = [("dialspec_ar", None, ar, 0), ("dialspec_ar_control", None, ar, 0)]
        if self.include_hf:  # HF's workload: every request at max_tokens (see `UNIFORM`)
            plan.append((UNIFORM, None, ar, 0))
        for tier in self.tiers:
            v = tier_verification(tier)
            plan.append((f"dialspec_{tier}", tier, v, None))
            plan += [(f"dialspec_{tier}_N{n}", tier, v, n) for n in self.sweep]
        return plan

    def hf_plan(self, c: int) -> list[str]:
        """HF methods at concurrency c (assisted generation is batch 1 only: measured at c = 1)."""
        if not self.include_hf:
            return []
        return [m for m in HF_METHODS if m == "hf_generate" or (c == 1 and self.include_hf_assisted)]


# The cost model's round-time predictions and their measured rounds: summed over every trial of a
# row. Keeping the fastest trial's alone would select for rounds that ran faster than predicted
# (the trial is picked by its measured time), a bias of +13..+29 % at c = 8 where a trial has ~10
# rounds and trials differ by 20 %.
PREDICTION_TIMERS = ("predicted_round_s", "measured_predicted_round_s", "abs_error_s", "profile_abs_error_s")


class Best:
    """The fastest trial per (method, concurrency): (tokens, seconds, ...) tuples; and every
    trial's tokens/s (`rates`), so reports show the spread the best was picked from. Engine runs'
    prediction timers are pooled over all trials instead (`PREDICTION_TIMERS`)."""

    def __init__(self, progress=None, total: int = 0):
        self.runs: dict[tuple[str, int], tuple] = {}
        self.rates: dict[tuple[str, int], list[float]] = {}
        self.predictions: dict[tuple[str, int], dict[str, float]] = {}  # sums over trials
        self.progress = progress
        self.task = progress.add_task("bench engine", total=total) if progress else None
        self.requests = progress.add_task("requests", total=None) if progress else None
        # Not a terminal (a log file, a CI or GPU-node job): one printed line per run instead.
        self.lines = progress is not None and not progress.console.is_terminal
        self.done, self.total, self.t0 = 0, total, time.perf_counter()

    def keep(self, key: tuple[str, int], result: tuple) -> None:
        self.rates.setdefault(key, []).append(round(result[0] / result[1], 3))
        if len(result) == 4:  # an engine run: (tokens, seconds, stats, timers)
            pooled = self.predictions.setdefault(key, dict.fromkeys(PREDICTION_TIMERS, 0.0))
            for name in PREDICTION_TIMERS:
                pooled[name] += result[3][name]
        old = self.runs.get(key)
        if old is None or result[0] / result[1] > old[0] / old[1]:
            self.runs[key] = result
        self.done += 1
        if self.progress:
            self.progress.advance(self.task)
        if self.lines:
            rate, elapsed = result[0] / result[1], time.perf_counter() - self.t0
            run = f"{self.done}/{self.total} [{elapsed:.0f} s] {key[0]} c={key[1]}"
            print(f"bench engine {run}: {rate:.2f} tok/s", flush=True)

    def mean_predictions(self, key: tuple[str, int]) -> dict[str, float]:
        """The prediction timers per trial, averaged over every trial of the row (each trial runs
        the same tokens, so `tokens / predicted_round_s` stays a rate)."""
        trials = len(self.rates[key])  # one rate per trial kept
        return {name: total / trials for name, total in self.predictions[key].items()}

    def describe(self, text: str) -> None:
        if self.progress:
            self.progress.update(self.task, description=text)

    def request_done(self) -> None:
        if self.progress:
            self.progress.advance(self.requests)


def _rotated(plan: list, trial: int, trials: int) -> list:
    """Trial k starts k/trials of the way into the plan: the first run after a switch (warm-up,
    the HF baselines' threads winding down) is measured slow on CPU, and with a fixed order the
    same row would pay for it in every trial (seen: AR first, 0.79x HF; its control 0.89x)."""
    k = trial * len(plan) // max(trials, 1)
    return plan[k:] + plan[:k]


def _workload(tok, n: int) -> tuple[list[str], list[list[int]]]:
    """Chat-formatted prompts and their token ids (the same list for every method)."""
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in bench_prompts(n)
    ]
    return chats, [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _rows(cfg: BenchConfig, best: Best) -> list[BenchRow]:
    rows: list[BenchRow] = []
    for c in cfg.concurrency:
        ar = None
        for method, tier, v, fixed in cfg.engine_plan():
            if (method, c) not in best.runs:
                continue
            weight = None if tier is None else v.weight
            extra = {"tier": tier, "weight": weight, "fixed_n": None if tier is None else fixed}
            tokens, seconds, stats, timers = best.runs[(method, c)]
            timers = {**timers, **best.mean_predictions((method, c))}
            row = engine_row(method, c, tokens, seconds, stats, timers, ar, **extra)
            row.trial_tokens_per_s = best.rates[(method, c)]
            if method == "dialspec_ar":
                ar = row
            rows.append(row)
    for c in cfg.concurrency:
        for method in cfg.hf_plan(c):
            if (method, c) in best.runs:
                tokens, secs = best.runs[(method, c)]
                note = "" if method == "hf_generate" else "batch 1 only (sequential)"
                rows.append(BenchRow(method, c, tokens, secs, tokens / secs, note=note))
                rows[-1].trial_tokens_per_s = best.rates[(method, c)]
    return rows


def copy_bandwidth(device) -> float:
    """Bytes per second a large device copy moves (read + write), best of 5."""
    import torch

    n = (1 << 28) if device.type == "cuda" else (1 << 26)  # 1 GiB / 256 MiB of float32
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes_per_token(target) -> int:
    """Bytes of target weights one decode step reads: every layer, the final norm, the LM head
    (the embedding table is only indexed, one row per token)."""
    params = sum(p.numel() for p in target.layers.parameters()) + target.norm.weight.numel()
    params += target.lm_head.weight.numel()
    return params * target.lm_head.weight.element_size()


def run_bench(target_path, draft_path, progress=None, **options) -> dict:
    """Run every method at every concurrency (options: `BenchConfig` fields); returns the
    JSON-ready report."""
    import torch
    from transformers import AutoTokenizer

    cfg = BenchConfig(str(target_path), str(draft_path), **options)
    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(cfg.target_path, padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    chats, prompt_ids = _workload(tok, cfg.prompts)
    engine = _start_engine(cfg, prompt_ids, chats)
    models = engine.scheduler.models
    # HF baselines run on this thread: give it the engine's thread count so both sides compete on
    # equal terms (recorded in the report's meta).
    if models.num_threads:
        torch.set_num_threads(models.num_threads)
    measured = {
        "weight_bytes": weight_bytes_per_token(models.target),
        "copy_bandwidth": copy_bandwidth(models.device),
    }
    runs = sum(len(cfg.engine_plan()) + len(cfg.hf_plan(c)) for c in cfg.concurrency)
    best = Best(progress, cfg.trials * runs)
    hf = HFBaselines(cfg, tok, chats, engine.config.dtype, best) if cfg.include_hf else None
    deadline = None if cfg.max_seconds is None else t_start + cfg.max_seconds
    try:
        skipped = _run_trials(cfg, engine, prompt_ids, hf, best, deadline)
    finally:
        engine.scheduler.stop()
    rows = _rows(cfg, best)
    meta = _meta(cfg, engine, measured, skipped, time.perf_counter() - t_start)
    return {"meta": meta, "rows": [asdict(r) for r in rows], "targets": check_targets(rows, meta)}


def _start_engine(cfg: BenchConfig, prompt_ids: list[list[int]], chats: list[str]):
    """The embedded engine for every engine row, sized for the longest request, started."""
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    requests = len(chats) * max(cfg.waves_at(c) for c in cfg.concurrency)
    max_len = max(request_lengths(requests, cfg.max_tokens, cfg.length_spread))
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            cfg.target_path, cfg.draft_path, num_draft=None, max_num_draft=cfg.max_num_draft,
            max_batch=max(cfg.concurrency),
            max_context=max(len(p) for p in prompt_ids) + max_len + 8, device=cfg.device,
            dtype=cfg.dtype, profile_budget_s=cfg.profile_budget_s, cache_dir=cfg.cache_dir,
            forced_tv=cfg.forced_tv,
        )
    )  # fmt: skip
    engine.start_sync()
    return engine


class HFBaselines:
    """HF `generate` and assisted generation on the engine's workload, in the engine's dtype."""

    def __init__(self, cfg: BenchConfig, tok, chats: list[str], dtype, best: Best):
        from transformers import AutoModelForCausalLM

        self.cfg, self.tok, self.chats, self.best = cfg, tok, chats, best
        self.target, self.draft = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(cfg.device).eval()
            for path in (cfg.target_path, cfg.draft_path)
        )
        hf_run(self.target, None, tok, chats[:1], 2, cfg.temperature, 1)  # warm-up

    def run(self, method: str, c: int) -> tuple[int, float]:
        """The same request list as the engine: batches of c for `generate`, one by one for assisted."""
        cfg = self.cfg
        texts = [self.chats[i % len(self.chats)] for i in range(len(self.chats) * cfg.waves_at(c))]
        draft = None if method == "hf_generate" else self.draft
        w = 0.5 if method.endswith("w0.5") else None
        out = []
        for i in range(0, len(texts), c):
            # Every request at max_tokens (the engine's mean): `generate` runs a batch to its longest
            # request, so spread lengths would have it either credited tokens it did not owe (its
            # prompt cost spread thinner) or charged steps it did not need.
            batch = texts[i : i + c]
            out.append(hf_run(self.target, draft, self.tok, batch, cfg.max_tokens, cfg.temperature, 5, w))
            for _ in batch:
                self.best.request_done()
        return sum(r[0] for r in out), sum(r[1] for r in out)


def _run_trials(
    cfg: BenchConfig, engine, prompt_ids, hf: HFBaselines | None, best: Best, deadline
) -> list[str]:
    """Every trial of every row, interleaved (`_rotated`); returns the runs skipped past `deadline`."""
    planner = engine.scheduler.models.planner
    skipped: list[str] = []

    def due(method: str, c: int) -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(f"{method} c={c}")
            return False
        best.describe(f"{method} c={c}")
        return True

    warm = tier_verification("standard")
    fmt = cfg.output_format()
    engine_run(engine, prompt_ids[:2], 2, cfg.temperature, warm, clients=2, response_format=fmt)  # warm-up
    for trial in range(cfg.trials):
        for c in cfg.concurrency:
            for method, tier, verify, fixed in _rotated(cfg.engine_plan(), trial, cfg.trials):
                if due(method, c):
                    planner.force = fixed if tier is not None else None
                    result = engine_run(
                        engine, prompt_ids, cfg.max_tokens, cfg.temperature, verify, c, cfg.waves_at(c),
                        on_request=best.request_done, spread=0.0 if method == UNIFORM else cfg.length_spread,
                        response_format=fmt, seeded=cfg.seeded,
                    )  # fmt: skip
                    best.keep((method, c), result)
            planner.force = None
            for method in cfg.hf_plan(c):
                if due(method, c):
                    best.keep((method, c), hf.run(method, c))
    return skipped


def _meta(cfg: BenchConfig, engine, measured: dict, skipped: list[str], wall_s: float) -> dict:
    """The report's meta: the run's settings, the host, the cost model, the bandwidth limit."""
    import torch

    from server.engine.embedded.planner.cost_profile import device_name

    models = engine.scheduler.models
    bandwidth = measured["copy_bandwidth"]
    sizes = sorted({1, max(cfg.concurrency)})
    return {
        **{k: v for k, v in asdict(cfg).items() if k not in ("target_path", "draft_path", "dtype")},
        "target": cfg.target_path, "draft": cfg.draft_path, "concurrency": list(cfg.concurrency),
        "tiers": {t: tier_verification(t).weight for t in cfg.tiers},
        "torch_threads": torch.get_num_threads(), "device": engine.config.device,
        "device_name": device_name(models.device), "dtype": str(engine.config.dtype).removeprefix("torch."),
        "dtype_choice": engine.info.runtime.get("dtype_choice"),
        "cost_model": engine.cost_model_summary(),
        "cost_model_profile": models.planner.profile.summary(sizes, cfg.max_num_draft),
        "bandwidth": {
            "weight_bytes": measured["weight_bytes"], "copy_gb_per_s": bandwidth / 1e9,
            "limit_tokens_per_s": bandwidth / measured["weight_bytes"],
        },
        "stopped_early": f"{len(skipped)} runs skipped" if skipped else None, "skipped": skipped,
        "wall_s": round(wall_s, 1),
        "seeded": cfg.seeded,  # seeded rows are planned alone; unseeded ones with their batch
        "protocol": "closed loop: c clients work through the same prompts x waves requests (seeded "
        "unless `seeded` is false) "
        "at every c, lengths spread evenly over max_tokens x (1 ± length_spread); best of `trials` "
        "interleaved runs per row; EOS ignored; tok/s counts prompt prefills, decode tok/s and the "
        "speedups do not (the cost model predicts rounds)",
    }  # fmt: skip
