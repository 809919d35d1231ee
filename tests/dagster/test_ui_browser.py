"""`dagster dev` in headless Chromium: the graph shows the assets and checks, a UI launch commits."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from onceflow.generate import generate_payments
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts" / "ui"
ASSETS = [
    "payments_landing",
    "lake_payments",
    "pg_payments",
    "pg_merchant_balances",
    "pg_quarantine",
]
SINKS = ASSETS[1:]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Spark starts a JVM per step process inside the run: minutes on a small machine.
RUN_TIMEOUT_S = 600
SERVER_TIMEOUT_S = 180
PAGE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """End `proc`'s process group (it runs in a session of its own): TERM, then KILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        # `dagster dev` leaves its children (webserver, daemon, code server) to the group.
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


class DagsterDev:
    """A `dagster dev` subprocess and its GraphQL endpoint."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "dagster"),
                *("dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(self.port)),
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.read()
        except OSError:
            return None

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, "dagster dev exited; see its log in tests/artifacts"
            return self._get("/server_info") is not None

        _wait("the webserver", up, SERVER_TIMEOUT_S)
        # The code location loads after the webserver answers.
        _wait("the code location", lambda: self.sensor("payments_new_data_sensor"), 120, 1)

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables}).encode()
        request = urllib.request.Request(
            self.url + "/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            out = json.loads(resp.read())
        assert "errors" not in out, out["errors"]
        return out["data"]

    def sensor(self, name: str) -> dict[str, Any] | None:
        data = self.graphql(
            """query($name: String!) { sensorOrError(sensorSelector: {
                repositoryLocationName: "onceflow", repositoryName: "__repository__",
                sensorName: $name}) { __typename ... on Sensor { sensorState { id status } } } }""",
            name=name,
        )["sensorOrError"]
        return data if data["__typename"] == "Sensor" else None

    def stop_sensor(self, name: str) -> None:
        state = self.sensor(name)
        assert state is not None
        data = self.graphql(
            """mutation($id: String) { stopSensor(id: $id) { __typename
                ... on StopSensorMutationResult { instigationState { status } } } }""",
            id=state["sensorState"]["id"],
        )
        assert data["stopSensor"]["instigationState"]["status"] == "STOPPED", data

    def runs(self, job: str, tags: dict[str, str]) -> list[dict[str, Any]]:
        data = self.graphql(
            """query($filter: RunsFilter) { runsOrError(filter: $filter, limit: 20) {
                __typename ... on Runs { results { runId status tags { key value } } } } }""",
            filter={"pipelineName": job, "tags": [{"key": k, "value": v} for k, v in tags.items()]},
        )["runsOrError"]
        return list(data["results"])

    def close(self) -> None:
        _stop_group(self.proc, grace_s=20)
        self._log.close()


class Chromium:
    """Headless Chromium driven over the Chrome DevTools Protocol (one page, real input events)."""

    def __init__(self, user_data_dir: Path) -> None:
        from websockets.sync.client import connect

        assert CHROMIUM is not None
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"),
                *("--no-first-run", "--disable-background-networking", "--disable-sync"),
                *("--disable-component-update", "--window-size=1600,1000"),
                *(f"--user-data-dir={user_data_dir}", "--remote-debugging-port=0"),
                *("--remote-debugging-address=127.0.0.1", "about:blank"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = user_data_dir / "DevToolsActivePort"
        first = _wait(
            "Chromium's DevTools port",
            lambda: port_file.exists() and port_file.read_text().split("\n")[0].strip(),
            30,
            0.1,
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{first}/json/list", timeout=10) as resp:
            page = next(t for t in json.loads(resp.read()) if t["type"] == "page")
        self._ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=30)
        self._id = 0
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1600,
            height=1000,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=60))
            if message.get("id") == self._id:  # anything else is an event nobody asked for
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def js(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return str(self.js("document.body ? document.body.innerText : ''") or "")

    def wait_text(self, *needles: str, timeout_s: float = PAGE_TIMEOUT_S) -> str:
        return _wait(
            f"page text {needles}",
            lambda: (t := self.text()) and all(n in t for n in needles) and t,
            timeout_s,
        )

    def click_button(self, label: str) -> None:
        """Click the enabled button labelled `label` with the mouse, as a user would."""
        find = (
            "(() => { const b = [...document.querySelectorAll('button')].find("
            f"b => b.innerText.trim() === {json.dumps(label)} && !b.disabled);"
            " if (!b) return null; b.scrollIntoView({block: 'center'});"
            " const r = b.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = _wait(f"button {label!r}", lambda: self.js(find), PAGE_TIMEOUT_S)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._ws.close()
        finally:
            _stop_group(self.proc, grace_s=5)


@pytest.fixture()
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):
        old.unlink()
    return ARTIFACTS


@pytest.fixture()
def dagster_dev(
    pg_dsn: str, lake: Path, landing: Path, tmp_path: Path, artifacts: Path
) -> Iterator[DagsterDev]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "ONCEFLOW_HOME": str(tmp_path / "onceflow"),
        "ONCEFLOW_POSTGRES_DSN": pg_dsn,
        "ONCEFLOW_LAKE": str(lake),
        "ONCEFLOW_LANDING": str(landing),
        "PYSPARK_PYTHON": sys.executable,
        "GX_ANALYTICS_ENABLED": "false",
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    server = DagsterDev(env, artifacts / "dagster_dev.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


@pytest.fixture()
def browser() -> Iterator[Chromium]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (scripts/bootstrap.sh with ONCEFLOW_WITH_BROWSER=1)")
    # Not under pytest's tmp_path: Chromium's profile holds sockets, which need short paths.
    with tempfile.TemporaryDirectory(prefix="onceflow-chromium-") as profile:
        chromium = Chromium(Path(profile))
        try:
            yield chromium
        finally:
            chromium.close()


def test_ui_shows_assets_and_checks_and_launches_a_run(
    dagster_dev: DagsterDev,
    browser: Chromium,
    artifacts: Path,
    pg_dsn: str,
    lake: Path,
    landing: Path,
) -> None:
    # The community sign-up dialog of a fresh instance would cover the page.
    assert dagster_dev.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
    # The new-data sensor would launch a run of its own for the input: stop it before any input
    # lands, so the run under test is the one the UI launches.
    dagster_dev.stop_sensor("payments_new_data_sensor")
    generate_payments(landing, records=1000, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=7)
    url = dagster_dev.url

    browser.goto(f"{url}/locations/onceflow/asset-groups/payments")
    browser.wait_text(*ASSETS, "Asset checks", "Materialize all")
    # Every sink and the recovery asset carry one check each, none evaluated yet.
    _wait("the checks in the graph", lambda: browser.text().count("0 / 1 Passed") == 5, 60)
    browser.screenshot(artifacts / "1_asset_group.png")

    for sink in SINKS:
        browser.goto(f"{url}/assets/{sink}?view=checks")
        browser.wait_text(sink, "quality", "This is a blocking asset check.")
    browser.screenshot(artifacts / "2_pg_quarantine_checks.png")

    browser.goto(f"{url}/locations/onceflow/jobs/payments_job")
    browser.wait_text("payments_job", *SINKS)
    browser.screenshot(artifacts / "3_job.png")
    browser.click_button("Materialize all")
    ui_tags = {"dagster/from_ui": "true"}
    (run,) = _wait(
        "the run launched from the UI", lambda: dagster_dev.runs("payments_job", ui_tags), 60
    )
    browser.wait_text("Materializing...")
    browser.screenshot(artifacts / "4_launched.png")

    def finished() -> dict[str, Any] | None:
        (now,) = [
            r for r in dagster_dev.runs("payments_job", ui_tags) if r["runId"] == run["runId"]
        ]
        return now if now["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None

    done = _wait(f"run {run['runId']}", finished, RUN_TIMEOUT_S, 2)
    browser.goto(f"{url}/runs/{run['runId']}")
    browser.wait_text(run["runId"][:8])
    time.sleep(2)  # let the event log render for the screenshot
    browser.screenshot(artifacts / "5_run.png")
    assert done["status"] == "SUCCESS", f"run {run['runId']} ended {done['status']}"
    tags = {t["key"]: t["value"] for t in done["tags"]}
    assert tags["onceflow/job"] == "payments"

    browser.goto(f"{url}/locations/onceflow/asset-groups/payments")
    browser.wait_text(*ASSETS)
    page = _wait(
        "the passed checks in the graph",
        lambda: (t := browser.text()).count("1 / 1 Passed") == len(SINKS) and t,
        PAGE_TIMEOUT_S,
    )
    browser.screenshot(artifacts / "6_asset_group_after.png")
    assert "Never materialized" in page  # only the recovery asset

    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
