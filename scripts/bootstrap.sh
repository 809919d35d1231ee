#!/usr/bin/env bash
# Installs everything onceflow needs on a fresh machine: Java for Spark, a virtualenv with the
# project and its dev tools. Safe to run again; it only does what is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}

java_major() {
    java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1
}

major=$(command -v java >/dev/null 2>&1 && java_major || true)
if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    echo "bootstrap: Java 17+ not found; installing openjdk-17-jre-headless" >&2
    if [ "$(id -u)" -ne 0 ]; then
        echo "bootstrap: need root to install Java; run: sudo apt-get install openjdk-17-jre-headless" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq openjdk-17-jre-headless >/dev/null
fi

# Chromium for the browser tests (tests/dagster/test_ui_browser.py), only when asked for:
# `make test-all` sets ONCEFLOW_WITH_BROWSER=1.
if [ "${ONCEFLOW_WITH_BROWSER:-0}" = "1" ] && ! command -v chromium >/dev/null 2>&1; then
    echo "bootstrap: chromium not found; installing it for the browser tests" >&2
    if [ "$(id -u)" -ne 0 ]; then
        echo "bootstrap: need root to install chromium; run: sudo apt-get install chromium" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
fi

stamp="$venv/.onceflow-installed"
want=$(cat "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e "$root[dev]"
    echo "$want" > "$stamp"
fi
