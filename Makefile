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

# The suite without the headless-browser test of the Dagster UI (about five minutes of a
# run near CI's 90-minute limit on a slow machine); CI runs this (.ci/run).
test: setup lint
	$(BIN)/python -m pytest -q -m "not browser"

# The whole suite, the browser test included (setup installs Chromium). Screenshots of the UI
# test: tests/artifacts/ui/.
test-all: setup lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/payments_bench.py

# dagster dev with a Spark Connect server beside it (scripts/dev.sh).
dev: setup
	bash scripts/dev.sh
