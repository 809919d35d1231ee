#!/usr/bin/env bash
# `make dev`: a Spark Connect server (`onceflow spark-server`) beside `dagster dev`, so every run
# and check attaches to one long-lived Spark instead of starting a JVM per step. Both stop
# together. ONCEFLOW_SPARK_REMOTE, when already set, names a server of yours and none is started.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$root/.venv/bin"
export DAGSTER_HOME="${DAGSTER_HOME:-$root/.dagster_home}"
mkdir -p "$DAGSTER_HOME"
cp -n "$root/dagster.yaml" "$DAGSTER_HOME/dagster.yaml" 2>/dev/null || true

server_pid=""
stop_server() {
    if [ -n "$server_pid" ]; then
        kill -TERM -- "-$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
}
trap stop_server EXIT

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
"$bin/dagster" dev -w workspace.yaml "$@"
