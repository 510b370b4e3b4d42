#!/bin/sh
# SGLang 0.5.23 runtime with dialspec's plugin (the `gpu` image's default command).
#
# STANDALONE speculative decoding: a separate small draft model proposes N tokens per round; the
# dialspec plugin (entry-point group `sglang.srt.plugins`, installed with dialspec) replaces the
# acceptance test with the ensemble rule nu = w*p + (1-w)*q, w per request from `custom_params`.
# Configuration (environment; see deploy/.env.example):
#   DIALSPEC_TARGET_MODEL  target model: HF id (HF cache volume) or a path such as /models/target
#   DIALSPEC_DRAFT_MODEL   draft model sharing the target's tokenizer, same forms
#   DIALSPEC_NUM_DRAFT     N, draft tokens per round (default 5)
#   SGLANG_PORT            listen port (default 30000)
#   SGLANG_EXTRA_ARGS      more launch_server flags, split on spaces (e.g. "--tp 2 --mem-fraction-static 0.8")
#   DIALSPEC_SGLANG_PLUGIN the plugin's switch, on ("1") unless set otherwise; DIALSPEC_DEFAULT_W and
#                          DIALSPEC_HEAD_PATH pass through (server/sglang_plugin/params.py)
set -eu

export DIALSPEC_SGLANG_PLUGIN="${DIALSPEC_SGLANG_PLUGIN:-1}"

: "${DIALSPEC_TARGET_MODEL:?set TARGET_MODEL in deploy/.env (an HF id, or a path under /models)}"
: "${DIALSPEC_DRAFT_MODEL:?set DRAFT_MODEL in deploy/.env (an HF id, or a path under /models)}"
N="${DIALSPEC_NUM_DRAFT:-5}"
PORT="${SGLANG_PORT:-30000}"
case "$N" in '' | *[!0-9]*) echo "dialspec-runtime: NUM_DRAFT must be a positive integer, got '$N'" >&2; exit 2 ;; esac
if [ "$N" -lt 1 ]; then echo "dialspec-runtime: NUM_DRAFT must be at least 1" >&2; exit 2; fi

# Without the plugin SGLang would serve plain (lossless) speculative decoding, or refuse the
# rejection-sampling flag for STANDALONE: fail now with a clear message instead.
python3 - <<'PY'
import sys
from importlib.metadata import entry_points

found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("server.")]
if not found:
    sys.exit("dialspec-runtime: dialspec's SGLang plugin is not registered (entry-point group "
             "sglang.srt.plugins); rebuild the image from a dialspec version that ships it")
print("dialspec-runtime: plugin", ", ".join(f"{ep.name} = {ep.value}" for ep in found), flush=True)
PY

# shellcheck disable=SC2086  # SGLANG_EXTRA_ARGS is a flag list on purpose
exec python3 -m sglang.launch_server \
    --model-path "$DIALSPEC_TARGET_MODEL" \
    --speculative-algorithm STANDALONE \
    --speculative-draft-model-path "$DIALSPEC_DRAFT_MODEL" \
    --speculative-num-steps "$N" \
    --speculative-eagle-topk 1 \
    --speculative-num-draft-tokens "$((N + 1))" \
    --speculative-use-rejection-sampling \
    --enable-metrics \
    --host 0.0.0.0 \
    --port "$PORT" \
    ${SGLANG_EXTRA_ARGS:-}
