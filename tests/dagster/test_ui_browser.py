"""`dagster dev` in headless Chromium: the graph shows the assets and checks, a UI launch commits."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceflow.generate import generate_payments
from tests.support.dagster_dev import (
    ROOT,
    DagsterDev,
    dagster_dev_env,
    running_dagster_dev,
    stop_group,
    wait_for,
)
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.browser

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
PAGE_TIMEOUT_S = 60


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
        first = wait_for(
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
        return wait_for(
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
        x, y = wait_for(f"button {label!r}", lambda: self.js(find), PAGE_TIMEOUT_S)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._ws.close()
        finally:
            stop_group(self.proc, grace_s=5)


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
    env = dagster_dev_env(
        tmp_path / "dagster_home",
        pg_dsn=pg_dsn,
        lake=lake,
        landing=landing,
        onceflow_home=tmp_path / "onceflow",
    )
    with running_dagster_dev(env, artifacts / "dagster_dev.log") as server:
        yield server


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
    # Every sink carries two checks (quality, freshness) and the recovery asset one; none
    # evaluated yet.
    wait_for(
        "the checks in the graph",
        lambda: (
            (t := browser.text()).count("0 / 2 Passed") == len(SINKS)
            and t.count("0 / 1 Passed") == 1
        ),
        60,
    )
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
    (run,) = wait_for(
        "the run launched from the UI", lambda: dagster_dev.runs("payments_job", ui_tags), 60
    )
    browser.wait_text("Materializing...")
    browser.screenshot(artifacts / "4_launched.png")

    def finished() -> dict[str, Any] | None:
        (now,) = [
            r for r in dagster_dev.runs("payments_job", ui_tags) if r["runId"] == run["runId"]
        ]
        return now if now["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None

    done = wait_for(f"run {run['runId']}", finished, RUN_TIMEOUT_S, 2)
    browser.goto(f"{url}/runs/{run['runId']}")
    browser.wait_text(run["runId"][:8])
    time.sleep(2)  # let the event log render for the screenshot
    browser.screenshot(artifacts / "5_run.png")
    assert done["status"] == "SUCCESS", f"run {run['runId']} ended {done['status']}"
    assert done["tags"]["onceflow/job"] == "payments"

    browser.goto(f"{url}/locations/onceflow/asset-groups/payments")
    browser.wait_text(*ASSETS)
    page = wait_for(
        "the passed checks in the graph",
        lambda: (t := browser.text()).count("2 / 2 Passed") == len(SINKS) and t,
        PAGE_TIMEOUT_S,
    )
    browser.screenshot(artifacts / "6_asset_group_after.png")
    assert "Never materialized" in page  # only the recovery asset

    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
