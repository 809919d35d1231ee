"""A real `dagster dev` for tests: the shipped instance config, onceflow's env, GraphQL helpers.

`dagster dev` runs in a session of its own (webserver, daemon, code server and every run worker
below them), on a fresh `DAGSTER_HOME` holding an unchanged copy of the repository's
`dagster.yaml`, so what is tested is the instance users get from `make dev`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LOCATION = "onceflow"
SERVER_TIMEOUT_S = 180
CODE_LOCATION_TIMEOUT_S = 120
_SELECTOR = f'repositoryLocationName: "{LOCATION}", repositoryName: "__repository__"'
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")
LOG_TAIL_LINES = 120
# Tries of a GraphQL request answered with a server error (5xx).
GRAPHQL_ATTEMPTS = 4
# Tags a failure's report shows for each run: onceflow's own and Dagster's retry verdict.
_DESCRIBED_TAGS = ("onceflow/", "dagster/will_retry", "dagster/retry_number", "dagster/sensor")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    """Poll `probe` until it returns something truthy, and return that; TimeoutError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
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


def dagster_dev_env(
    home: Path,
    *,
    pg_dsn: str,
    lake: Path,
    landing: Path,
    onceflow_home: Path,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a `dagster dev` on instance folder `home` (created, with a copy of
    the shipped `dagster.yaml`) whose resources read the given PostgreSQL and folders.

    The resources take every setting from `ONCEFLOW_*` (`definitions.default_resources`), so
    the env is how a test points the code server, the daemon's sensors and every run worker
    at its own database and folders.
    """
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "ONCEFLOW_HOME": str(onceflow_home),
        "ONCEFLOW_POSTGRES_DSN": pg_dsn,
        "ONCEFLOW_LAKE": str(lake),
        "ONCEFLOW_LANDING": str(landing),
        "PYSPARK_PYTHON": sys.executable,
        "GX_ANALYTICS_ENABLED": "false",
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    # A fault armed in the test process must not reach the code server and every run.
    env.pop("ONCEFLOW_FAULT", None)
    env.update(extra or {})
    return env


class DagsterDev:
    """A `dagster dev` subprocess and its GraphQL endpoint."""

    def __init__(self, env: dict[str, str], log: Path, command: list[str] | None = None) -> None:
        """`command`: what starts `dagster dev` (e.g. `scripts/dev.sh`), given the arguments
        `dagster dev` takes after its `-w`; `dagster dev` itself when None."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = log.open("wb")
        args = ["-h", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(
            [*command, *args]
            if command
            else [
                str(Path(sys.executable).parent / "dagster"),
                *("dev", "-w", "workspace.yaml", *args),
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

    def wait_ready(self, sensor: str = "payments_new_data_sensor") -> None:
        """Wait for the webserver, then for the code location (it loads after)."""

        def up() -> bool:
            assert self.proc.poll() is None, f"dagster dev exited; see {self.log_path}"
            return self._get("/server_info") is not None

        wait_for("the webserver", up, SERVER_TIMEOUT_S)
        wait_for("the code location", lambda: self.sensor(sensor), CODE_LOCATION_TIMEOUT_S, 1)

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables}).encode()
        request = urllib.request.Request(
            self.url + "/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        for attempt in range(GRAPHQL_ATTEMPTS):
            try:
                with urllib.request.urlopen(request, timeout=30) as resp:
                    out = json.loads(resp.read())
                break
            except urllib.error.HTTPError as exc:
                # A server error answered while the daemon and the runs load a 2-core machine;
                # every query and mutation sent here (sensor and schedule state) is idempotent.
                if exc.code < 500 or attempt + 1 == GRAPHQL_ATTEMPTS:
                    raise
                time.sleep(2)
        assert "errors" not in out, out["errors"]
        return out["data"]

    # -- sensors and schedules ----------------------------------------------------------------

    def sensor(self, name: str) -> dict[str, Any] | None:
        data = self.graphql(
            """query($name: String!) { sensorOrError(sensorSelector: {"""
            + _SELECTOR
            + """, sensorName: $name}) { __typename
                ... on Sensor { sensorState { id selectorId status } } } }""",
            name=name,
        )["sensorOrError"]
        return data if data["__typename"] == "Sensor" else None

    def start_sensor(self, name: str) -> None:
        """Start a sensor (it may default to stopped); a running one is left alone."""
        state = self.sensor(name)
        assert state is not None, f"no sensor {name}"
        if state["sensorState"]["status"] == "RUNNING":
            return
        data = self.graphql(
            """mutation($selector: SensorSelector!) { startSensor(sensorSelector: $selector) {
                __typename ... on Sensor { sensorState { status } } } }""",
            selector={
                "repositoryLocationName": LOCATION,
                "repositoryName": "__repository__",
                "sensorName": name,
            },
        )
        assert data["startSensor"]["sensorState"]["status"] == "RUNNING", data

    def stop_sensor(self, name: str) -> None:
        state = self.sensor(name)
        assert state is not None
        data = self.graphql(
            """mutation($id: String) { stopSensor(id: $id) { __typename
                ... on StopSensorMutationResult { instigationState { status } } } }""",
            id=state["sensorState"]["id"],
        )
        assert data["stopSensor"]["instigationState"]["status"] == "STOPPED", data

    def stop_schedule(self, name: str) -> None:
        data = self.graphql(
            """query($name: String!) { scheduleOrError(scheduleSelector: {"""
            + _SELECTOR
            + """, scheduleName: $name}) { ... on Schedule { scheduleState { id status } } } }""",
            name=name,
        )
        state = data["scheduleOrError"]["scheduleState"]
        if state["status"] != "RUNNING":
            return
        out = self.graphql(
            """mutation($id: String!) { stopRunningSchedule(id: $id) { __typename
                ... on ScheduleStateResult { scheduleState { status } } } }""",
            id=state["id"],
        )
        assert out["stopRunningSchedule"]["scheduleState"]["status"] == "STOPPED", out

    # -- runs ---------------------------------------------------------------------------------

    def runs(
        self,
        job: str | None = None,
        tags: Mapping[str, str] | None = None,
        limit: int = 200,
    ) -> list[dict[str, Any]]:
        """Runs, newest first: id, job, status, tags, root and parent run ids, times."""
        run_filter: dict[str, Any] = {}
        if job:
            run_filter["pipelineName"] = job
        if tags:
            run_filter["tags"] = [{"key": k, "value": v} for k, v in tags.items()]
        data = self.graphql(
            """query($filter: RunsFilter, $limit: Int) {
                runsOrError(filter: $filter, limit: $limit) { __typename ... on Runs { results {
                    runId jobName status rootRunId parentRunId creationTime startTime endTime
                    tags { key value } } } } }""",
            filter=run_filter,
            limit=limit,
        )["runsOrError"]
        return [dict(r, tags={t["key"]: t["value"] for t in r["tags"]}) for r in data["results"]]

    def launch(self, job: str, run_config: Mapping[str, Any]) -> str:
        """Launch a run of `job` as the launchpad does; return its id."""
        out = self.graphql(
            """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
                __typename ... on LaunchRunSuccess { run { runId } }
                ... on PythonError { message }
                ... on RunConfigValidationInvalid { errors { message } } } }""",
            params={
                "selector": {
                    "repositoryLocationName": LOCATION,
                    "repositoryName": "__repository__",
                    "jobName": job,
                },
                "runConfigData": dict(run_config),
            },
        )["launchRun"]
        assert out["__typename"] == "LaunchRunSuccess", out
        return str(out["run"]["runId"])

    def run(self, run_id: str) -> dict[str, Any]:
        (found,) = [r for r in self.runs() if r["runId"] == run_id]
        return found

    def run_messages(self, run_id: str) -> list[dict[str, Any]]:
        """Every event of a run, oldest first, as {type, message, stepKey} (pages of 1,000)."""
        events: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            data = self.graphql(
                """query($runId: ID!, $cursor: String) {
                    logsForRun(runId: $runId, afterCursor: $cursor, limit: 1000) { __typename
                    ... on EventConnection { cursor hasMore events {
                        __typename ... on MessageEvent { message stepKey } } } } }""",
                runId=run_id,
                cursor=cursor,
            )["logsForRun"]
            assert data["__typename"] == "EventConnection", data
            events.extend(
                {"type": e["__typename"], "message": e.get("message"), "stepKey": e.get("stepKey")}
                for e in data["events"]
            )
            if not data["hasMore"]:
                return events
            cursor = data["cursor"]

    def pool(self, name: str) -> dict[str, Any]:
        """The instance's view of a concurrency pool: limit, claimed slots, pending steps."""
        return self.graphql(
            """query($key: String!) { instance { concurrencyLimit(concurrencyKey: $key) {
                concurrencyKey slotCount limit activeSlotCount activeRunIds pendingStepCount
                pendingStepRunIds claimedSlots { runId stepKey } } } }""",
            key=name,
        )["instance"]["concurrencyLimit"]

    def describe(self, log_lines: int = LOG_TAIL_LINES) -> str:
        """What the instance holds and did last, for a failure's report: every run (oldest
        first, with the tags that say why it ran) and the last of Dagster's lines in the log."""
        try:
            runs = self.runs()
        except Exception as exc:  # the server may be what failed
            lines = [f"runs: unreadable ({exc!r})"]
        else:
            lines = [f"runs ({len(runs)}):"]
            for r in reversed(runs):
                tags = {k: v for k, v in r["tags"].items() if k.startswith(_DESCRIBED_TAGS)}
                lines.append(
                    f"  {r['runId'][:8]} {r['jobName']} {r['status']}"
                    f" root={(r['rootRunId'] or '-')[:8]} parent={(r['parentRunId'] or '-')[:8]}"
                    f" created={r['creationTime']:.0f} start={r['startTime'] or 0:.0f}"
                    f" end={r['endTime'] or 0:.0f} {tags}"
                )
        self._log.flush()
        text = _ANSI.sub("", self.log_path.read_text(errors="replace"))
        # Dagster's own lines (daemon, run events), not the Spark output between them.
        tail = [line for line in text.splitlines() if " - dagster" in line][-log_lines:]
        lines.append(f"last {len(tail)} lines of Dagster's own in {self.log_path}:")
        lines.extend("  " + line for line in tail)
        return "\n".join(lines)

    def close(self) -> None:
        stop_group(self.proc, grace_s=20)
        self._log.close()


@contextmanager
def running_dagster_dev(
    env: dict[str, str], log: Path, command: list[str] | None = None
) -> Iterator[DagsterDev]:
    """`dagster dev` with its code location loaded; the whole process group ends on exit.

    A failure inside carries the instance's runs and the log's tail as a note, so a report
    (CI's included, whose folders are gone) says what Dagster was doing.
    """
    server = DagsterDev(env, log, command)
    try:
        server.wait_ready()
        yield server
    except Exception as exc:
        exc.add_note(server.describe())
        raise
    finally:
        server.close()
