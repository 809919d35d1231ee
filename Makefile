# The two commands of the README: `make demo` runs the payments job on embedded defaults,
# `make test` runs the test suite. Both install what they need first.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
export GX_ANALYTICS_ENABLED := false
export DAGSTER_DISABLE_TELEMETRY := 1
export PYSPARK_PYTHON := $(CURDIR)/$(BIN)/python

.PHONY: setup demo test test-all lint bench dev

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(BIN)/onceflow demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check platform assets resources sensors tests definitions.py

test: setup lint
	$(BIN)/python -m pytest -m "not browser" -q

# Also installs Chromium for the browser tests (setup runs with ONCEFLOW_WITH_BROWSER=1 here).
test-all: export ONCEFLOW_WITH_BROWSER := 1
test-all: setup lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/payments_bench.py

dev: setup
	mkdir -p .dagster_home && cp -n dagster.yaml .dagster_home/dagster.yaml || true
	DAGSTER_HOME=$(CURDIR)/.dagster_home $(BIN)/dagster dev -w workspace.yaml
