#!/bin/sh
# The SGLang router (data parallelism across runtimes, one per GPU node) for multi-node serving.
#   ROUTER_WORKER_URLS  space-separated runtime URLs, e.g. "http://runtime:30000 http://gpu-2:30000"
#   ROUTER_POLICY       cache_aware (default), round_robin, power_of_two, random
#   ROUTER_PORT         listen port (default 30000); Prometheus metrics on ROUTER_METRICS_PORT (29000)
set -eu

: "${ROUTER_WORKER_URLS:?set ROUTER_WORKER_URLS in deploy/.env (space-separated runtime URLs)}"

# shellcheck disable=SC2086  # one argument per URL
exec python3 -m sglang_router.launch_router \
    --worker-urls $ROUTER_WORKER_URLS \
    --policy "${ROUTER_POLICY:-cache_aware}" \
    --host 0.0.0.0 \
    --port "${ROUTER_PORT:-30000}" \
    --prometheus-host 0.0.0.0 \
    --prometheus-port "${ROUTER_METRICS_PORT:-29000}"
