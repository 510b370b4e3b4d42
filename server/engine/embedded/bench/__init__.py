"""`dialspec bench engine`: the embedded engine at every dial tier against engine AR and HF.

Modules: `workload` (prompts, the closed-loop driver of the engine), `hf_baselines` (HF generate
and assisted generation on the same requests), `report` (rows, targets, markdown), `runner`
(`run_bench`: every method at every concurrency, interleaved trials), `cli` (the subcommand).

Workload: the same list of requests at every concurrency c — `prompts` task-suite prompts x
`waves`, seeded per request, lengths spread evenly over max_tokens x (1 ± `length_spread`)
(`workload.request_lengths`) — served by c closed-loop clients, so rows differ only in c and
method. HF `generate` cannot serve spread lengths in a batch: it and `dialspec_ar_uniform` run
every request at max_tokens, and the AR / HF line compares those two.

Methods (every row measured in the same run, same requests, same max_tokens, EOS ignored):
    hf_generate           HF `generate` on the target alone (batched with left padding), same dtype.
    hf_assisted           HF assisted generation (`assistant_model`, constant N = 5, HF defaults
                          otherwise). HF supports batch size 1 only: measured sequentially at c = 1.
    hf_assisted_w0.5      the same with `assistant_ensemble_weight=0.5` (installed transformers has it).
    dialspec_ar           the embedded engine, target only (autoregressive requests, no draft at all).
    dialspec_ar_control   the same again, interleaved: its ratio to dialspec_ar is the run's noise.
    dialspec_ar_uniform   AR on HF generate's workload (every request at max_tokens; with the HF rows).
    dialspec_<tier>       the engine at a dial tier (exact, pro, standard, lite; q0 = quality 0, every
                          draft accepted) with the adaptive draft length.
    dialspec_<tier>_N<k>  the same tier with N pinned to k for every round (`--sweep`: k = 0..N_max,
                          or `--sweep 0,2,4,8` for some).
`--forced-tv TV` (`EmbeddedEngineConfig.forced_tv`) accepts each draft with probability 1 − w·TV
while every forward, check and bonus step runs for real: random-weight pairs of real shapes
(`dialspec pair synth`) then run at a real pair's acceptance instead of decoding plainly, so the
tiers' order shows. Timing only: the output follows no law.
Columns: tokens/s (generated tokens / wall time, prompt prefills included), decode tokens/s (the
same without prefills), mean N per row and round,
acceptance rate (accepted / proposed), mean accepted length (tokens per target forward), predicted
speedup over dialspec_ar (tokens over the cost model's predicted round times, each predicted
before its round) vs measured (decode) speedup, the cost model's bias on the mean round time and its
per-round error (live model, and the start-up profile alone), the fraction of round time in weights +
`verifier.verify`, and the planner's time per step; every trial's tokens/s is in the JSON.
Targets (issue 13, `report.check_targets`): every tier >= 0.97 x AR; each tier >= the next
higher tier within the noise floor (issue 32, also per pinned N); adaptive >= 0.9 x the best
fixed N; measured >= 0.9 x predicted speedup where drafting pays; AR >= HF generate and >= 50% of
the memory-bandwidth limit; the mean round time of every row predicted within 15%.
"""

from __future__ import annotations

from server.engine.embedded.bench.report import BenchRow, check_targets, to_markdown
from server.engine.embedded.bench.runner import TIERS, run_bench

__all__ = ["TIERS", "BenchRow", "check_targets", "run_bench", "to_markdown"]
