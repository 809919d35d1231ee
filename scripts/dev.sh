#!/usr/bin/env bash
# `make dev`: a Spark Connect server (`onceflow spark-server`) beside `dagster dev`, so every run
# and check attaches to one long-lived Spark instead of starting a JVM per step. Both stop
# together, Dagster first. ONCEFLOW_SPARK_REMOTE, when already set, names a server of yours and
# none is started.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$root/.venv/bin"
export DAGSTER_HOME="${DAGSTER_HOME:-$root/.dagster_home}"
mkdir -p "$DAGSTER_HOME"
cp -n "$root/dagster.yaml" "$DAGSTER_HOME/dagster.yaml" 2>/dev/null || true

# Stopping (SIGTERM, SIGINT/Ctrl-C, SIGHUP) goes in order, within 60 s: `dagster dev` and every
# process of its group first (its follow runs stop after their current window, on a Spark
# server still up), then the Spark server. Each waits at most its bound, then is killed.
DAGSTER_STOP_S="${ONCEFLOW_DEV_STOP_S:-40}"
SERVER_STOP_S=15
server_pid=""
dagster_pid=""

# Wait until process group $1 is empty, at most $2 seconds; then SIGKILL what is left.
stop_group() {
    local group="$1" bound="$2" waited=0
    kill -TERM -- "-$group" 2>/dev/null || return 0
    while kill -0 -- "-$group" 2>/dev/null && [ "$waited" -lt $((bound * 5)) ]; do
        sleep 0.2
        waited=$((waited + 1))
    done
    if kill -0 -- "-$group" 2>/dev/null; then
        echo "dev: process group $group still running after ${bound}s; killing it" >&2
        kill -KILL -- "-$group" 2>/dev/null || true
    fi
}

stop_all() {
    trap '' INT TERM HUP  # a second Ctrl-C does not cut the orderly stop short
    if [ -n "$dagster_pid" ]; then
        echo "dev: stopping Dagster (follow runs end after their current window)" >&2
        stop_group "$dagster_pid" "$DAGSTER_STOP_S"
        dagster_pid=""
    fi
    if [ -n "$server_pid" ]; then
        echo "dev: stopping the Spark Connect server" >&2
        stop_group "$server_pid" "$SERVER_STOP_S"
        server_pid=""
    fi
}
trap stop_all EXIT
trap 'trap "" INT TERM HUP; exit 130' INT
trap 'trap "" INT TERM HUP; exit 143' TERM
trap 'trap "" INT TERM HUP; exit 129' HUP

if [ -z "${ONCEFLOW_SPARK_REMOTE:-}" ]; then
    port="${ONCEFLOW_SPARK_PORT:-15002}"
    mkdir -p "$DAGSTER_HOME/logs"
    log="$DAGSTER_HOME/logs/spark-server.log"
    # Its own process group, so stopping it takes its Python workers too; the jobs' code
    # (this folder) importable by its Python workers.
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" setsid "$bin/onceflow" spark-server --port "$port" >"$log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 600); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "dev: the Spark Connect server did not start; see $log" >&2
            exit 1
        fi
        sleep 0.2
    done
    export ONCEFLOW_SPARK_REMOTE="sc://127.0.0.1:$port"
    echo "dev: Spark Connect server on $ONCEFLOW_SPARK_REMOTE (log: $log)" >&2
fi

cd "$root"
# A process group of its own (job control), with SIGINT not ignored, as a background job would
# have it otherwise: this script decides when Dagster is stopped, and waits for all of it.
set -m
"$bin/dagster" dev -w workspace.yaml "$@" &
dagster_pid=$!
set +m
# `wait` returns when a trapped signal arrives; the trap exits, and the EXIT trap stops all.
wait "$dagster_pid" || status=$?
exit "${status:-0}"  # the EXIT trap ends what `dagster dev` left in its group
