# Every target bootstraps .venv on its own (idempotent: the stamp tracks pyproject.toml).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv test lint fmt serve bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel that lies on these machines.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest -q

serve: $(STAMP)
	$(BIN)/dialspec serve --host $(HOST) --port $(PORT)

bench: $(STAMP)
	$(BIN)/dialspec bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

# tests/test_deploy.py checks deploy/ statically with promtool and docker-compose (Debian packages,
# installed once; CI runs as root). The test fails, never skips, when they are missing.
.PHONY: deploy-tools
test: deploy-tools
deploy-tools: $(STAMP)
	sh deploy/scripts/install-test-tools.sh $(BIN)
