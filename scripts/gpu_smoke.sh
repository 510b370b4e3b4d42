#!/usr/bin/env bash
# GPU smoke test for a bare CUDA machine: torch + triton + transformers, no SGLang, no network.
#
#   scripts/gpu_smoke.sh prepare        here, after `make test` installed sglang: copy SGLang's chain
#                                       kernel file (it imports only triton) into .gpu_smoke/
#   scripts/gpu_smoke.sh run [OUTDIR]   on the GPU node, with .gpu_smoke/ carried along:
#     (a) the verifier's statistical exactness tests with every tensor on CUDA
#     (b) SGLang's real Triton chain kernel behind the plugin's ν hook: token-for-token equal to the
#         torch reference, and chi-square tests of its output law (tests/test_sglang_chain_kernel.py)
#     (c) the embedded engine on CUDA: greedy agreement with the CPU, tok/s AR vs SD at batch 1/8/32
#     (d) the plugin's verify hooks against the stock verify step on the same inputs (B 48, N 5,
#         V 128k): ms per step, peak memory, and no host-device sync under CUDA's sync debug mode
#         (scripts/gpu_hook_timing.py; the stock step is eagle_sample's branch restated in torch
#         around SGLang's real chain kernel, since SGLang is not installed there)
#   and writes OUTDIR/gpu-results.md (default $OUT, else gpu-smoke-results/), the section that goes
#   into docs/gpu-results.md. Exit status: non-zero if any step failed.
#   scripts/gpu_smoke.sh bench [OUTDIR] [PAIRS]   on the GPU node (no prepare needed), one call of
#     under 10 minutes: `dialspec bench engine` on CUDA for the embedded pair and random-weight
#     Qwen2.5-0.5B->1.5B and Llama-3.2-1B->3.1-8B shapes (PAIRS: some of embedded,qwen,llama8b);
#     writes OUTDIR/bench-<pair>.{json,md} and OUTDIR/gpu-bench.md (issue 13's target tables).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_smoke

case "${1:-}" in
prepare)
    py=${PY:-.venv/bin/python}
    src=$("$py" -c 'from tests.sglang_kernel import kernel_file; print(kernel_file())') || exit 1
    mkdir -p "$CARRY" && cp "$src" "$CARRY/reject_sampling.py"
    echo "copied $src -> $CARRY/reject_sampling.py (carry $CARRY to the GPU node)"
    ;;
run)
    out=${2:-${OUT:-gpu-smoke-results}}
    mkdir -p "$out"
    if [ ! -f "$CARRY/reject_sampling.py" ]; then
        echo "gpu_smoke: $CARRY/reject_sampling.py missing; run 'scripts/gpu_smoke.sh prepare' first" >&2
        exit 2
    fi
    export PYTHONUNBUFFERED=1 DIALSPEC_TEST_DEVICE=cuda
    export DIALSPEC_SGLANG_KERNEL_FILE="$PWD/$CARRY/reject_sampling.py"
    status=0
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
    pytest_args=(-q -p no:cacheprovider -o addopts= -o timeout=600 -rfs)
    python3 -m pytest "${pytest_args[@]}" --junitxml="$out/verifier.xml" \
        tests/test_verifier_exactness.py tests/test_verifier_policies.py 2>&1 | tee "$out/verifier.log" \
        || status=1
    python3 -m pytest "${pytest_args[@]}" --junitxml="$out/kernel.xml" \
        tests/test_sglang_chain_kernel.py 2>&1 | tee "$out/kernel.log" || status=1
    python3 scripts/gpu_hook_timing.py --out "$out" 2>&1 | tee "$out/hook-timing.log" || status=1
    python3 scripts/gpu_smoke.py engine --out "$out" 2>&1 | tee "$out/engine.log" || status=1
    python3 scripts/gpu_smoke.py report --out "$out" --device-label "$(head -1 "$out/device.txt")" || status=1
    exit $status
    ;;
bench)
    out=${2:-${OUT:-gpu-bench-results}}
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 scripts/gpu_smoke.py bench --out "$out" --pairs "${3:-embedded,qwen,llama8b}"
    ;;
*)
    echo "usage: scripts/gpu_smoke.sh prepare | run [OUTDIR] | bench [OUTDIR] [PAIRS]" >&2
    exit 2
    ;;
esac
