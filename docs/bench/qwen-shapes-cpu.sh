#!/bin/bash
# Issue 13's real-size bench on CPU: random-weight Qwen2.5-0.5B -> 1.5B shapes (dialspec pair synth).
# ~10 min for c = 1; c = 8 is slower per run (bf16 at batch 8 on a CPU without bf16 matmul units),
# so it runs fewer tiers and one trial (~15 min).
PY=${PY:-.venv/bin/python}
P=/tmp/synth-qwen
$PY -m server.cli bench engine --target $P/target --draft $P/draft --concurrency 1 --prompts 2 --max-tokens 16 \
  --tiers exact,standard,lite,q0 --sweep 0,4 --trials 2 --no-hf-assisted --dtype auto --cache-dir runs/cache \
  --out runs/bench-qwen-c1
$PY -m server.cli bench engine --target $P/target --draft $P/draft --concurrency 8 --prompts 8 --max-tokens 12 \
  --tiers exact,lite,q0 --sweep 4 --trials 1 --no-hf-assisted --dtype auto --cache-dir runs/cache \
  --out runs/bench-qwen-c8
