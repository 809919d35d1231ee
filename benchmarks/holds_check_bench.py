"""Benchmark: the start-up check that every sink holds every completed window, against history.

`Engine.check_sinks_hold_completed` runs before a run, recovery or reconcile computes anything:
it reads the ledger's completed windows and asks each sink group which of them it holds (the
PostgreSQL markers, the Delta table's id and app transaction, each table's identity against
the ledger's record). Here the `payments` job's ledger, markers and Delta table are written
directly with `--small` and `--large` completed windows (no Spark: the check needs none), and
the check is timed `--repeat` times per size after a first one (which has no verified point
to start from, and records one); printed: the median, the first, and the large size's ratio
to the small one. `--folded`: the PostgreSQL markers folded into range rows first
(`onceflow.sinks.postgres._folded`), as `onceflow maintain` leaves windows past the detail
horizon.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import psycopg
import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from peer_pipeline import fresh_database


def build_history(dsn: str, lake: Path, windows: int, folded: bool = False) -> object:
    """A `payments` ledger with `windows` completed windows held by every sink (with
    `folded`, the PostgreSQL markers folded as maintenance folds them, 5,000 windows a row)."""
    from onceflow._identifiers import delta_app_id
    from onceflow.engine import Engine
    from onceflow.registry import get_job
    from onceflow.settings import Settings
    from onceflow.sink_state import SinkState

    job = get_job("payments")
    settings = Settings(home=lake.parent / "home", postgres_dsn=dsn, lake=lake, landing=lake)
    engine = Engine(job, settings, None, dsn)
    engine.prepare()
    pg_sinks = [n for g in engine.groups if g.kind == "postgres" for n in g.names]
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO onceflow.windows (job, window_id, offsets, epoch, completed_at)"
            " SELECT 'payments', g, '{}'::jsonb, 1, now() FROM generate_series(1, %s) AS g",
            (windows,),
        )
        conn.execute(
            "INSERT INTO onceflow.sink_commits"
            " (job, sink, window_id, epoch, xid, offsets, rows_written)"
            " SELECT 'payments', s, g, 1, '1'::xid8, '{}'::jsonb, 1"
            " FROM generate_series(1, %s) AS g, unnest(%s::text[]) AS s",
            (windows, pg_sinks),
        )
    if folded:
        from onceflow.maintain._detail import CHUNK
        from onceflow.sinks.postgres._folded import fold

        with psycopg.connect(dsn) as conn:
            for through in range(CHUNK, windows + CHUNK, CHUNK):
                fold(conn, job.name, pg_sinks, min(through, windows))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")  # as autovacuum would after such a load
    for group in engine.groups:
        if group.kind != "delta":
            continue
        for sink in job.sinks:
            if sink.name not in group.names:
                continue
            path = lake / sink.table  # type: ignore[attr-defined]
            write_deltalake(
                str(path),
                pa.table({"payment_id": ["p"], "_window_id": [1]}),
                commit_properties=CommitProperties(
                    custom_metadata={"onceflow.note": json.dumps("bench")},
                    app_transactions=[Transaction(delta_app_id(job.name, sink.name), windows)],
                ),
            )
            SinkState(engine.ledger).record_identity(
                sink.name, str(DeltaTable(str(path)).metadata().id)
            )
    return Engine(job, settings, None, dsn)


def per_window(engine: object, windows: int, calls: int = 200) -> str:
    """What each window's commit adds to prove the sinks' state: the Delta group's read of what
    the ledger expects (once at the window's set-up, once at its commit) and the PostgreSQL
    transaction's table check, timed on the engine's kept sessions."""
    import psycopg

    from onceflow.sink_state import SinkState
    from onceflow.sinks.postgres.commit import _check_tables

    state = SinkState(engine.ledger)  # type: ignore[attr-defined]
    delta = next(n for g in engine.groups if g.kind == "delta" for n in g.names)  # type: ignore[attr-defined]
    pg = next(g for g in engine.groups if g.kind == "postgres")  # type: ignore[attr-defined]
    with engine.ledger.sessions.kept():  # type: ignore[attr-defined]
        started = time.perf_counter()
        for _ in range(calls):
            state.expected(delta, windows + 1)
        expected_ms = (time.perf_counter() - started) / calls * 1000
    with psycopg.connect(engine.dsn) as conn:  # type: ignore[attr-defined]
        started = time.perf_counter()
        for _ in range(calls):
            _check_tables(conn, "payments", list(pg.specs))
        tables_ms = (time.perf_counter() - started) / calls * 1000
    return (
        f"expected-state read {expected_ms:.2f} ms (x2 per Delta sink), "
        f"PostgreSQL table check {tables_ms:.2f} ms (x1 per window)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--folded", action="store_true", help="the markers folded, as maintenance leaves them"
    )
    args = parser.parse_args(argv)
    import pgserver

    work = Path(tempfile.mkdtemp(prefix="onceflow-holds-"))
    work.chmod(0o755)  # the embedded server runs as another user when we are root
    server_dsn = os.environ.get("ONCEFLOW_POSTGRES_DSN")
    server = None
    if not server_dsn:
        server = pgserver.get_server(work / "pg", cleanup_mode="stop")
        server_dsn = server.get_uri()
    medians: dict[int, float] = {}
    try:
        for size in (args.small, args.large):
            dsn = fresh_database(server_dsn, "holds")
            engine = build_history(dsn, work / f"lake-{size}", size, folded=args.folded)
            started = time.perf_counter()
            engine.check_sinks_hold_completed()  # no verified point yet; warms the sessions
            first = time.perf_counter() - started
            times = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                engine.check_sinks_hold_completed()
                times.append(time.perf_counter() - started)
            medians[size] = statistics.median(times)
            print(
                f"{size:>7} completed windows: holds check median {medians[size] * 1000:.1f} ms"
                f" (min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); the first,"
                f" without a verified point: {first * 1000:.1f} ms"
            )
            print(f"{size:>7} completed windows: per window, {per_window(engine, size)}")
    finally:
        if server is not None:
            server.cleanup()
    ratio = medians[args.large] / medians[args.small]
    print(f"{args.large} / {args.small} windows: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
