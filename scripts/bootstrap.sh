#!/usr/bin/env bash
# Installs everything onceflow needs on a fresh machine: Java for Spark, Chromium for the browser
# test of the UI, a virtualenv with the project and its dev tools. Safe to run again; it only
# does what is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}

java_major() {
    java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n 1
}

# apt_install WHAT PACKAGE...: install Debian packages (as root; without recommends). The package
# lists are refreshed only when needed: when apt knows no candidate for a package (lists never
# fetched, e.g. a fresh container) or when the install fails (lists too old for the mirror).
apt_install() {
    local what=$1
    shift
    if [ "$(id -u)" -ne 0 ]; then
        echo "bootstrap: need root to install $what; run: sudo apt-get install --no-install-recommends $*" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: no apt-get here; install $what ($*) with your package manager" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    local pkg updated=0
    for pkg in "$@"; do
        if ! apt-cache policy "$pkg" 2>/dev/null | grep -q 'Candidate: [^(]'; then
            apt-get update -qq
            updated=1
            break
        fi
    done
    if apt-get install -y -qq --no-install-recommends "$@" >/dev/null; then
        return 0
    fi
    if [ "$updated" = 0 ]; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null && return 0
    fi
    echo "bootstrap: could not install $what ($*); see apt-get's errors above" >&2
    exit 1
}

major=$(command -v java >/dev/null 2>&1 && java_major || true)
if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    echo "bootstrap: Java 17+ not found; installing openjdk-17-jre-headless" >&2
    apt_install "Java" openjdk-17-jre-headless
fi

# Chromium for the browser test of the Dagster UI (tests/dagster/test_ui_browser.py), which
# `make test` (CI) runs. Debian's package; nothing is done when it is already there.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    echo "bootstrap: chromium not found; installing it for the browser test" >&2
    apt_install "chromium (for the browser test)" chromium
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

# On request (`bootstrap.sh --airflow`, or ONCEFLOW_AIRFLOW=1; `make airflow` and `make test`
# ask): `.venv-airflow`, Airflow 3 and the onceflow provider (integrations/airflow, editable) in
# an environment of their own, from the pinned lock (Airflow's constraint files are not
# reachable from here). Airflow's providers need Python 3.11+.
if [ "${1:-}" = "--airflow" ] || [ "${ONCEFLOW_AIRFLOW:-}" = 1 ]; then
    af_venv="$root/.venv-airflow"
    af_dir="$root/integrations/airflow"
    af_python=${AIRFLOW_PYTHON:-}
    if [ -z "$af_python" ]; then
        for candidate in python3.11 python3.12 python3.13 "$python"; do
            if command -v "$candidate" >/dev/null 2>&1 &&
                "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
                af_python=$candidate
                break
            fi
        done
    fi
    if [ -z "$af_python" ]; then
        echo "bootstrap: Airflow needs Python 3.11+; none found; set AIRFLOW_PYTHON to one" >&2
        exit 1
    fi
    af_stamp="$af_venv/.onceflow-installed"
    af_want=$(cat "$af_dir/requirements.lock" "$af_dir/pyproject.toml" | sha256sum | cut -d' ' -f1)
    if [ ! -x "$af_venv/bin/python" ]; then
        "$af_python" -m venv "$af_venv"
    fi
    if [ ! -f "$af_stamp" ] || [ "$(cat "$af_stamp")" != "$af_want" ]; then
        "$af_venv/bin/python" -m pip install -q --upgrade pip
        "$af_venv/bin/python" -m pip install -q -r "$af_dir/requirements.lock"
        "$af_venv/bin/python" -m pip install -q --no-deps -e "$af_dir"
        echo "$af_want" > "$af_stamp"
    fi
fi
