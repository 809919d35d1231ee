"""Where a window's time goes: `payments` windows profiled in one warm Spark session.

Runs `onceflow run payments` in-process `--repeat` times over the same generated input (a fresh
database and lake each time, after a two-window warm-up) and prints, per repeat:

- wall time and window latency (plan → committed in every sink);
- per window, the driver's time in preparing (planning, the window's Spark job) and in
  committing, which overlap (the engine prepares window N+1 while N commits);
- the window's Spark jobs, from Spark's event log: how many, their wall time and the JVM CPU
  of their tasks;
- CPU seconds by process (the Spark JVM, its Python workers, this driver) and, inside the JVM,
  by thread kind: the JIT compiler threads against the executor's task threads.

`--conf key=value` (repeatable) sets a Spark setting for the session, to compare one against
the defaults. Nothing here is a pass/fail figure; it is what the next change is compared on.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from payments_bench import run_engine

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: str) -> tuple[str, float] | None:
    try:
        raw = Path(stat_path).read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / _TICKS


def _kind(cmdline: str) -> str | None:
    if "java" in cmdline:
        return "Spark JVM"
    if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline:
        return "Python workers"
    if "postgres" in cmdline:
        return "PostgreSQL (live processes)"
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
    PostgreSQL server (processes that exited are not counted: short-lived PostgreSQL
    backends are missed)."""
    out: collections.Counter[str] = collections.Counter()
    for pid, cmdline in _processes():
        kind = "driver" if pid == os.getpid() else _kind(cmdline)
        found = _cpu_s(f"/proc/{pid}/stat") if kind else None
        if kind and found:
            out[kind] += found[1]
    return out


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
        self.on = True
        try:
            yield
        finally:
            self.on = False


def install_timers() -> Timers:
    from pyspark.sql.classic.dataframe import DataFrame  # what a local session makes

    from onceflow.engine import Engine

    timers = Timers()
    timers.wrap(Engine, "_prepare", "prepare (planning + Spark job)")
    timers.wrap(Engine, "outputs", "  planning the outputs")
    timers.wrap(DataFrame, "collect", "  the Spark job (collect)")
    timers.wrap(Engine, "_commit", "commit (every sink, key index)")
    return timers


def spark_jobs(event_dir: Path, after: int) -> list[tuple[int, int, int]]:
    """(job id, wall ms, task JVM CPU ms) of the jobs with an id above `after`."""
    jobs: dict[int, dict[str, Any]] = {}
    stage_job: dict[int, int] = {}
    for path in event_dir.glob("*/*"):
        with path.open() as lines:
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:  # the line Spark is writing now
                    continue
                kind = event["Event"]
                if kind == "SparkListenerJobStart" and event["Job ID"] > after:
                    jobs[event["Job ID"]] = {"start": event["Submission Time"], "cpu": 0}
                    for stage in event["Stage IDs"]:
                        stage_job[stage] = event["Job ID"]
                elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
                    jobs[event["Job ID"]]["end"] = event["Completion Time"]
                elif kind == "SparkListenerTaskEnd" and event["Stage ID"] in stage_job:
                    metrics = event.get("Task Metrics") or {}
                    cpu_ms = metrics.get("Executor CPU Time", 0) // 1_000_000
                    jobs[stage_job[event["Stage ID"]]]["cpu"] += cpu_ms
    return [(jid, j["end"] - j["start"], j["cpu"]) for jid, j in sorted(jobs.items()) if "end" in j]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--files-per-window", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
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
        spark = build_spark_session(app_name="onceflow-profile", conf=conf)
        run_engine(spark, server_dsn, work, warm, "exactly_once", "warm", per)
        timers = install_timers()
        tracker = spark.sparkContext.statusTracker()
        print(f"machine: {os.cpu_count()} cores; extra Spark settings: {args.conf or 'none'}")
        for rep in range(1, args.repeat + 1):
            last_job = max(tracker.getJobIdsForGroup(), default=-1)
            cpu0, threads0 = process_cpu(), jvm_thread_cpu()
            with timers.active():
                m, _ = run_engine(spark, server_dsn, work, landing, "exactly_once", "p", per)
            cpu, threads = process_cpu() - cpu0, jvm_thread_cpu() - threads0
            report(rep, m, timers, spark_jobs(events, last_job), cpu, threads)
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(
    rep: int,
    m: Any,
    timers: Timers,
    jobs: list[tuple[int, int, int]],
    cpu: collections.Counter[str],
    threads: collections.Counter[str],
) -> None:
    windows = max(1, m.windows)
    latency = sorted(m.window_latency)
    print(
        f"\nrepeat {rep}: {m.seconds:.1f} s for {m.windows} windows "
        f"({m.seconds / windows:.2f} s a window); latency p50 {statistics.median(latency):.2f} s"
    )
    for label in timers.labels:
        seconds, calls = timers.seconds[label], timers.calls[label]
        print(f"  {label:<34} {seconds / windows:6.3f} s a window ({calls} calls)")
    if jobs:
        walls, cpus = [j[1] for j in jobs], [j[2] for j in jobs]
        print(
            f"  Spark jobs: {len(jobs)} ({len(jobs) / windows:.1f} a window); median wall "
            f"{statistics.median(walls):.0f} ms, median task JVM CPU {statistics.median(cpus):.0f} ms"
        )
    print("  CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.most_common()))
    busiest = ", ".join(f"{k} {v:.1f}" for k, v in threads.most_common(4) if v >= 0.1)
    print(f"  JVM threads: {busiest}")


if __name__ == "__main__":
    sys.exit(main())
