"""Where a window's time goes: `payments` windows profiled in one warm Spark session.

Runs `onceflow run payments` in-process `--repeat` times over the same generated input (a fresh
database and lake each time, after a two-window warm-up) and prints, per repeat:

- wall time and window latency (plan → committed in every sink);
- per window, the driver's time in preparing (planning, the window's Spark job) and in
  committing, which overlap (the engine prepares window N+1 while N commits);
- the window's Spark jobs, from Spark's event log: how many, their wall time and the JVM CPU
  of their tasks, and Spark's own work on each job's query before the job starts;
- how many classes Spark's code generation compiled (none a window once each window's plan
  generates code Spark has compiled before);
- CPU seconds by process (the Spark JVM, its Python workers, this driver, the PostgreSQL server
  with its exited backends) and, inside the JVM, by thread kind: the JIT compiler threads
  against the executor's task threads;
- how busy the machine's cores were, against what they could do in the wall time (every
  process counts: run it on a quiet machine);
- the commands the driver sent the JVM over py4j (planning a window is mostly these);
- what PostgreSQL did (sessions, transactions, rows inserted, updated and deleted; the run's
  fresh database and this profile's own queries add a session or two a run).

`--peer` profiles the peer (`peer_pipeline.py`) the same way after each repeat.

`--statements` also times the SQL statements the driver runs (its commits, the ledger, the key
index), by statement with staging table names and numbers folded, and prints the costliest per
window.

`--python-profile` also profiles the Python workers (Spark's `perf` UDF profiler, cProfile in
each worker) and prints their profiled time a window with the functions that took most of it,
over every `mapInArrow` of the window (the parse with the key lookup, the sinks' writers). The
profiler slows the workers down, so the other figures of such a run are not comparable; the
profiled time includes waits (for the JVM's batches, for PostgreSQL), not only CPU.

`--round-trips` also counts the py4j commands by where they come from: the innermost onceflow
function on the sending thread's stack and the PySpark call it made (releases apart).

`--conf key=value` (repeatable) sets a Spark setting for the session, to compare one against
the defaults. Nothing here is a pass/fail figure; it is what the next change is compared on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from payments_bench import run_engine, run_peer_pipeline

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: str, *, reaped: bool = False) -> tuple[str, float] | None:
    """(name, CPU seconds) of a process or thread; `reaped`: add its exited children's."""
    try:
        raw = Path(stat_path).read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return name, ticks / _TICKS


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy, from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def _kind(cmdline: str) -> str | None:
    if "java" in cmdline:
        return "Spark JVM"
    if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline:
        return "Python workers"
    if "postgres" in cmdline:
        return "PostgreSQL"
    return None


def _processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process still running."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        except OSError:
            continue
        yield int(pid), cmdline.replace("\0", " ")


def process_cpu() -> collections.Counter[str]:
    """CPU seconds used so far by this driver, the Spark JVM, its Python workers and the
    PostgreSQL server (with its backends that exited, which the server process has reaped)."""
    out: collections.Counter[str] = collections.Counter()
    for pid, cmdline in _processes():
        kind = "driver" if pid == os.getpid() else _kind(cmdline)
        found = _cpu_s(f"/proc/{pid}/stat", reaped=kind == "PostgreSQL") if kind else None
        if kind and found:
            out[kind] += found[1]
    return out


def postgres_activity(dsn: str) -> dict[str, int]:
    """The server's counters, over every database: sessions opened, transactions, rows."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT sum(sessions), sum(xact_commit + xact_rollback), sum(tup_inserted),"
            " sum(tup_updated), sum(tup_deleted) FROM pg_stat_database"
        ).fetchone()
    assert row is not None
    names = ("sessions", "transactions", "rows inserted", "rows updated", "rows deleted")
    return dict(zip(names, (int(v or 0) for v in row), strict=True))


def jvm_thread_cpu() -> collections.Counter[str]:
    """CPU seconds used so far inside the Spark JVM, by thread kind (digits folded)."""
    out: collections.Counter[str] = collections.Counter()
    for pid, cmdline in _processes():
        if _kind(cmdline) != "Spark JVM":
            continue
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            found = _cpu_s(f"/proc/{pid}/task/{tid}/stat")
            if found:
                out[re.sub(r"\d+", "N", found[0])] += found[1]
    return out


class Timers:
    """Total wall time and calls of a few engine methods, while `on`."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False
        self.labels: list[str] = []
        self.round_trips = 0  # py4j commands the driver sent the JVM
        self.releases = 0  # of them, py4j's releases of JVM objects Python let go of
        self.sites: collections.Counter[str] | None = None  # the others by call site, if asked

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        self.labels.append(label)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
                self.calls[label] += 1

        setattr(owner, name, timed)

    @contextmanager
    def active(self) -> Iterator[None]:
        self.seconds.clear()
        self.calls.clear()
        self.round_trips = 0
        self.releases = 0
        if self.sites is not None:
            self.sites.clear()
        self.on = True
        try:
            yield
        finally:
            self.on = False


def install_timers() -> Timers:
    from pyspark.sql.classic.dataframe import DataFrame  # what a local session makes

    from onceflow._keyindex import KeyIndex
    from onceflow.sinks.delta.group import DeltaGroup
    from onceflow.sinks.postgres.group import PostgresGroup
    from onceflow.window import commit, pipeline, prepare
    from onceflow.window.context import JobContext

    timers = Timers()
    count_round_trips(timers)
    # The stages, where the module calling each looks it up.
    timers.wrap(pipeline, "prepare", "prepare (planning + Spark job)")
    timers.wrap(prepare, "outputs", "  planning the outputs")
    timers.wrap(JobContext, "committed_sinks", "  which sinks hold the window")
    timers.wrap(PostgresGroup, "begin", "  the PostgreSQL staging tables")
    timers.wrap(DeltaGroup, "begin", "  the Delta writers")
    timers.wrap(KeyIndex, "staging_writer", "  the key staging table")
    timers.wrap(DataFrame, "collect", "  the Spark job (collect)")
    timers.wrap(pipeline, "commit", "commit (every sink, key index)")
    timers.wrap(PostgresGroup, "finish", "  the PostgreSQL sinks' transaction")
    timers.wrap(DeltaGroup, "finish", "  the Delta sinks' commits")
    timers.wrap(commit, "complete", "  completed, keys into the index")
    return timers


def count_round_trips(timers: Timers) -> None:
    """Count in `timers.round_trips` every command the driver sends the JVM over py4j (each
    DataFrame operation and each Column built in Python sends several), and in
    `timers.releases` those that release a JVM object whose Python proxy was collected: py4j
    sends one per proxy, from whichever thread collects it, so they are not planning's."""
    from py4j.clientserver import ClientServerConnection
    from py4j.protocol import MEMORY_COMMAND_NAME, MEMORY_DEL_SUBCOMMAND_NAME

    release = MEMORY_COMMAND_NAME + MEMORY_DEL_SUBCOMMAND_NAME
    original = ClientServerConnection.send_command

    @functools.wraps(original)
    def counted(connection: Any, command: str, *args: Any, **kwargs: Any) -> Any:
        if timers.on:
            timers.round_trips += 1
            if command.startswith(release):
                timers.releases += 1
            elif timers.sites is not None:
                timers.sites[call_site()] += 1
        return original(connection, command, *args, **kwargs)

    ClientServerConnection.send_command = counted  # type: ignore[method-assign]


def call_site() -> str:
    """The innermost onceflow function on this thread's stack, and the PySpark call it made."""
    stack = traceback.extract_stack()
    ours = [i for i, frame in enumerate(stack) if "/onceflow/" in frame.filename]
    if not ours:
        return "outside onceflow"
    caller = stack[ours[-1]]
    called = next((f for f in stack[ours[-1] + 1 :] if "/pyspark/" in f.filename), None)
    site = f"{Path(caller.filename).name}:{caller.name}"
    return f"{site} -> {called.name}" if called is not None else site


def spark_jobs(event_dir: Path, after: int) -> list[tuple[int, int, int, int | None, int]]:
    """(job id, wall ms, task JVM CPU ms, ms from its query's start to the job's, tasks) of
    the jobs with an id above `after`. The fourth is Spark's own work on the query before the
    job (optimising and planning it, its description, code generation, building its RDDs);
    None for a job outside a query."""
    jobs: dict[int, dict[str, Any]] = {}
    stage_job: dict[int, int] = {}
    queries: dict[int, int] = {}
    for path in event_dir.glob("*/*"):
        with path.open() as lines:
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:  # the line Spark is writing now
                    continue
                kind = event["Event"]
                if kind.endswith("SparkListenerSQLExecutionStart"):
                    queries[event["executionId"]] = event["time"]
                elif kind == "SparkListenerJobStart" and event["Job ID"] > after:
                    query = (event.get("Properties") or {}).get("spark.sql.execution.id")
                    jobs[event["Job ID"]] = {
                        "start": event["Submission Time"],
                        "cpu": 0,
                        "tasks": 0,
                        "query": None if query is None else int(query),
                    }
                    for stage in event["Stage IDs"]:
                        stage_job[stage] = event["Job ID"]
                elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
                    jobs[event["Job ID"]]["end"] = event["Completion Time"]
                elif kind == "SparkListenerTaskEnd" and event["Stage ID"] in stage_job:
                    metrics = event.get("Task Metrics") or {}
                    cpu_ms = metrics.get("Executor CPU Time", 0) // 1_000_000
                    jobs[stage_job[event["Stage ID"]]]["cpu"] += cpu_ms
                    jobs[stage_job[event["Stage ID"]]]["tasks"] += 1
    return [
        (
            jid,
            j["end"] - j["start"],
            j["cpu"],
            j["start"] - queries[j["query"]] if j["query"] in queries else None,
            j["tasks"],
        )
        for jid, j in sorted(jobs.items())
        if "end" in j
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--files-per-window", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--statements", action="store_true", help="time the driver's SQL statements by kind"
    )
    parser.add_argument(
        "--peer", action="store_true", help="after each repeat, profile the peer on the same input"
    )
    parser.add_argument(
        "--python-profile",
        action="store_true",
        help="profile the Python workers (slows them: compare other figures without it)",
    )
    parser.add_argument(
        "--round-trips", action="store_true", help="count the py4j commands by call site"
    )
    args = parser.parse_args(argv)

    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import pgserver

    from onceflow.generate import generate_payments
    from onceflow.spark import build_spark_session

    work = Path(tempfile.mkdtemp(prefix="onceflow-profile-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    events = work / "events"
    events.mkdir()
    try:
        server_dsn = pgserver.get_server(work / "pg", cleanup_mode="stop").get_uri()
        landing, warm = work / "landing", work / "warm"
        per = args.files_per_window
        # The input of `payments_bench.py`: 5 % duplicates, 1 % invalid lines.
        rates = {"duplicate_rate": 0.05, "invalid_rate": 0.01}
        generate_payments(landing, records=args.records, files=args.files, seed=1, **rates)
        generate_payments(
            warm, records=2 * per * (args.records // args.files), files=2 * per, seed=2, **rates
        )
        conf = {
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": events.as_uri(),
            "spark.eventLog.compress": "false",
            **dict(kv.split("=", 1) for kv in args.conf),
        }
        if args.python_profile:
            conf["spark.sql.pyspark.udf.profiler"] = "perf"
        spark = build_spark_session(app_name="onceflow-profile", conf=conf)
        run_engine(spark, server_dsn, work, warm, "exactly_once", "warm", per)
        if args.peer:
            run_peer_pipeline(spark, server_dsn, work, warm, per)
        if args.python_profile:
            spark.profile.clear(type="perf")  # not the warm-up's
        timers = install_timers()
        if args.round_trips:
            timers.sites = collections.Counter()
        statements = StatementTimer() if args.statements else None
        print(f"machine: {os.cpu_count()} cores; extra Spark settings: {args.conf or 'none'}")

        def profiled(run: Callable[[], Any]) -> tuple[Any, Usage]:
            # From the event log, not the status tracker: the peer's streaming query runs its
            # jobs in a job group of its own, which the tracker lists apart.
            last_job = max((job[0] for job in spark_jobs(events, -1)), default=-1)
            cpu0, threads0, busy0 = process_cpu(), jvm_thread_cpu(), machine_busy_s()
            pg0 = postgres_activity(server_dsn)
            codegen0 = codegen_compilations(spark)
            out = run()
            codegen = codegen_compilations(spark) - codegen0
            cpu, threads = process_cpu() - cpu0, jvm_thread_cpu() - threads0
            busy = machine_busy_s() - busy0
            time.sleep(1.5)  # a backend reports its counters at most once a second
            pg = postgres_activity(server_dsn)
            activity = {k: pg[k] - pg0[k] for k in pg}
            return out, Usage(spark_jobs(events, last_job), cpu, threads, busy, activity, codegen)

        for rep in range(1, args.repeat + 1):
            with timers.active(), statements.active() if statements else contextlib.nullcontext():
                (m, _), usage = profiled(
                    lambda: run_engine(spark, server_dsn, work, landing, "exactly_once", "p", per)
                )
            print(
                f"\nrepeat {rep}: {m.seconds:.1f} s for {m.windows} windows "
                f"({m.seconds / max(1, m.windows):.2f} s a window); "
                f"latency p50 {statistics.median(m.window_latency):.2f} s"
            )
            report(max(1, m.windows), m.seconds, usage, timers)
            if statements is not None:
                statements.report(max(1, m.windows))
            if args.python_profile:
                python_workers_report(spark, work / f"udf-profile-{rep}", max(1, m.windows))
            if args.peer:
                peer, usage = profiled(
                    lambda: run_peer_pipeline(spark, server_dsn, work, landing, per)
                )
                print(
                    f"  the peer: {peer.seconds:.1f} s for {peer.windows} batches "
                    f"({peer.seconds / max(1, peer.windows):.2f} s a batch)"
                )
                report(max(1, peer.windows), peer.seconds, usage)
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


class StatementTimer(Timers):
    """Wall time of the SQL statements run on the driver's main thread (its commits, the
    ledger, the key index; not the executors' COPYs), by statement text with the staging
    tables' names and the numbers folded, while `on`."""

    def __init__(self) -> None:
        import psycopg

        super().__init__()
        original = psycopg.Connection.execute
        timer = self

        @functools.wraps(original)
        def timed(conn: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            if not timer.on or threading.current_thread() is not threading.main_thread():
                return original(conn, query, *args, **kwargs)
            started = time.perf_counter()
            try:
                return original(conn, query, *args, **kwargs)
            finally:
                text = query if isinstance(query, str) else query.as_string(None)
                text = re.sub(r'"(stage|keys)_[0-9a-f]+"', "<staging>", " ".join(text.split()))
                text = re.sub(r"\b\d+\b", "N", text)  # window ids written as literals
                timer.seconds[text] += time.perf_counter() - started
                timer.calls[text] += 1

        psycopg.Connection.execute = timed  # type: ignore[method-assign]

    def report(self, windows: int, top: int = 8) -> None:
        print("  SQL statements on the driver's main thread, the costliest:")
        for text, total in self.seconds.most_common(top):
            print(
                f"    {total / windows:6.3f} s a window ({self.calls[text]:3d} calls) {text[:88]}"
            )


@dataclass(frozen=True)
class Usage:
    """What one profiled run used: its Spark jobs, CPU by process and JVM thread, the machine."""

    jobs: list[tuple[int, int, int, int | None]]
    cpu: collections.Counter[str]
    threads: collections.Counter[str]
    busy_s: float
    postgres: dict[str, int]
    codegen: int


def codegen_compilations(spark: Any) -> int:
    """How many classes Spark's code generation has compiled in this JVM: a plan whose
    generated code Spark compiled before (the same code, literals included) compiles none."""
    metrics = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics
    return int(metrics.METRIC_COMPILATION_TIME().getCount())


def python_workers_report(spark: Any, folder: Path, windows: int, top: int = 12) -> None:
    """Print the Python workers' profiled time since the last call, a window, with the
    functions that took most of it (own time), over every profiled UDF; then clear it."""
    import pstats

    spark.profile.dump(str(folder), type="perf")
    spark.profile.clear(type="perf")
    files = sorted(folder.glob("*.pstats"))
    if not files:
        print("  Python workers: nothing profiled")
        return
    profiled = sum(pstats.Stats(str(f)).total_tt for f in files)  # type: ignore[attr-defined]
    print(
        f"  Python workers, profiled: {profiled / windows:.3f} s a window over "
        f"{len(files) / windows:.1f} UDFs a window; the costliest functions (own time):"
    )
    merged = pstats.Stats(*(str(f) for f in files))
    rows = sorted(merged.stats.items(), key=lambda item: item[1][2], reverse=True)  # type: ignore[attr-defined]
    for (filename, line, function), (_, calls, own, _, _) in rows[:top]:
        where = f"{Path(filename).name}:{line}({function})" if line else function
        print(f"    {own / windows:6.3f} s a window ({calls / windows:8,.0f} calls) {where}")


def report(windows: int, seconds: float, usage: Usage, timers: Timers | None = None) -> None:
    if timers is not None:
        for label in timers.labels:
            total, calls = timers.seconds[label], timers.calls[label]
            print(f"  {label:<34} {total / windows:6.3f} s a window ({calls} calls)")
        # The driver's serial share: everything but the window's Spark job, which the
        # executors' cores share; the commit is the PostgreSQL server's work the driver waits on.
        driver_only = sum(
            timers.seconds[label]
            for label in timers.labels
            if label.startswith("commit") or label.startswith("prepare")
        ) - sum(
            timers.seconds[label]
            for label in timers.labels
            if label.strip().startswith("the Spark job")
        )
        print(f"  driver-only (all but the Spark job)  {driver_only / windows:6.3f} s a window")
        print(
            f"  py4j round trips, driver to JVM     {timers.round_trips / windows:6.0f} a window "
            f"({timers.releases / windows:.0f} of them releasing collected JVM objects)"
        )
        for site, count in (timers.sites or collections.Counter()).most_common(10):
            print(f"    {count / windows:6.1f} a window from {site}")
    if usage.jobs:
        walls, cpus = [j[1] for j in usage.jobs], [j[2] for j in usage.jobs]
        print(
            f"  Spark jobs: {len(usage.jobs)} ({len(usage.jobs) / windows:.1f} a window); median "
            f"wall {statistics.median(walls):.0f} ms, median task JVM CPU "
            f"{statistics.median(cpus):.0f} ms, median tasks "
            f"{statistics.median(j[4] for j in usage.jobs):.0f}"
        )
        before = [j[3] for j in usage.jobs if j[3] is not None]
        if before:
            print(
                f"  Spark's own work on a job's query before the job starts (optimiser, "
                f"physical plan, code generation, RDDs): median {statistics.median(before):.0f} "
                f"ms, max {max(before)} ms"
            )
    cpu = usage.cpu
    print(
        f"  CPU seconds: {sum(cpu.values()):.1f} ({sum(cpu.values()) / windows:.2f} a window): "
        + ", ".join(f"{k} {v:.1f}" for k, v in cpu.most_common())
    )
    capacity = seconds * (os.cpu_count() or 1)
    print(
        f"  machine busy: {usage.busy_s:.1f} of {capacity:.1f} core-seconds "
        f"({usage.busy_s / capacity:.0%})"
    )
    busiest = ", ".join(f"{k} {v:.1f}" for k, v in usage.threads.most_common(12) if v >= 0.1)
    print(f"  JVM threads: {busiest}")
    print(f"  generated code compiled: {usage.codegen / windows:.1f} classes a window")
    print(
        "  PostgreSQL a window: "
        + ", ".join(f"{v / windows:,.0f} {k}" for k, v in usage.postgres.items())
    )


if __name__ == "__main__":
    sys.exit(main())
