"""`dialspec bench engine`: side-by-side throughput of HF baselines and the embedded engine.

Modules: `workload` (prompts, the closed-loop driver of the engine), `hf_baselines` (HF generate
and assisted generation on the same requests), `report` (rows, targets, markdown), `runner`
(`run_bench`: every method at every concurrency, interleaved trials), `cli` (the subcommand).

Workload: the same list of requests at every concurrency c — `NUM_PROMPTS` task-suite prompts x
`waves`, seeded per request — served by c closed-loop clients, so rows differ only in c and method.

Methods (every row measured in the same run, same requests, same max_tokens, EOS ignored):
    hf_generate           HF `generate` on the target alone (batched with left padding).
    hf_assisted           HF assisted generation (`assistant_model`, constant N, HF defaults otherwise:
                          its assistant_confidence_threshold may end a draft early). HF supports
                          batch size 1 only, so it is measured once, sequentially, at c = 1.
    hf_assisted_w0.5      the same with `assistant_ensemble_weight=0.5` (installed transformers has it).
    dialspec_ar           the embedded engine, target-only (autoregressive rows).
    dialspec_sd           the embedded engine, speculative with w = 1 (lossless).
    dialspec_w{0.75,0.5,0.25}  static ensemble verification.
Columns: tokens/s (aggregate generated tokens / wall time), acceptance rate (accepted / proposed),
mean accepted length (tokens per target forward), predicted speedup (`verifier.cost_model_speedup`
with measured t_draft, t_verify, t_target) vs measured speedup (tokens/s over dialspec_ar at the same
concurrency), and the fraction of round time spent inside `verifier.verify` (with the p/q transforms).
"""

from __future__ import annotations

from server.engine.bench.report import ENSEMBLE_WEIGHTS, BenchRow, check_targets, to_markdown
from server.engine.bench.runner import run_bench

__all__ = ["ENSEMBLE_WEIGHTS", "BenchRow", "check_targets", "run_bench", "to_markdown"]
