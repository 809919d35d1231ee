"""`make airflow` (scripts/airflow.sh → `airflow standalone`) on embedded defaults: it comes up
healthy with every job's three DAGs, and headless Chromium keeps a screenshot of the UI's DAG
list in tests/artifacts/airflow/ (kept out of git)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.browser

ARTIFACTS = REPO / "tests" / "artifacts" / "airflow"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
UP_TIMEOUT_S = 240
DAGS = {
    f"{job}{suffix}"
    for job in ("payments", "daily_totals")
    for suffix in ("", "_reconcile", "_restate", "_maintain")
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_make_airflow_lists_the_dags(onceflow_env: dict[str, str], tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run scripts/bootstrap.sh (as root)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    home = tmp_path / "airflow"
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW_PORT": str(port),
        # No login page: the screenshot shows the DAG list itself.
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
    }
    env.pop("AIRFLOW__CORE__DAGS_FOLDER", None)  # the script's default: the project's DAGs
    log = (ARTIFACTS / "standalone.log").open("w")
    proc = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "airflow.sh")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started = time.monotonic()
    try:
        base = f"http://localhost:{port}"
        listed: set[str] = set()
        while time.monotonic() - started < UP_TIMEOUT_S:
            assert proc.poll() is None, f"airflow standalone exited; see {log.name}"
            try:
                with urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=5) as r:
                    health = json.load(r)
                out = subprocess.run(
                    [str(REPO / ".venv-airflow" / "bin" / "airflow"), "dags", "list", "-o", "json"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                lines = out.strip().splitlines()
                start = max(
                    (i for i, line in enumerate(lines) if line.startswith("[")), default=None
                )
                if start is not None:
                    listed = {d["dag_id"] for d in json.loads("\n".join(lines[start:]))}
                if health["scheduler"]["status"] == "healthy" and DAGS <= listed:
                    break
            except OSError:
                pass
            time.sleep(3)
        else:
            pytest.fail(f"not up with the DAGs in {UP_TIMEOUT_S}s (listed {sorted(listed)})")
        up_s = time.monotonic() - started
        shot = ARTIFACTS / "dag_list.png"
        subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1400,900",
                "--virtual-time-budget=20000",
                f"--screenshot={shot}",
                f"{base}/dags",
            ],
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert shot.exists() and shot.stat().st_size > 10_000, "no screenshot"
        (ARTIFACTS / "steps.txt").write_text(f"up with the DAGs listed: {up_s:.1f}s\n")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
