#!/bin/sh
# Installs what tests/test_playground.py needs: Debian's `chromium` (and a font, so screenshots show
# text), driven by Playwright for Python from the venv's [dev] extra. Playwright is pointed at
# /usr/bin/chromium; its own browser download (`playwright install`) is never used.
# CI runs `make test` as root on Debian; elsewhere sudo is used when there.
# Idempotent: does nothing when both are already there. Usage: install-browser-tools.sh PYTHON
set -eu

PY="${1:?usage: install-browser-tools.sh PYTHON}"
if ! [ -x /usr/bin/chromium ] || ! [ -d /usr/share/fonts/truetype/dejavu ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install-browser-tools: need root (or sudo) for apt-get to install chromium" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install-browser-tools: no apt-get; install Chromium at /usr/bin/chromium by hand" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
    echo "install-browser-tools: playwright is missing from $PY; run \`make venv\` (it is in [dev])" >&2
    exit 1
fi
# Debian's launcher script prints a harmless shell warning on stderr; the version is on stdout.
/usr/bin/chromium --version 2>/dev/null
"$PY" -c "from importlib.metadata import version; print('playwright', version('playwright'))"
