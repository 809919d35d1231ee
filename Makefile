# The two commands of the README: `make demo` runs the payments job on embedded defaults,
# `make test` runs the test suite. Both install what they need first.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
export GX_ANALYTICS_ENABLED := false
export DAGSTER_DISABLE_TELEMETRY := 1
export PYSPARK_PYTHON := $(CURDIR)/$(BIN)/python

.PHONY: setup demo test test-all lint bench dev airflow-setup airflow test-airflow

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(BIN)/onceflow demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check platform assets resources sensors components tests definitions.py

# Test processes: each has its own Spark session and PostgreSQL server; a test file stays in
# one process (its module fixtures are built once). Much of a test's time is spent waiting on
# the processes it starts, so two processes keep two cores busy.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The suite, the headless-browser test of the Dagster UI included (setup installs Chromium;
# screenshots: tests/artifacts/ui/), without the `exhaustive` rest of the fault matrices; CI
# runs this (.ci/run).
test: setup lint
	$(PYTEST) -m "not exhaustive"
	$(MAKE) test-airflow

# The whole suite: every point of every fault matrix, on every deployment.
test-all: setup lint airflow-setup
	$(PYTEST)
	$(AIRFLOW_PYTEST)

bench: setup
	$(BIN)/python benchmarks/payments_bench.py

# dagster dev with a Spark Connect server beside it (scripts/dev.sh).
dev: setup
	bash scripts/dev.sh

# Airflow 3 in its own venv (.venv-airflow, from integrations/airflow/requirements.lock) with the
# onceflow provider; `make airflow` runs `airflow standalone` with the project's DAGs on
# http://localhost:8080 (AIRFLOW_PORT; scripts/airflow.sh).
airflow-setup: setup
	@bash scripts/bootstrap.sh --airflow

airflow: airflow-setup
	bash scripts/airflow.sh

# The provider's tests (integrations/airflow/tests), in the Airflow venv; `make test` runs them.
AIRFLOW_PYTEST := .venv-airflow/bin/python -m pytest -q -c integrations/airflow/pyproject.toml \
	--rootdir integrations/airflow integrations/airflow/tests
test-airflow: airflow-setup
	$(AIRFLOW_PYTEST) -m "not browser"
