"""A ledger that lost one of its tables after a crash: the next run is exact, or refuses with
the fix named and is exact after it; it never drops or doubles input, and never reports success
while a sink lacks a window it was told to hold.

Each crash is a real `onceflow run payments` killed at a protocol point; its database and lake
are kept as a template, and every case starts from a copy of them, drops one ledger table and
recovers in process (with another window size).
"""

from __future__ import annotations

import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from onceflow.engine import Engine
from onceflow.errors import OnceflowError
from onceflow.generate import generate_payments
from onceflow.reconcile import format_report, reconcile
from onceflow.registry import get_job
from onceflow.settings import Settings
from tests.support.cli import CliRun, cli_env
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

pytestmark = pytest.mark.slow

JOB = "payments"
# Every table the ledger and the protocols keep in the `onceflow` schema (not the sinks' own
# tables, not UNLOGGED staging): `test_the_matrix_covers_every_ledger_table` keeps it whole.
LEDGER_TABLES = (
    "jobs",
    "windows",
    "source_units",
    "restatements",
    "sink_versions",
    "reconciliations",
    "reconcile_baselines",
    "detail_pruned",
    "abandoned_windows",
    "sink_tables",
    "check_results",
    "dedupe_keys",
    "dedupe_windows",
    "sink_commits",
    "sink_commits_folded",
    "sink_commits_verified",
    "restate_commits",
    "window_contributions",
    "contributions",
    "ledger_verified",
    "ledger_removals",
    "window_plans_folded",
)
# Tables of the `onceflow` schema that are a sink's data, not the ledger's.
SINK_TABLES = ("quarantine",)
# Where a run can die between planning a window and completing it (`onceflow.faults`).
POINTS = ("plan", "before_sinks", "after_delta", "pg_staged", "pg_commit_sent", "after_commits")
# The point every other table is dropped after: window 2 is in the Delta table only.
REPRESENTATIVE = "after_delta"
# `make test` drops the window plan after the points where what the sinks hold differs most
# (nothing yet, the Delta table only, a COMMIT whose answer was lost); `make test-all` all.
IN_CI = ("plan", "after_delta", "pg_commit_sent")
CASES = [
    pytest.param("windows", point, marks=() if point in IN_CI else pytest.mark.exhaustive)
    for point in POINTS
] + [pytest.param(table, REPRESENTATIVE) for table in LEDGER_TABLES if table != "windows"]


def _with_db(dsn: str, name: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


def _end_sessions(server: str, name: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )


@dataclass(frozen=True)
class Crashed:
    """A database and lake as a killed run left them (templates: copied, never changed)."""

    database: str
    lake: Path


@dataclass
class Crashes:
    server: str
    root: Path
    landing: Path
    made: dict[str, Crashed]

    def at(self, point: str) -> Crashed:
        """`onceflow run payments` (two files a window) killed at `point` in window 2."""
        if point in self.made:
            return self.made[point]
        name = f"crash_{point}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(self.server, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        home, lake = self.root / point / "home", self.root / point / "lake"
        lake.mkdir(parents=True)
        env = cli_env(
            home=home,
            dsn=_with_db(self.server, name),
            lake=lake,
            landing=self.landing,
            fault=f"{point}@2",
        )
        args = ["run", JOB, "--max-files-per-window", "2"]
        crashed = CliRun(args, env, home / "logs").finish()
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
        assert f"fault injected at {point} (window 2)" in crashed.stderr
        _end_sessions(self.server, name)  # a template must have no session
        self.made[point] = Crashed(name, lake)
        return self.made[point]


@pytest.fixture(scope="module")
def crashes(pg_server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crashes]:
    root = tmp_path_factory.mktemp("crashes")
    landing = root / "landing"
    generate_payments(landing, records=3000, files=6, duplicate_rate=0.15, invalid_rate=0.05)
    made = Crashes(pg_server_dsn, root, landing, {})
    yield made
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        for crashed in made.made.values():
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(crashed.database)
                )
            )


@dataclass
class Site:
    dsn: str
    settings: Settings
    landing: Path
    lake: Path
    spark: Any

    def engine(self) -> Engine:
        return Engine(get_job(JOB), self.settings, self.spark, self.dsn)


@pytest.fixture()
def copy_of(
    crashes: Crashes, spark: Any, tmp_path: Path, pg_server_dsn: str
) -> Iterator[Callable[[str], Site]]:
    made: list[str] = []

    def copy(point: str) -> Site:
        crashed = crashes.at(point)
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(crashed.database)
                )
            )
        made.append(name)
        lake = tmp_path / "lake"
        shutil.copytree(crashed.lake, lake)
        dsn = _with_db(pg_server_dsn, name)
        settings = Settings(
            home=tmp_path / "home", postgres_dsn=dsn, lake=lake, landing=crashes.landing
        )
        return Site(dsn, settings, crashes.landing, lake, spark)

    yield copy
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _drop(dsn: str, table: str) -> None:
    with psycopg.connect(dsn) as conn:
        # CASCADE: the lineage view reads some of them (the ledger puts it back).
        conn.execute(sql.SQL("DROP TABLE {} CASCADE").format(sql.Identifier("onceflow", table)))


def _assert_whole(engine: Engine) -> None:
    """What a successful command promises: every planned window completed (or given up) and
    held by every sink, and no visible input left unplanned."""
    assert engine.lacking_windows() == {}
    windows = engine.ledger.windows()
    assert [w.window_id for w in windows if not w.completed and w.skipped is None] == []
    assert engine.incomplete_windows(windows) == {}
    assert engine.unplanned_units() == []


def _recover(site: Site) -> list[str]:
    """Run with another window size; a refusal must name its fix, which is then applied.
    Returns the fixes applied."""
    fixes: list[str] = []
    for _ in range(3):
        try:
            site.engine().run(max_units_per_window=3)
        except OnceflowError as exc:
            if f"onceflow reconcile {JOB}" not in exc.message:
                raise
            fixes.append("reconcile")
            report = reconcile(site.engine())
            assert report.clean or not report.lacking, format_report(report)
            continue
        _assert_whole(site.engine())
        return fixes
    pytest.fail(f"still refused after {fixes}")


@pytest.mark.parametrize(
    ("table", "point"), CASES, ids=[f"{c.values[0]}-{c.values[1]}" for c in CASES]
)
def test_a_ledger_table_lost_after_a_crash_is_detected_or_harmless(
    copy_of: Callable[[str], Site], table: str, point: str
) -> None:
    site = copy_of(point)
    _drop(site.dsn, table)
    fixes = _recover(site)
    print(f"{table} lost after a crash at {point}: fixes {fixes or 'none'}")
    assert_exact(expected_outputs(site.landing), actual_outputs(site.dsn, site.lake))
    # And a later run changes nothing.
    again = site.engine().run(max_units_per_window=3)
    assert all(w.noop for w in again.windows), again
    assert_exact(expected_outputs(site.landing), actual_outputs(site.dsn, site.lake))


def test_the_matrix_covers_every_ledger_table(copy_of: Callable[[str], Site]) -> None:
    site = copy_of(REPRESENTATIVE)
    site.engine().run(max_units_per_window=3)
    with psycopg.connect(site.dsn) as conn:
        tables = {
            name
            for (name,) in conn.execute(
                "SELECT relname FROM pg_class WHERE relnamespace = 'onceflow'::regnamespace"
                " AND relkind = 'r' AND relpersistence = 'p'"
            )
        }
    assert tables - set(SINK_TABLES) == set(LEDGER_TABLES)


def test_restatements_lost_then_a_new_restatement_is_applied(
    spark: Any, pg_dsn: str, tmp_path: Path, lake: Path, landing: Path
) -> None:
    """The sinks record the restatement numbers they applied; a ledger that lost its
    restatements must not number a new one as one they applied already (it would be skipped)."""
    from onceflow.restate import restate_windows
    from tests.support.flat_fee_payments import FLAT_FEE

    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    generate_payments(landing, records=800, files=2, duplicate_rate=0.1, invalid_rate=0.05)
    Engine(get_job(JOB), settings, spark, pg_dsn).run(max_units_per_window=2)
    restate_windows(Engine(FLAT_FEE, settings, spark, pg_dsn), [1], request_id="flat")
    _drop(pg_dsn, "restatements")

    [back] = restate_windows(Engine(get_job(JOB), settings, spark, pg_dsn), [1], request_id="back")
    assert back.sinks and all(s.committed for s in back.sinks.values()), back.sinks
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
