# Every target bootstraps .venv on its own (idempotent: the stamp tracks pyproject.toml).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# Imports of sglang.srt.{plugins,server_args,sampling,arg_groups,speculative} on CPU (see docs/sglang.md).
SGLANG_CPU_DEPS := orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 triton==3.9.0 \
	msgspec==0.22.0 pyzmq==27.3.0 ipython==9.18.1 aiohttp==3.14.5 einops==0.8.2 dill==0.4.1 \
	apache-tvm-ffi==0.1.11 sentencepiece==0.2.3 compressed-tensors==0.20.0 gguf==0.19.0 \
	partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8

.PHONY: venv test lint fmt serve bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel that lies on these machines.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# Test-only: SGLang's own source, so the plugin tests check against its real code on CPU
# (docs/sglang.md). --no-deps keeps its CUDA stack out; the light deps are what its
# CPU-importable modules import. torch is named again so no dep can swap the CPU build.
# `make serve` does not need any of it (about 1 GB with triton).
SGL_STAMP := $(VENV)/.installed-sglang-cpu
$(SGL_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps "sglang==0.5.23"
	$(BIN)/pip install -q "torch==2.13.0" $(SGLANG_CPU_DEPS)
	touch $(SGL_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint deploy-tools browser-tools $(SGL_STAMP)
	$(BIN)/python -m pytest -q

serve: $(STAMP)
	$(BIN)/dialspec serve --host $(HOST) --port $(PORT)

bench: $(STAMP)
	$(BIN)/dialspec bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

# tests/test_deploy*.py check deploy/ with Debian's prometheus (the server and promtool, unpacked
# into .venv/bin) and docker-compose, installed once (CI runs as root); yamllint,
# check-jsonschema, kubernetes-validate and hadolint come with [dev]. The tests fail, never skip,
# when a tool is missing.
.PHONY: deploy-tools
deploy-tools: $(STAMP)
	sh deploy/scripts/install-test-tools.sh $(BIN)

# tests/test_playground.py drives Debian's chromium with Playwright (from [dev]; pointed at
# /usr/bin/chromium, never `playwright install`). Installed once; the test fails, never skips,
# when the browser is missing.
.PHONY: browser-tools
browser-tools: $(STAMP)
	sh scripts/install-browser-tools.sh $(BIN)/python
