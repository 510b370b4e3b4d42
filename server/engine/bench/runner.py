"""`run_bench`: every method at every concurrency on the same requests, trials interleaved.

Trials interleave every method (engine and HF, whose models idle side by side) so that host noise
hits all of them alike; the fastest trial of each (method, concurrency) row is kept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from server.engine.bench.hf_baselines import hf_run
from server.engine.bench.report import ENSEMBLE_WEIGHTS, BenchRow, check_targets, spec_row
from server.engine.bench.workload import bench_prompts, engine_run

HF_METHODS = ("hf_generate", "hf_assisted", "hf_assisted_w0.5")


@dataclass(frozen=True)
class BenchConfig:
    target_path: str
    draft_path: str
    concurrency: tuple[int, ...] = (1, 4, 8)
    max_tokens: int = 64
    num_draft: int = 5
    temperature: float = 1.0
    include_hf: bool = True
    waves: int = 4  # passes over the prompt list
    trials: int = 2  # interleaved repeats; the fastest is kept
    device: str = "cpu"
    dtype: str | None = None  # None: the engine's default for the device

    def engine_plan(self) -> list[tuple[str, str, float]]:
        """(method, mode, w) for the embedded engine rows."""
        plan = [("dialspec_ar", "autoregressive", 1.0), ("dialspec_sd", "speculative", 1.0)]
        return plan + [(f"dialspec_w{w}", "speculative", w) for w in ENSEMBLE_WEIGHTS]

    def hf_plan(self, c: int) -> list[str]:
        """HF methods at concurrency c (assisted generation is batch 1 only: measured at c = 1)."""
        return [m for m in HF_METHODS if m == "hf_generate" or c == 1] if self.include_hf else []


class Best:
    """The fastest trial per (method, concurrency): (tokens, seconds, ...) tuples."""

    def __init__(self, progress=None, total: int = 0):
        self.runs: dict[tuple[str, int], tuple] = {}
        self.progress = progress
        self.task = progress.add_task("bench engine", total=total) if progress else None

    def keep(self, key: tuple[str, int], result: tuple) -> None:
        old = self.runs.get(key)
        if old is None or result[0] / result[1] > old[0] / old[1]:
            self.runs[key] = result
        if self.progress:
            self.progress.advance(self.task)


def _workload(tok) -> tuple[list[str], list[list[int]]]:
    """Chat-formatted prompts and their token ids (the same list for every method)."""
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in bench_prompts()
    ]
    return chats, [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _rows(cfg: BenchConfig, best: Best) -> list[BenchRow]:
    rows: list[BenchRow] = []
    for c in cfg.concurrency:
        ar = None
        for method, mode, _ in cfg.engine_plan():
            row = spec_row(method, c, *best.runs[(method, c)], cfg.num_draft, ar)
            ar = row if mode == "autoregressive" else ar
            rows.append(row)
    for c in cfg.concurrency:
        for method in cfg.hf_plan(c):
            tokens, secs = best.runs[(method, c)]
            note = "" if method == "hf_generate" else "batch 1 only (sequential)"
            rows.append(BenchRow(method, c, tokens, secs, tokens / secs, note=note))
    return rows


def run_bench(target_path, draft_path, progress=None, **options) -> dict:
    """Run every method at every concurrency (options: `BenchConfig` fields); returns the
    JSON-ready report."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

    cfg = BenchConfig(str(target_path), str(draft_path), **options)
    tok = AutoTokenizer.from_pretrained(cfg.target_path, padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    chats, prompt_ids = _workload(tok)
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            cfg.target_path, cfg.draft_path, num_draft=cfg.num_draft, max_batch=max(cfg.concurrency),
            max_context=max(len(p) for p in prompt_ids) + cfg.max_tokens + 8, device=cfg.device,
            dtype=cfg.dtype,
        )
    )  # fmt: skip
    engine.start_sync()
    # HF baselines run on this thread: give it the engine's thread count so both sides compete on
    # equal terms (recorded in the report's meta).
    if engine.scheduler.models.num_threads:
        torch.set_num_threads(engine.scheduler.models.num_threads)
    runs = sum(len(cfg.engine_plan()) + len(cfg.hf_plan(c)) for c in cfg.concurrency)
    best = Best(progress, cfg.trials * runs)
    hf_models = None
    if cfg.include_hf:
        dtype = engine.config.dtype  # the engine's resolved dtype: both sides compute alike
        hf_models = tuple(
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(cfg.device).eval()
            for path in (cfg.target_path, cfg.draft_path)
        )
        hf_run(*hf_models, tok, chats[:1], 4, cfg.temperature, cfg.num_draft)  # warm-up

    def run_hf(method: str, c: int) -> tuple[int, float]:
        """The same request list as the engine: batches of c for `generate`, one by one for assisted."""
        target, draft = hf_models
        texts = [chats[i % len(chats)] for i in range(len(chats) * cfg.waves)]
        d = None if method == "hf_generate" else draft
        w = 0.5 if method.endswith("w0.5") else None
        batches = [texts[i : i + c] for i in range(0, len(texts), c)]
        out = [hf_run(target, d, tok, b, cfg.max_tokens, cfg.temperature, cfg.num_draft, w) for b in batches]
        return sum(r[0] for r in out), sum(r[1] for r in out)

    try:
        engine_run(engine, prompt_ids[:2], 4, cfg.temperature, "speculative", 1.0, clients=2)  # warm-up
        for _ in range(cfg.trials):
            for c in cfg.concurrency:
                for method, mode, w in cfg.engine_plan():
                    result = engine_run(
                        engine, prompt_ids, cfg.max_tokens, cfg.temperature, mode, w, c, cfg.waves
                    )
                    best.keep((method, c), result)
                for method in cfg.hf_plan(c):
                    best.keep((method, c), run_hf(method, c))
    finally:
        engine.scheduler.stop()
    rows = _rows(cfg, best)
    meta = {
        **{k: v for k, v in asdict(cfg).items() if k not in ("target_path", "draft_path", "dtype")},
        "target": cfg.target_path, "draft": cfg.draft_path, "concurrency": list(cfg.concurrency),
        "torch_threads": torch.get_num_threads(), "device": engine.config.device,
        "dtype": str(engine.config.dtype),
        "protocol": "closed loop: c clients work through the same NUM_PROMPTS x waves seeded requests "
        "at every c; best of `trials` interleaved runs per row; EOS ignored",
    }  # fmt: skip
    return {"meta": meta, "rows": [asdict(r) for r in rows], "targets": check_targets(rows)}
