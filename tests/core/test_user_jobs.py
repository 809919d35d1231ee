"""Jobs are user code: a job module outside onceflow, found through ONCEFLOW_JOBS or
`[tool.onceflow]`, run by the real `onceflow` command, next to the reference jobs.

The user's project is tests/support/user_project (a `pyproject.toml` and `orders_jobs.py`,
no `__init__.py`): onceflow's own files never name it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import CsvSource, Dedupe, DeltaSink, Job, LandingSource, PostgresSink, ops
from onceflow.engine import build_engine
from onceflow.errors import ConfigurationError
from onceflow.generate import generate_payments
from onceflow.jobs.payments import PAYMENTS
from onceflow.registry import JOBS_ENV, load_jobs
from onceflow.settings import Settings
from tests.support.cli import TEST_JVM_ENV
from tests.support.orders_data import (
    FILES,
    JOB,
    USER_PROJECT,
    actual_orders,
    actual_quarantine,
    assert_orders_exact,
    expected_orders,
    one_file_per_window,
    user_project_on_path,
    write_orders,
)

ONCEFLOW = str(Path(sys.executable).with_name("onceflow"))
CLI_TIMEOUT_S = 300


# -- the CLI, as a user runs it ---------------------------------------------------------------


def _env(pg_dsn: str, lake: Path, landing: Path, home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_") and k != "PYTHONPATH"
    }
    env.update(
        ONCEFLOW_HOME=str(home),
        ONCEFLOW_POSTGRES_DSN=pg_dsn,
        ONCEFLOW_LAKE=str(lake),
        ONCEFLOW_LANDING=str(landing),
        GX_ANALYTICS_ENABLED="false",
        ONCEFLOW_DEBUG="1",  # an unexpected error shows its traceback
        **TEST_JVM_ENV,
    )
    env.update(extra)
    return env


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [ONCEFLOW, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        pytest.fail(
            f"onceflow {' '.join(args)} exited {result.returncode}\nstdout:\n"
            f"{result.stdout[-2000:]}\nstderr:\n{result.stderr[-3000:]}"
        )
    return result


def _table_state(dsn: str) -> dict[str, Any]:
    """Every row the job's sinks and commit records hold, with the transaction that wrote it
    (`xmin`): a rewrite with equal values still shows."""
    with psycopg.connect(dsn) as conn:
        return {
            "orders": sorted(
                conn.execute("SELECT xmin::text, * FROM public.orders").fetchall(), key=str
            ),
            "quarantine": sorted(
                conn.execute(
                    "SELECT xmin::text, * FROM onceflow.quarantine WHERE job = %s", (JOB,)
                ).fetchall(),
                key=str,
            ),
            "markers": sorted(
                conn.execute(
                    "SELECT sink, window_id, xid, rows_written FROM onceflow.sink_commits"
                    " WHERE job = %s",
                    (JOB,),
                ).fetchall()
            ),
        }


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


def test_cli_runs_a_user_job_named_in_onceflow_jobs(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, home: Path, tmp_path: Path
) -> None:
    # The working folder has no pyproject.toml: only ONCEFLOW_JOBS and PYTHONPATH name the job.
    env = _env(
        pg_dsn, lake, landing, home, ONCEFLOW_JOBS="orders_jobs", PYTHONPATH=str(USER_PROJECT)
    )
    listed = _cli(["jobs"], env, tmp_path)
    assert listed.stdout.splitlines()[0] == "jobs from ONCEFLOW_JOBS:"
    assert [line.split(":")[0].strip() for line in listed.stdout.splitlines()[1:]] == [JOB]
    assert "CSV landing files `orders/*.csv`" in listed.stdout
    assert "pg_orders (PostgreSQL table `public.orders` (upsert))" in listed.stdout
    assert "orders_quarantine (PostgreSQL table `onceflow.quarantine` (upsert))" in listed.stdout

    write_orders(landing)
    windows = one_file_per_window()
    run = _cli(["run", JOB, "--max-files-per-window", "1"], env, tmp_path)
    assert "3 window(s)" in run.stdout, run.stdout
    assert_orders_exact(pg_dsn, windows)
    # The update of o2 in window 3 won over its first version in window 1.
    assert next(r for r in actual_orders(pg_dsn) if r[0] == "o2")[1:3] == ("bob", 350)
    # Reasons name the column and the problem (never the value).
    reasons = {row[3]: reason for row, reason in actual_quarantine(pg_dsn) if row[1] == 1}
    assert reasons == {
        4: "amount_cents: not an integer",
        6: "ordered_at: timestamp has no UTC offset (add Z or ±HH:MM)",
    }

    status = json.loads(_cli(["status", JOB, "--json"], env, tmp_path).stdout)
    assert (status["job"], status["windows"], status["last_window"]) == (JOB, 3, 3)
    assert status["pending"] == [] and status["restatements_pending"] == []
    assert [w["window_id"] for w in status["recent"]] == [1, 2, 3]
    assert [w["units"] for w in status["recent"]] == [[f"orders/{n}"] for n in sorted(FILES)]
    assert all(w["completed"] for w in status["recent"])
    assert [w["sinks"] for w in status["recent"]] == [
        {"pg_orders": True, "orders_quarantine": True}
    ] * 3
    assert [w["stats"]["quarantined"] for w in status["recent"]] == [2, 1, 1]
    assert status["sinks"]["pg_orders"]["committed_through"] == 3
    assert status["sinks"]["orders_quarantine"]["committed_through"] == 3
    assert status["lag"]["unplanned_units"] == 0

    # A second run finds nothing new and writes nothing: not even identical values. It, and
    # the reconcile below, run in-process on the same job and settings (the CLI only prints
    # their results; a process would add a JVM start and nothing this test asserts).
    settings = Settings(home=home, postgres_dsn=pg_dsn, lake=lake, landing=landing)
    before = _table_state(pg_dsn)
    with user_project_on_path() as project:
        again = ops.run(project.ORDERS, settings, spark=spark, dsn=pg_dsn, max_units_per_window=1)
    assert again.windows == (), again
    assert _table_state(pg_dsn) == before

    # Restating windows 1-2 replaces their effect; o2 keeps its window-3 row.
    restated = _cli(["restate", JOB, "--windows", "1-2"], env, tmp_path)
    assert "window 1: restated in every sink" in restated.stdout, restated.stdout
    assert "window 2: restated in every sink" in restated.stdout, restated.stdout
    assert_orders_exact(pg_dsn, windows)
    after = _table_state(pg_dsn)
    assert after["orders"] != before["orders"]  # window 1-2 rows were rewritten
    assert {r for r in after["orders"] if r[-1] == 3} == {r for r in before["orders"] if r[-1] == 3}

    with user_project_on_path() as project:
        done = ops.reconcile(project.ORDERS, settings, spark=spark, dsn=pg_dsn, dry_run=True)
    report = ops.format_report(done)  # as `reconcile --dry-run` prints it
    lines = report.strip().splitlines()
    assert lines[-1] == "clean", report
    assert "windows checked: 1-3" in report
    assert _table_state(pg_dsn) == after


def test_cli_finds_a_user_job_through_tool_onceflow(
    pg_dsn: str, lake: Path, landing: Path, home: Path
) -> None:
    # No ONCEFLOW_JOBS, no PYTHONPATH: the pyproject.toml in the working folder names the
    # module, and its folder goes on the Python path.
    env = _env(pg_dsn, lake, landing, home)
    listed = _cli(["jobs"], env, USER_PROJECT)
    assert listed.stdout.splitlines()[0] == (
        f"jobs from [tool.onceflow] in {USER_PROJECT / 'pyproject.toml'}:"
    )
    assert [line.split(":")[0].strip() for line in listed.stdout.splitlines()[1:]] == [JOB]

    write_orders(landing, ["orders-001.csv", "orders-002.csv"])
    _cli(["run", JOB, "--max-files-per-window", "1"], env, USER_PROJECT)
    assert_orders_exact(pg_dsn, [["orders-001.csv"], ["orders-002.csv"]])
    write_orders(landing, ["orders-003.csv"])
    _cli(["run", JOB], env, USER_PROJECT)
    assert_orders_exact(pg_dsn, one_file_per_window())


# -- the registry: where jobs come from (no Spark) --------------------------------------------


def _job_code(var: str, name: str, sink: str) -> str:
    return (
        f"{var} = Job(name={name!r}, source=CsvSource({name!r}, schema={{'id': 'string'}}),"
        " transform=_t,"
        f" sinks=(PostgresSink({sink!r}, 'out', table={name!r}, columns={{'id': 'text'}}),))\n"
    )


_HEAD = "from onceflow import CsvSource, Job, PostgresSink\n\ndef _t(rows, ctx):\n    return {'out': rows}\n\n"


class Modules:
    """Job modules written into a fresh folder on `sys.path`, with names no other test uses."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tag = uuid.uuid4().hex[:8]
        self.names: list[str] = []

    def write(self, stem: str, body: str, head: str = _HEAD, folder: Path | None = None) -> str:
        name = f"{stem}_{self.tag}"
        (folder or self.folder).mkdir(parents=True, exist_ok=True)
        (folder or self.folder).joinpath(f"{name}.py").write_text(head + textwrap.dedent(body))
        self.names.append(name)
        return name


@pytest.fixture()
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Modules]:
    folder = tmp_path / "on_path"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", [str(folder), *sys.path])
    made = Modules(folder)
    yield made
    for name in made.names:
        sys.modules.pop(name, None)


def test_onceflow_never_names_the_user_job() -> None:
    root = USER_PROJECT.parents[2]
    own = [root / "definitions.py", root / "pyproject.toml", root / "workspace.yaml"]
    for folder in ("platform", "assets", "resources", "sensors"):
        own += sorted((root / folder).rglob("*.py"))
    assert len(own) > 20
    for path in own:
        text = path.read_text()
        assert "orders_jobs" not in text and "user_project" not in text, path


@pytest.fixture(autouse=True)
def _keep_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry puts a pyproject's folder on `sys.path`; undo that after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def _load(entries: str, cwd: Path) -> Any:
    return load_jobs(env={JOBS_ENV: entries}, cwd=cwd)


def test_reference_jobs_load_when_nothing_is_configured(tmp_path: Path) -> None:
    assert not any((p / "pyproject.toml").exists() for p in (tmp_path, *tmp_path.parents))
    found = load_jobs(env={}, cwd=tmp_path)
    assert found.names == ["payments", "daily_totals"]
    assert found.origin == "the reference jobs"
    # An empty (blank) ONCEFLOW_JOBS is "not set".
    assert load_jobs(env={JOBS_ENV: " "}, cwd=tmp_path).names == ["payments", "daily_totals"]


def test_user_project_loads_by_env_and_by_pyproject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "orders_jobs", raising=False)
    with pytest.raises(ConfigurationError, match="cannot import 'orders_jobs'"):
        _load("orders_jobs", tmp_path)  # not on the path: nothing in onceflow knows it
    found = load_jobs(env={}, cwd=USER_PROJECT)
    assert found.names == [JOB]
    assert found.origin == f"[tool.onceflow] in {USER_PROJECT / 'pyproject.toml'}"
    assert str(USER_PROJECT) in sys.path
    job = found.get(JOB)
    assert [s.name for s in job.sinks] == ["pg_orders", "orders_quarantine"]
    assert job.quarantine_sink == "orders_quarantine"
    sys.modules.pop("orders_jobs", None)


def test_onceflow_jobs_wins_over_pyproject(modules: Modules, tmp_path: Path) -> None:
    project = tmp_path / "project"
    in_project = modules.write(
        "proj", _job_code("A", "from_pyproject", "s_pyproject"), folder=project
    )
    (project / "pyproject.toml").write_text(f'[tool.onceflow]\njobs = ["{in_project}"]\n')
    on_path = modules.write("env", _job_code("B", "from_env", "s_env"))
    deep = project / "src" / "deeper"
    deep.mkdir(parents=True)

    found = _load(on_path, deep)
    assert (found.names, found.origin) == (["from_env"], "ONCEFLOW_JOBS")
    assert str(project) not in sys.path  # the pyproject was not even read

    # Without the variable, the nearest pyproject.toml from the working folder up is used.
    found = load_jobs(env={}, cwd=deep)
    assert found.names == ["from_pyproject"]
    assert found.origin == f"[tool.onceflow] in {project / 'pyproject.toml'}"
    assert str(project) in sys.path


def test_only_the_nearest_pyproject_counts(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    (outer / "inner" / "src").mkdir(parents=True)
    (outer / "other").mkdir()
    (outer / "pyproject.toml").write_text('[tool.onceflow]\njobs = ["no_such_jobs_module"]\n')
    (outer / "inner" / "pyproject.toml").write_text('[project]\nname = "inner"\n')
    # The nearest pyproject.toml has no [tool.onceflow]: the search stops there.
    assert load_jobs(env={}, cwd=outer / "inner" / "src").names == ["payments", "daily_totals"]
    with pytest.raises(ConfigurationError, match="cannot import 'no_such_jobs_module'") as caught:
        load_jobs(env={}, cwd=outer / "other")
    assert caught.value.message.startswith(f"[tool.onceflow] in {outer / 'pyproject.toml'}: ")


def test_entries_module_name_list_and_function(modules: Modules, tmp_path: Path) -> None:
    name = modules.write(
        "many",
        _job_code("ALPHA", "alpha", "s_alpha")
        + _job_code("BETA", "beta", "s_beta")
        + "JOBS = [ALPHA, BETA]\n"
        + "def make():\n    return (BETA,)\n"
        + "NUMBER = 42\n",
    )
    assert _load(name, tmp_path).names == ["alpha", "beta"]
    assert _load(f"{name}:BETA", tmp_path).names == ["beta"]
    assert _load(f"{name}:JOBS", tmp_path).names == ["alpha", "beta"]
    assert _load(f"{name}:make", tmp_path).names == ["beta"]
    # Spaces, empty entries and the same job twice are fine.
    assert _load(f" {name}:BETA , ,{name}:JOBS", tmp_path).names == ["beta", "alpha"]
    # User jobs and reference jobs side by side.
    both = _load(f"{name}:ALPHA,onceflow.jobs.payments", tmp_path)
    assert both.names == ["alpha", "payments"]
    assert both.get("payments") is PAYMENTS
    with pytest.raises(ConfigurationError, match=r"no job named 'gamma'.*alpha, payments"):
        both.get("gamma")


def test_registry_errors_are_configuration_errors(modules: Modules, tmp_path: Path) -> None:
    def refused(entries: str) -> str:
        with pytest.raises(ConfigurationError) as caught:
            _load(entries, tmp_path)
        return caught.value.message

    missing = f"no_such_module_{modules.tag}"
    message = refused(missing)
    assert f"cannot import {missing!r}" in message and "Python path" in message

    good = modules.write("good", _job_code("JOB", "good", "s_good") + "NUMBER = 42\n")
    message = refused(f"{good}:NUMBER")
    assert f"{good}:NUMBER is a int, not an onceflow Job" in message
    assert f"module {good} has no 'NOPE'" in refused(f"{good}:NOPE")
    assert "not an import path" in refused(":JOB")

    mixed = modules.write("mixed", _job_code("JOB", "mixed", "s_mixed") + "JOBS = [JOB, 1]\n")
    assert "is a list, not an onceflow Job" in refused(f"{mixed}:JOBS")

    empty = modules.write("empty", "VALUE = 1\n")
    assert f"module {empty} defines no onceflow Job at its top level" in refused(empty)

    twin = modules.write("twin", _job_code("JOB", "good", "s_twin"))
    assert "two jobs are named 'good'" in refused(f"{good},{twin}")

    sharing = modules.write("sharing", _job_code("JOB", "sharing", "s_good"))
    message = refused(f"{good},{sharing}")
    assert "jobs good and sharing both have a sink named 's_good'" in message
    # A user job may not take a sink name of a reference job either (pg_quarantine is payments').
    quarantined = modules.write(
        "quarantined",
        "from onceflow import quarantine_table\n"
        + _job_code("JOB", "quarantined", "s_q").replace(
            "),))", "), quarantine_table()), quarantine_sink='pg_quarantine')"
        ),
    )
    assert "both have a sink named 'pg_quarantine'" in refused(
        f"onceflow.jobs.payments,{quarantined}"
    )

    broken = modules.write("broken", _job_code("JOB", "broken", "bad sink name"))
    message = refused(broken)
    assert message.startswith(f"ONCEFLOW_JOBS: {broken}: sink name 'bad sink name'"), message

    # A module that fails while importing is as unloadable as a missing one.
    syntax = modules.write("syntax", "def (:\n")
    message = refused(syntax)
    assert f"importing {syntax!r} failed with SyntaxError" in message
    assert f"{syntax}.py, line 6" in message
    raising = modules.write("raising", "raise RuntimeError('no config here')\n")
    message = refused(raising)
    assert f"importing {raising!r} failed with RuntimeError: no config here" in message


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ('jobs = "orders_jobs"', "[tool.onceflow] jobs must be a list of import paths"),
        ("jobs = [1, 2]", "[tool.onceflow] jobs must be a list of import paths"),
        ("other = 1", "[tool.onceflow] jobs must be a list of import paths"),
        ("jobs = [", "cannot be read"),
    ],
)
def test_malformed_tool_onceflow(tmp_path: Path, table: str, says: str) -> None:
    (tmp_path / "pyproject.toml").write_text(f"[tool.onceflow]\n{table}\n")
    with pytest.raises(ConfigurationError) as caught:
        load_jobs(env={}, cwd=tmp_path)
    assert says in caught.value.message
    assert str(tmp_path / "pyproject.toml") in caught.value.message


# -- job validation (no Spark) ----------------------------------------------------------------


def _identity(rows: Any, ctx: Any) -> dict[str, Any]:
    return {"out": rows}


def _pg(name: str = "pg_out", **kw: Any) -> PostgresSink:
    args: dict[str, Any] = {"table": "out", "columns": {"id": "text", "n": "bigint"}}
    args.update(kw)
    return PostgresSink(name, "out", **args)


def _csv() -> CsvSource:
    return CsvSource("in", schema={"id": "string", "n": "bigint"})


def test_job_validation() -> None:
    ok = Job(name="ok", source=_csv(), transform=_identity, sinks=[_pg()])
    assert ok.sinks == (_pg(),)  # a list becomes a tuple

    with pytest.raises(ConfigurationError, match="gives raw records; give the job a `parse`"):
        Job(name="raw", source=LandingSource(folder="in"), transform=_identity, sinks=(_pg(),))
    # With a parse step a raw source is fine.
    Job(name="raw", source=LandingSource(folder="in"), parse=lambda df: df,
        transform=_identity, sinks=(_pg(),))  # fmt: skip

    with pytest.raises(ConfigurationError, match="sink names must be unique"):
        Job(name="j", source=_csv(), transform=_identity, sinks=(_pg(), _pg(table="other")))
    with pytest.raises(ConfigurationError, match="give it at least one sink"):
        Job(name="j", source=_csv(), transform=_identity, sinks=())
    with pytest.raises(ConfigurationError, match="sinks must be DeltaSink or PostgresSink"):
        Job(name="j", source=_csv(), transform=_identity, sinks=("pg_out",))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="source must be an onceflow Source"):
        Job(name="j", source="in/*.csv", transform=_identity, sinks=(_pg(),))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="job name 'my job' is not a plain identifier"):
        Job(name="my job", source=_csv(), transform=_identity, sinks=(_pg(),))

    keyed = _pg(key=("id",), mode="upsert")
    with pytest.raises(ConfigurationError, match="pg_out is a postgres sink, which cannot hold"):
        Job(name="j", source=_csv(), transform=_identity, sinks=(keyed,),
            dedupe=Dedupe(key=("id",), state_sink="pg_out"))  # fmt: skip
    with pytest.raises(ConfigurationError, match="no sink named 'lake'"):
        Job(name="j", source=_csv(), transform=_identity, sinks=(keyed,),
            dedupe=Dedupe(key=("id",), state_sink="lake"))  # fmt: skip
    lake = DeltaSink(name="lake_out", output="out", table="out")
    with pytest.raises(ConfigurationError, match="dedupe needs at least one key column"):
        Job(name="j", source=_csv(), transform=_identity, sinks=(lake,),
            dedupe=Dedupe(key=(), state_sink="lake_out"))  # fmt: skip
    Job(name="j", source=_csv(), transform=_identity, sinks=(lake,),
        dedupe=Dedupe(key=("id",), state_sink="lake_out"))  # fmt: skip

    with pytest.raises(ConfigurationError, match=r"no sink named 'pg_bad'; sinks are \['pg_out'\]"):
        Job(name="j", source=_csv(), transform=_identity, sinks=(_pg(),), quarantine_sink="pg_bad")


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"columns": {"id": "varchar"}}, "column id has type 'varchar'; use one of"),
        ({"columns": {}}, "declare its columns"),
        ({"mode": "merge"}, "mode 'merge' is unknown; use append, upsert or accumulate"),
        ({"mode": "upsert"}, "mode upsert needs a key"),
        ({"mode": "accumulate", "key": ("id",)}, "mode accumulate needs accumulate columns"),
        ({"accumulate": ("n",)}, "accumulate columns are only for mode accumulate"),
        ({"mode": "upsert", "key": ("order_id",)}, r"columns \['order_id'\] are named as key"),
        ({"window_column": "window_id"}, r"columns \['window_id'\] are named as key"),
        ({"table": "orders; drop table x"}, "table 'orders; drop table x' is not a plain"),
        ({"table": "t" * 64}, "PostgreSQL truncates names past 63 bytes"),
        (
            {"mode": "accumulate", "key": ("id", "n"), "accumulate": ("n",)},
            "both key and accumulate",
        ),
    ],
)
def test_postgres_sink_validation(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        _pg(**kw)


# -- two jobs on one PostgreSQL and one lake ---------------------------------------------------


def _other_job_state(dsn: str, job: str) -> dict[str, Any]:
    """What belongs to `job` in the shared onceflow tables, with each row's writer (`xmin`)."""
    with psycopg.connect(dsn) as conn:

        def rows(query: str) -> list[Any]:
            return sorted(conn.execute(query, (job,)).fetchall(), key=str)

        return {
            "markers": rows("SELECT xmin::text, * FROM onceflow.sink_commits WHERE job = %s"),
            "epoch": rows("SELECT xmin::text, * FROM onceflow.jobs WHERE job = %s"),
            "windows": rows("SELECT xmin::text, * FROM onceflow.windows WHERE job = %s"),
            "quarantine": rows("SELECT xmin::text, * FROM onceflow.quarantine WHERE job = %s"),
        }


def _delete_one_quarantine_row(dsn: str, job: str) -> None:
    with psycopg.connect(dsn) as conn:
        deleted = conn.execute(
            "DELETE FROM onceflow.quarantine WHERE ctid = (SELECT ctid FROM onceflow.quarantine"
            " WHERE job = %s ORDER BY source_file, source_line LIMIT 1)",
            (job,),
        ).rowcount
    assert deleted == 1


def test_two_jobs_share_a_database_and_a_lake(
    spark: Any, pg_dsn: str, lake: Path, landing: Path, tmp_path: Path
) -> None:
    from onceflow.reconcile import reconcile

    settings = Settings(home=tmp_path / "home", postgres_dsn=pg_dsn, lake=lake, landing=landing)
    with user_project_on_path() as user:
        orders = build_engine(user.ORDERS, settings, spark, pg_dsn)
    payments = build_engine(PAYMENTS, settings, spark, pg_dsn)
    generate_payments(landing, records=300, files=2, duplicate_rate=0.1, invalid_rate=0.1, seed=3)
    write_orders(landing, ["orders-001.csv", "orders-002.csv"])

    paid = payments.run(max_units_per_window=1)
    assert [w.window_id for w in paid.windows] == [1, 2]
    payments_state = _other_job_state(pg_dsn, "payments")
    assert payments_state["quarantine"] and payments_state["markers"]

    ordered = orders.run(max_units_per_window=1)
    assert [w.window_id for w in ordered.windows] == [1, 2]  # window ids are per job
    assert_orders_exact(pg_dsn, [["orders-001.csv"], ["orders-002.csv"]])
    assert _other_job_state(pg_dsn, "payments") == payments_state

    orders_state = _other_job_state(pg_dsn, JOB)
    generate_payments(landing, records=100, files=1, invalid_rate=0.2, seed=4)
    assert [w.window_id for w in payments.run().windows] == [3]
    assert _other_job_state(pg_dsn, JOB) == orders_state
    payments_state = _other_job_state(pg_dsn, "payments")
    assert len(payments_state["epoch"]) == len(orders_state["epoch"]) == 1

    # Reconcile of one job repairs its own quarantine rows and never touches the other's.
    _delete_one_quarantine_row(pg_dsn, JOB)
    report = reconcile(orders)
    assert {d.sink: d.missing for d in report.sinks} == {"pg_orders": 0, "orders_quarantine": 1}
    assert all(d.repaired for d in report.sinks if d.missing)
    assert_orders_exact(pg_dsn, [["orders-001.csv"], ["orders-002.csv"]])
    assert _other_job_state(pg_dsn, "payments") == payments_state
    assert reconcile(orders, dry_run=True).clean

    orders_state = _other_job_state(pg_dsn, JOB)
    _delete_one_quarantine_row(pg_dsn, "payments")
    report = reconcile(payments)
    assert {d.sink: d.missing for d in report.sinks}["pg_quarantine"] == 1
    assert _other_job_state(pg_dsn, JOB) == orders_state
    assert actual_quarantine(pg_dsn) and actual_orders(pg_dsn) == expected_orders(
        [["orders-001.csv"], ["orders-002.csv"]]
    )
    assert reconcile(payments, dry_run=True).clean

    # Restating window 1 of one job replaces its quarantine rows only: the shared table's rows
    # of the other job's window 1 stay.
    orders_state = _other_job_state(pg_dsn, JOB)
    from onceflow.restate import restate_windows

    restate_windows(payments, [1], request_id="shared-quarantine")
    assert _other_job_state(pg_dsn, JOB) == orders_state
    assert reconcile(payments, dry_run=True).clean
