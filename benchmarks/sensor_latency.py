"""Latency from a new landing file to its rows in every sink, under `dagster dev`'s new-data sensor.

`--delivery follow` (the default, as shipped): the sensor starts one follow run, which commits
each file as it lands. `--delivery runs`: the sensor starts one run per new file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[1]
JOB = "payments"
PG_SINKS = ("pg_payments", "pg_merchant_balances", "pg_quarantine")
DELTA_SINK = "lake_payments"
POLL_S = 0.1


@dataclass
class Sample:
    """One file: when it landed, when every sink held it, and the run that took it there."""

    file: str
    landed: float  # the file's rename into the landing folder (its inode ctime)
    visible: float  # every sink holds the file's window, as polled
    window_id: int
    planned: float = float("nan")  # the ledger planned the file's window
    run_id: str = ""
    created: float = float("nan")  # the sensor created the run (queued)
    started: float = float("nan")  # the run worker started
    step_started: float = float("nan")  # the engine's step process started
    ended: float = float("nan")  # the run ended (after its quality checks)
    previous_ended: float = float("nan")

    @property
    def total(self) -> float:
        return self.visible - self.landed

    @property
    def pickup(self) -> float:
        return self.created - self.landed

    @property
    def behind_previous(self) -> float:
        """Queued behind the previous run (its checks), by the job's tag concurrency limit."""
        return max(0.0, self.previous_ended - self.created) if self.previous_ended else 0.0

    @property
    def launch(self) -> float:
        """Dequeue and run-worker start (a fresh process importing the definitions)."""
        return self.started - max(self.created, self.previous_ended or self.created)

    @property
    def to_step(self) -> float:
        return self.step_started - self.started

    @property
    def step_to_commit(self) -> float:
        """The engine's step: a process, a Spark JVM, then the engine's windows and commits."""
        return self.visible - self.step_started


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): the ceil(q% * n)-th smallest value."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = POLL_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def fresh_database(server_dsn: str) -> str:
    name = f"latency_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


class DagsterDev:
    """`dagster dev` (webserver, daemon, code server) in a process group of its own."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
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

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables}).encode()
        request = urllib.request.Request(
            self.url + "/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            out = json.loads(resp.read())
        if "errors" in out:
            raise RuntimeError(out["errors"])
        return out["data"]

    def wait_ready(self) -> None:
        def loaded() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("dagster dev exited; see its log")
            try:
                return (
                    self.graphql(_SENSOR, name=f"{JOB}_new_data_sensor")["sensorOrError"][
                        "__typename"
                    ]
                    == "Sensor"
                )
            except OSError:
                return False

        wait_for("dagster dev and the code location", loaded, 240, 1)

    def stop_sensor(self, name: str) -> None:
        state = self.graphql(
            "query($name: String!) { sensorOrError(sensorSelector: {"
            + _SELECTOR
            + ", sensorName: $name}) { ... on Sensor { sensorState { id } } } }",
            name=name,
        )["sensorOrError"]["sensorState"]
        self.graphql("mutation($id: String) { stopSensor(id: $id) { __typename } }", id=state["id"])

    def stop_schedule(self, name: str) -> None:
        state = self.graphql(_SCHEDULE, name=name)["scheduleOrError"]["scheduleState"]
        self.graphql(
            "mutation($id: String) { stopRunningSchedule(id: $id) { __typename } }", id=state["id"]
        )

    def run_for(self, landed: float) -> dict[str, Any] | None:
        """The first run of the job the sensor created after a file landed."""
        runs = self.graphql(_RUNS, filter={"tags": [{"key": "onceflow/job", "value": JOB}]})[
            "runsOrError"
        ]["results"]
        after = [r for r in runs if float(r["creationTime"]) >= landed]
        return min(after, key=lambda r: float(r["creationTime"])) if after else None

    def runs(self) -> list[dict[str, Any]]:
        return list(self.graphql(_RUNS, filter={})["runsOrError"]["results"])

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self._log.close()


_SELECTOR = 'repositoryLocationName: "onceflow", repositoryName: "__repository__"'
_SENSOR = (
    "query($name: String!) { sensorOrError(sensorSelector: {"
    + _SELECTOR
    + ", sensorName: $name}) { __typename } }"
)
_SCHEDULE = (
    "query($name: String!) { scheduleOrError(scheduleSelector: {"
    + _SELECTOR
    + ", scheduleName: $name}) { ... on Schedule { scheduleState { id } } } }"
)
_RUNS = """query($filter: RunsFilter) { runsOrError(filter: $filter, limit: 200) { ... on Runs {
    results { runId jobName status creationTime startTime endTime
              stepStats { stepKey startTime endTime } } } } }"""


class Sinks:
    """Where a file's rows are: the ledger's window for it, then each sink's commit of it."""

    def __init__(self, dsn: str, lake: Path) -> None:
        from onceflow._identifiers import delta_app_id

        self.conn = psycopg.connect(dsn, autocommit=True)
        self.lake = lake
        self.delta_app = delta_app_id(JOB, DELTA_SINK)

    def planned_at(self, window: int) -> float:
        row = self.conn.execute(
            "SELECT extract(epoch FROM planned_at) FROM onceflow.windows"
            " WHERE job = %s AND window_id = %s",
            (JOB, window),
        ).fetchone()
        return float(row[0]) if row else float("nan")

    def window_of(self, file: str) -> int | None:
        try:
            row = self.conn.execute(
                "SELECT window_id FROM onceflow.source_units WHERE job = %s AND unit = %s",
                (JOB, file),
            ).fetchone()
        except psycopg.errors.UndefinedTable:
            return None
        return int(row[0]) if row else None

    def holds(self, file: str) -> int | None:
        """The file's window id once every sink holds it, else None."""
        window = self.window_of(file)
        if window is None:
            return None
        row = self.conn.execute(
            "SELECT count(DISTINCT sink) FROM onceflow.sink_commits"
            " WHERE job = %s AND window_id = %s AND sink = ANY(%s)",
            (JOB, window, list(PG_SINKS)),
        ).fetchone()
        if not row or row[0] != len(PG_SINKS):
            return None
        rows = self.conn.execute(
            "SELECT count(*) FROM public.payments WHERE _source_file = %s", (file,)
        ).fetchone()
        if not rows or not rows[0]:
            return None
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            table = DeltaTable(str(self.lake / JOB))
        except TableNotFoundError:
            return None
        if (table.transaction_version(self.delta_app) or 0) < window:
            return None
        return window


def measure(sinks: Sinks, landing: Path, seed: int, timeout_s: float) -> Sample:
    from onceflow.generate import generate_payments

    written = generate_payments(landing, records=500, files=1, seed=seed).files[0]
    landed = written.stat().st_ctime  # a rename sets the inode's ctime: the instant it landed
    file = f"{JOB}/{written.name}"
    window = wait_for(f"{file} in every sink", lambda: sinks.holds(file), timeout_s)
    visible = time.time()
    return Sample(
        file=file,
        landed=landed,
        visible=visible,
        window_id=window,
        planned=sinks.planned_at(window),
    )


def add_runs(dev: DagsterDev, samples: list[Sample]) -> None:
    """Fill in each sample's run, once every run has ended."""
    previous = float("nan")
    for sample in samples:
        run = wait_for(
            f"the run for {sample.file} to end",
            lambda t=sample.landed: (r := dev.run_for(t)) and r["endTime"] and r,
            900,
            1,
        )
        steps = {s["stepKey"]: s for s in run["stepStats"]}
        sample.run_id = run["runId"]
        sample.created = float(run["creationTime"])
        sample.started = float(run["startTime"])
        sample.ended = float(run["endTime"])
        sample.step_started = float(steps[f"{JOB}_run"]["startTime"])
        sample.previous_ended = previous if previous == previous else 0.0
        previous = sample.ended


def report(samples: list[Sample], warmup: Sample, args: argparse.Namespace) -> None:
    def line(name: str, values: list[float]) -> str:
        return (
            f"  {name:<36} p50 {percentile(values, 50):6.1f}s  p95 {percentile(values, 95):6.1f}s"
            f"  max {max(values):6.1f}s  mean {statistics.fmean(values):6.1f}s"
        )

    pace = "after the previous run ended" if args.wait_run_end else "once the previous was visible"
    if args.delivery == "follow":
        spark = "Spark Connect server" if args.spark_server else "the follow run's Spark session"
        print(
            f"\nnew file (500 payments) -> rows in every sink: {len(samples)} files, each dropped "
            f"once the previous was visible; one follow run; {spark}; {os.cpu_count()} cores"
        )
        print(line("total: rename -> in every sink", [s.total for s in samples]))
        print(line("  rename -> window planned", [s.planned - s.landed for s in samples]))
        print(
            line("  planned -> in every sink (as polled)", [s.visible - s.planned for s in samples])
        )
        print(f"  warm-up file (starts the follow run), not counted: {warmup.total:.1f}s")
        print("\n  window  total  planned")
        for s in samples:
            print(f"  {s.window_id:6d} {s.total:6.1f} {s.planned - s.landed:8.1f}")
        return
    spark = "Spark Connect server" if args.spark_server else "a Spark JVM per run step"
    print(
        f"\nnew file (500 payments) -> rows in every sink: {len(samples)} files, each dropped "
        f"{pace}; new-data sensor interval {args.sensor_interval}s; {spark}; "
        f"{os.cpu_count()} cores"
    )
    print(line("total: rename -> in every sink", [s.total for s in samples]))
    print(line("  sensor pickup (run queued)", [s.pickup for s in samples]))
    print(line("  queued behind the previous run", [s.behind_previous for s in samples]))
    print(line("  dequeue + run worker start", [s.launch for s in samples]))
    print(line("  run start -> engine step start", [s.to_step for s in samples]))
    print(line("  engine step (JVM + windows)", [s.step_to_commit for s in samples]))
    print(line("run duration (incl. quality checks)", [s.ended - s.started for s in samples]))
    print(f"  warm-up file (first run creates the tables), not counted: {warmup.total:.1f}s")
    print("\n  window  total  pickup  behind  launch  ->step  step   run")
    for s in samples:
        print(
            f"  {s.window_id:6d} {s.total:6.1f} {s.pickup:7.1f} {s.behind_previous:7.1f}"
            f" {s.launch:7.1f} {s.to_step:7.1f} {s.step_to_commit:5.1f}  {s.run_id[:8]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--sensor-interval", type=int, default=1, help="new-data sensor, seconds")
    parser.add_argument("--dsn", default=os.environ.get("ONCEFLOW_BENCH_DSN"))
    parser.add_argument("--timeout", type=float, default=600, help="per file, seconds")
    parser.add_argument(
        "--wait-run-end",
        action="store_true",
        help="drop each file after the previous run ended (its checks too), not once visible",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--delivery",
        choices=("follow", "runs"),
        default="follow",
        help="one follow run (default, as shipped), or one run per new file",
    )
    parser.add_argument(
        "--with-downstream",
        action="store_true",
        help="keep daily_totals' new-data sensor on (it runs after every payments window)",
    )
    parser.add_argument(
        "--spark-server",
        action="store_true",
        help="attach the runs to a Spark Connect server (`onceflow spark-server`), as make dev does",
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="onceflow-latency-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    dev: DagsterDev | None = None
    server: Any = None
    spark_server: Any = None
    try:
        server_dsn = args.dsn
        if not server_dsn:
            import pgserver

            server = pgserver.get_server(work / "pg", cleanup_mode="stop")
            server_dsn = server.get_uri()
        dsn = fresh_database(server_dsn)
        home, lake, landing = work / "dagster_home", work / "lake", work / "landing"
        for folder in (home, lake, landing):
            folder.mkdir()
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "ONCEFLOW_HOME": str(work / "onceflow"),
            "ONCEFLOW_POSTGRES_DSN": dsn,
            "ONCEFLOW_LAKE": str(lake),
            "ONCEFLOW_LANDING": str(landing),
            "ONCEFLOW_SENSOR_INTERVAL_S": str(args.sensor_interval),
            "ONCEFLOW_DELIVERY": args.delivery,
            "PYSPARK_PYTHON": sys.executable,
            "GX_ANALYTICS_ENABLED": "false",
            "DAGSTER_DISABLE_TELEMETRY": "1",
        }
        if args.spark_server:
            from onceflow.spark_server import SparkServer, SparkServerConfig, free_port

            spark_env = {**os.environ, "PYTHONPATH": str(ROOT)}
            config = SparkServerConfig(port=free_port())
            spark_server = SparkServer(config, work / "spark_server.log", spark_env).start()
            env["ONCEFLOW_SPARK_REMOTE"] = spark_server.url
        print(f"work folder {work}; dagster dev log {work / 'dagster_dev.log'}", file=sys.stderr)
        dev = DagsterDev(env, work / "dagster_dev.log")
        dev.wait_ready()
        # The hourly reconcile would queue a recovery run in the middle of some sample.
        dev.stop_schedule(f"{JOB}_reconcile_schedule")
        if not args.with_downstream:
            # daily_totals follows every payments window with a run of its own: on 2 cores that
            # is load on the subject, not the subject.
            dev.stop_sensor("daily_totals_new_data_sensor")
            dev.stop_schedule("daily_totals_reconcile_schedule")
        sinks = Sinks(dsn, lake)
        print("warm-up file ...", file=sys.stderr)
        samples = []
        for i in range(args.files + 1):
            sample = measure(sinks, landing, seed=i, timeout_s=args.timeout)
            samples.append(sample)
            print(f"file {i}/{args.files}: {sample.total:.1f}s", file=sys.stderr)
            if args.wait_run_end and args.delivery == "runs":
                add_runs(dev, samples[-1:])
        if args.delivery == "runs":
            add_runs(dev, samples)
        report(samples[1:], samples[0], args)
        mine = f"{JOB}_follow_job" if args.delivery == "follow" else f"{JOB}_job"
        others = [r for r in dev.runs() if r["jobName"] != mine]
        if others:
            print(f"  other runs meanwhile: {[(r['jobName'], r['status']) for r in others]}")
    finally:
        if dev is not None:
            dev.close()
        if spark_server is not None:
            spark_server.stop()
        if server is not None:
            server.cleanup()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
