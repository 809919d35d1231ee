"""`dagster dev` in headless Chromium: what an operator sees and launches in the UI.

One real `dagster dev` (the shipped `dagster.yaml`), one headless Chromium driven over the
DevTools protocol with real mouse and keyboard events, and the payments job on a real PostgreSQL
and Delta lake. In the UI the test:

1. sees the asset graph: every payments asset, and the asset checks of each (none evaluated);
2. launches a run of new data from the job's launchpad (`max_files_per_window: 1`, so the two
   landed files become windows 1 and 2) and sees it succeed, with every sink exact against the
   plain-Python oracle;
3. launches a backfill of the window range `1-2` from the launchpad and sees it succeed as a
   no-op (every sink already holds both windows), the sinks unchanged and exact;
4. launches a restatement of window 2 (`windows: "2"`, `restate: true`) from the launchpad and
   sees it succeed, the sinks still exact;
5. sees each check's result (`quality`, `input_planned_in_time`) on every sink asset, and in
   the graph;
6. sees the window lineage table in the sink assets' latest materialisation metadata.

Screenshots of every step go to `tests/artifacts/ui/` (kept out of git), with the `dagster dev`
log, and on failure the page's text and URL and the failed run's events; `steps.txt` holds
each step's wall time.

Waits are for UI states, each with a timeout; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from assets.checks import CHECK_NAME, FRESHNESS_CHECK
from onceflow.generate import generate_payments
from tests.support.dagster_dev import (
    FINISHED,
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
JOB = "payments"
RUN_JOB = f"{JOB}_job"
SOURCE = f"{JOB}_landing"
SINKS = ["lake_payments", "pg_payments", "pg_merchant_balances", "pg_quarantine"]
RECOVERY = f"{JOB}_recovery"
ASSETS = [SOURCE, *SINKS, RECOVERY]
CHECKS = [CHECK_NAME, FRESHNESS_CHECK]  # on every sink asset (assets/checks.py)
RECOVERY_CHECKS = 1  # all_windows_committed, evaluated by recovery runs only
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A run starts a Spark JVM and runs the engine and the quality suites: about a minute on an idle
# 2-core machine; the bound leaves room for a loaded one.
RUN_TIMEOUT_S = 300
PAGE_TIMEOUT_S = 60
# A column every window lineage table has (`onceflow.lineage`: window → offsets → versions).
LINEAGE_COLUMN = re.compile(r"^window(_id)?$", re.IGNORECASE)


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
        # Headless pages have no window focus; without it editors ignore the keyboard.
        self.call("Emulation.setFocusEmulationEnabled", enabled=True)

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
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:200]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def url(self) -> str:
        return str(self.js("location.href"))

    def text(self) -> str:
        return str(self.js("document.body ? document.body.innerText : ''") or "")

    def wait_text(self, *needles: str, timeout_s: float = PAGE_TIMEOUT_S) -> str:
        return wait_for(
            f"page text {needles}",
            lambda: (t := self.text()) and all(n in t for n in needles) and t,
            timeout_s,
            0.25,
        )

    def wait_js(self, what: str, expression: str, timeout_s: float = PAGE_TIMEOUT_S) -> Any:
        return wait_for(what, lambda: self.js(expression), timeout_s, 0.25)

    def click_element(self, what: str, find: str, timeout_s: float = PAGE_TIMEOUT_S) -> None:
        """Click, with the mouse as a user would, the element JS expression `find` returns
        (waiting until it does)."""
        center = (
            f"(() => {{ const e = {find}; if (!e) return null;"
            " e.scrollIntoView({block: 'center'});"
            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2];"
            " })()"
        )
        x, y = self.wait_js(what, center, timeout_s)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def click_button(self, label: str, within: str = "document") -> None:
        """Click the enabled button labelled `label` (inside the element `within`)."""
        self.click_element(
            f"button {label!r}",
            f"[...{within}.querySelectorAll('button')].find("
            f"b => b.innerText.trim() === {json.dumps(label)} && !b.disabled)",
        )

    def click_menu_item(self, label: str) -> None:
        self.click_element(
            f"menu item {label!r}",
            "[...document.querySelectorAll('[role=menuitem]')].find("
            f"b => b.innerText.trim() === {json.dumps(label)})",
        )

    def select_all_and_type(self, text: str) -> None:
        """Ctrl+A in the focused field, then type `text` over the selection."""
        key = {"key": "a", "code": "KeyA", "windowsVirtualKeyCode": 65, "modifiers": 2}
        self.call("Input.dispatchKeyEvent", type="keyDown", commands=["selectAll"], **key)
        self.call("Input.dispatchKeyEvent", type="keyUp", **key)
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._ws.close()
        finally:
            stop_group(self.proc, grace_s=5)


# The launchpad dialog and its config editor (CodeMirror; the asset filter is one too).
DIALOG = "document.querySelector('.bp5-dialog')"
EDITOR = "document.querySelector('.bp5-dialog .CodeMirror')"


class Operator:
    """What the test does in the UI, step by step, with a screenshot after each step."""

    def __init__(self, browser: Chromium, dev: DagsterDev, artifacts: Path) -> None:
        self.browser = browser
        self.dev = dev
        self.artifacts = artifacts
        self.url = dev.url
        self.shots = 0

    def shot(self, name: str) -> None:
        self.shots += 1
        self.browser.screenshot(self.artifacts / f"{self.shots:02d}_{name}.png")

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """A step of the test: on failure its screenshot, page text and URL are kept."""
        started = time.monotonic()
        try:
            yield
        except BaseException:
            try:
                self.browser.screenshot(self.artifacts / f"failed_{name}.png")
                (self.artifacts / f"failed_{name}.txt").write_text(
                    f"{self.browser.url()}\n\n{self.browser.text()}"
                )
            except Exception as exc:  # the evidence must not hide the failure
                (self.artifacts / f"failed_{name}.txt").write_text(repr(exc))
            raise
        finally:
            with (self.artifacts / "steps.txt").open("a") as out:
                out.write(f"{name}\t{time.monotonic() - started:.1f}s\n")

    def open_launchpad(self) -> None:
        """The job's page → the menu beside "Materialize all" → "Open launchpad"."""
        self.browser.goto(f"{self.url}/locations/onceflow/jobs/{RUN_JOB}")
        self.browser.wait_text(RUN_JOB, *SINKS, "Materialize all")
        item = (
            "[...document.querySelectorAll('[role=menuitem]')]"
            ".find(b => b.innerText.trim() === 'Open launchpad')"
        )

        def menu_open() -> bool:
            # A click that lands before the page's handlers are attached opens nothing:
            # click the opener again until the menu shows.
            self.browser.click_element(
                "the menu beside 'Materialize all'",
                "(() => { const bs = [...document.querySelectorAll('button')];"
                " const i = bs.findIndex(b => b.innerText.trim() === 'Materialize all');"
                " return i < 0 ? null : bs[i + 1]; })()",
            )
            try:
                return bool(self.browser.wait_js("the menu", f"!!{item}", 5))
            except TimeoutError:
                return False

        wait_for("the menu beside 'Materialize all'", menu_open, PAGE_TIMEOUT_S, 0.5)
        self.browser.click_menu_item("Open launchpad")
        self.browser.wait_js("the launchpad's config editor", f"!!{EDITOR}")
        self.browser.wait_text("Launchpad", "Materialize")

    def launch_from_launchpad(self, config: str, name: str) -> str:
        """Type `config` into the launchpad's editor, launch, and return the run's id."""
        self.open_launchpad()
        self.browser.click_element(
            "the config editor", f"{EDITOR}.querySelector('.CodeMirror-lines')"
        )
        self.browser.wait_js(
            "the config editor's focus", "document.activeElement.tagName === 'TEXTAREA'"
        )
        self.browser.select_all_and_type(config)
        typed = self.browser.wait_js(
            "the typed config", f"{EDITOR}.CodeMirror.getValue() === {json.dumps(config)}"
        )
        assert typed
        self.browser.wait_text("No errors")
        self.shot(f"{name}_launchpad")
        self.browser.click_button("Materialize", within=DIALOG)
        # The launchpad opens the new run's page.
        url = self.browser.wait_js(
            "the launched run's page",
            "/\\/runs\\/[0-9a-f-]{36}/.test(location.pathname) && location.pathname",
        )
        return str(url).rsplit("/", 1)[-1]

    def wait_run(self, run_id: str, name: str) -> dict[str, Any]:
        """Wait for the run to end; its page must show it succeeded."""
        try:
            run = wait_for(
                f"run {run_id} to end",
                lambda: (r := self.dev.run(run_id))["status"] in FINISHED and r,
                RUN_TIMEOUT_S,
                1,
            )
        except TimeoutError:
            self.keep_run_log(run_id)
            raise
        if run["status"] != "SUCCESS":
            self.keep_run_log(run_id)
        assert run["status"] == "SUCCESS", f"run {run_id} ended {run['status']}"
        assert run["tags"]["onceflow/job"] == JOB, run["tags"]
        assert run["tags"].get("dagster/from_ui") == "true", run["tags"]
        if not self.browser.url().endswith(f"/runs/{run_id}"):
            self.browser.goto(f"{self.url}/runs/{run_id}")
        self.browser.wait_text(run_id[:8], "Success", "Succeeded (3)")
        self.shot(f"{name}_run")
        return run

    def keep_run_log(self, run_id: str) -> None:
        lines = [
            f"{e['type']} {e['stepKey'] or '-'} {e['message']}"
            for e in self.dev.run_messages(run_id)
        ]
        (self.artifacts / f"run_{run_id[:8]}.log").write_text("\n".join(lines))

    def asset_metadata(self, asset: str, mode: str, name: str | None = None) -> dict[str, str]:
        """The metadata of the asset's latest materialisation, as its page shows it, once it
        is that of a run of `mode` (`new data`, `backfill`, `restate`)."""
        self.browser.goto(f"{self.url}/assets/{asset}")
        meta = wait_for(
            f"{asset}'s page showing the metadata of a {mode} run",
            lambda: (m := metadata_values(self.browser.text())).get("mode") == mode and m,
            PAGE_TIMEOUT_S,
            0.25,
        )
        if name:
            self.shot(name)
        return meta

    def check_result(self, sink: str, check: str) -> str:
        """The check's page of `sink`: every check of the sink listed as succeeded, and this
        one's latest result passed. Returns the page's text."""
        self.browser.goto(f"{self.url}/assets/{sink}?view=checks&checkDetail={check}")
        page = wait_for(
            f"{check} of {sink} shown as passed",
            lambda: (
                (t := self.browser.text()).count("Succeeded") == len(CHECKS)
                and all(c in t for c in CHECKS)
                and re.search(r"Evaluation result\s+Passed", t)
                and t
            ),
            PAGE_TIMEOUT_S,
            0.25,
        )
        self.shot(f"check_{sink}_{check}")
        return str(page)


def run_config(**op_config: str) -> str:
    """The launchpad config (YAML, as typed) of a payments run with `op_config`; everything
    else (resources, executor) is the job's default."""
    lines = ["ops:", f"  {JOB}_run:", "    config:"]
    lines += [f"      {key}: {value}" for key, value in op_config.items()]
    return "\n".join(lines) + "\n"


def check_metadata(page: str, key: str) -> str | None:
    """The value of `key` in a check's result metadata (the lines after "Metadata")."""
    lines = [line.strip() for line in page.split("Metadata", 1)[-1].splitlines() if line.strip()]
    return next((lines[i + 1] for i in range(len(lines) - 1) if lines[i] == key), None)


# A table shown as a metadata value with a window column: its row's label, headers and rows.
LINEAGE_TABLE = (
    "(() => { const column = new RegExp(" + json.dumps(LINEAGE_COLUMN.pattern) + ", 'i');"
    " for (const t of document.querySelectorAll('table')) {"
    " const heads = [...t.querySelectorAll('th')].map(h => h.innerText.trim());"
    " if (!heads.some(h => column.test(h))) continue;"
    " const row = t.parentElement && t.parentElement.closest('tr');"
    " t.scrollIntoView({block: 'start'});"
    " return {label: row ? row.querySelector('td').innerText.trim() : '', headers: heads,"
    " rows: t.querySelectorAll('tbody tr').length}; } return null; })()"
)


def metadata_values(page: str) -> dict[str, str]:
    """Key → value of the metadata rows in an asset page's text (key, timestamp, value)."""
    lines = [line.strip() for line in page.splitlines() if line.strip()]
    stamp = re.compile(r"^[A-Z][a-z]{2} \d{1,2}, \d{1,2}:\d{2} [AP]M$")
    return {
        lines[i - 1]: lines[i + 1]
        for i in range(1, len(lines) - 1)
        if stamp.match(lines[i]) and not stamp.match(lines[i - 1])
    }


@pytest.fixture()
def artifacts() -> Path:
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
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
        pytest.fail("chromium is not installed: run scripts/bootstrap.sh (as root)")
    # Not under pytest's tmp_path: Chromium's profile holds sockets, which need short paths.
    with tempfile.TemporaryDirectory(prefix="onceflow-chromium-") as profile:
        chromium = Chromium(Path(profile))
        try:
            yield chromium
        finally:
            chromium.close()


def quiet_instance(dev: DagsterDev) -> None:
    """Leave the runs under test the only ones: no sensor or schedule launches its own."""
    # The community sign-up dialog of a fresh instance would cover the page.
    assert dev.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
    # The new-data sensor would launch a run of its own for the input; daily_totals' would start
    # a Spark run per payments commit (load that has nothing to do with what is tested).
    for name in (f"{JOB}_new_data_sensor", "daily_totals_new_data_sensor"):
        if dev.sensor(name) is not None:
            dev.stop_sensor(name)
    # The hourly reconcile would queue a recovery run on the hour.
    for name in (f"{JOB}_reconcile_schedule", "daily_totals_reconcile_schedule"):
        dev.stop_schedule(name)


def test_operator_launches_runs_backfill_and_restatement_from_the_ui(
    dagster_dev: DagsterDev,
    browser: Chromium,
    artifacts: Path,
    pg_dsn: str,
    lake: Path,
    landing: Path,
) -> None:
    ui = Operator(browser, dagster_dev, artifacts)
    url = dagster_dev.url
    quiet_instance(dagster_dev)
    generate_payments(landing, records=1000, files=2, duplicate_rate=0.1, invalid_rate=0.05, seed=7)
    expected = expected_outputs(landing)

    with ui.step("graph"):
        browser.goto(f"{url}/locations/onceflow/asset-groups/{JOB}")
        browser.wait_text(*ASSETS, "Asset checks", "Materialize all")
        # Every sink carries its two checks, the recovery asset one; none evaluated yet.
        wait_for(
            "the checks in the graph",
            lambda: (
                (t := browser.text()).count(f"0 / {len(CHECKS)} Passed") == len(SINKS)
                and t.count(f"0 / {RECOVERY_CHECKS} Passed") == 1
            ),
            PAGE_TIMEOUT_S,
            0.25,
        )
        ui.shot("asset_graph")

    with ui.step("new_data"):
        run_id = ui.launch_from_launchpad(run_config(max_files_per_window="1"), "new_data")
        ui.wait_run(run_id, "new_data")
        assert_exact(expected, actual_outputs(pg_dsn, lake))
        meta = ui.asset_metadata("lake_payments", "new data", "new_data_metadata")
        assert meta.get("windows") == "1-2", meta
        assert meta.get("windows_committed") == "2", meta

    with ui.step("backfill"):
        run_id = ui.launch_from_launchpad(run_config(windows='"1-2"'), "backfill")
        ui.wait_run(run_id, "backfill")
        said = [e["message"] or "" for e in dagster_dev.run_messages(run_id)]
        for window in (1, 2):
            assert f"window {window} already committed in every sink; nothing changed" in said
        assert_exact(expected, actual_outputs(pg_dsn, lake))
        meta = ui.asset_metadata("pg_payments", "backfill", "backfill_metadata")
        assert meta.get("windows") == "1-2", meta
        assert meta.get("noop") == "true", meta

    with ui.step("restate"):
        run_id = ui.launch_from_launchpad(run_config(windows='"2"', restate="true"), "restate")
        ui.wait_run(run_id, "restate")
        said = [e["message"] or "" for e in dagster_dev.run_messages(run_id)]
        assert any(m.startswith("window 2: restate, committed to ") for m in said), said
        assert_exact(expected, actual_outputs(pg_dsn, lake))
        meta = ui.asset_metadata("pg_merchant_balances", "restate", "restate_metadata")
        assert meta.get("windows") == "2", meta
        assert meta.get("windows_committed") == "1", meta
        assert meta.get("restatements_pending") == "0", meta

    with ui.step("check_results"):
        browser.goto(f"{url}/locations/onceflow/asset-groups/{JOB}")
        browser.wait_text(*ASSETS)
        wait_for(
            "the passed checks in the graph",
            lambda: browser.text().count(f"{len(CHECKS)} / {len(CHECKS)} Passed") == len(SINKS),
            PAGE_TIMEOUT_S,
            0.25,
        )
        ui.shot("asset_graph_checked")
        for sink in SINKS:
            for check in CHECKS:
                page = ui.check_result(sink, check)
                if check == CHECK_NAME:  # the suites ran, and no rule failed
                    assert check_metadata(page, "failed") == "0", page

    with ui.step("lineage"):
        # The window lineage table (`onceflow.lineage`) in each sink asset's latest
        # materialisation metadata: a table whose columns include the window, a row per window.
        for sink in SINKS:
            meta = ui.asset_metadata(sink, "restate")
            assert "lineage" in meta, meta  # the metadata entry's label
            table = browser.wait_js(f"the lineage table of {sink}", LINEAGE_TABLE, 15)
            ui.shot(f"lineage_{sink}")  # scrolled to the table
            assert table["rows"] >= 2, table  # windows 1 and 2
