#!/bin/bash
# Issue 13's real-size bench on CPU: random-weight Qwen2.5-0.5B -> 1.5B shapes (dialspec pair synth).
# --dtype auto measures which dtype is faster on the host: on a 2-core host without bf16 matrix units
# it picked bf16 for batch 1 and fp32 for max_batch 8 (prompts and full batches are compute-bound
# there), ~10 min per half; on one with them, bf16 for both, ~2 min per half. c = 8 runs three tiers.
PY=${PY:-.venv/bin/python}
P=/tmp/synth-qwen
$PY -m server.cli bench engine --target $P/target --draft $P/draft --concurrency 1 --prompts 2 --max-tokens 16 \
  --tiers exact,standard,lite,q0 --sweep 0,4 --trials 2 --no-hf-assisted --dtype auto --cache-dir runs/cache \
  --out runs/bench-qwen-c1
$PY -m server.cli bench engine --target $P/target --draft $P/draft --concurrency 8 --prompts 8 --max-tokens 12 \
  --tiers exact,lite,q0 --sweep 4 --trials 2 --no-hf-assisted --dtype auto --cache-dir runs/cache \
  --out runs/bench-qwen-c8
