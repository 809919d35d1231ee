"""One layer of retries per concern: a PostgreSQL group whose staged rows keep getting lost
stages the window again only until the lost connection's deadline (`ONCEFLOW_PG_RETRY_S`),
then fails the run with a retryable error (exit 75: the orchestrator runs it again), having
written nothing; the next run ends exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from onceflow import ops
from onceflow.errors import TransientSinkError
from onceflow.generate import generate_payments
from tests.core.test_exactly_once import make_engine, markers
from tests.support.oracle import expected_outputs
from tests.support.outputs import actual_outputs, assert_exact

# From outside onceflow, the database drops every row copied into a PostgreSQL sink's staging
# table (`onceflow.stage_*`), as a server restart empties them: the count check never passes.
LOSE_STAGED_ROWS = """
CREATE FUNCTION public.lose_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RETURN NULL; END $$;
CREATE FUNCTION public.lose_staged_rows() RETURNS event_trigger LANGUAGE plpgsql AS $$
DECLARE created record;
BEGIN
    FOR created IN SELECT object_identity FROM pg_event_trigger_ddl_commands()
                   WHERE object_type = 'table' AND object_identity LIKE 'onceflow.stage\\_%'
    LOOP
        EXECUTE format('CREATE TRIGGER lose_row BEFORE INSERT ON %s FOR EACH ROW'
                       ' EXECUTE FUNCTION public.lose_row()', created.object_identity);
    END LOOP;
END $$;
CREATE EVENT TRIGGER lose_staged_rows ON ddl_command_end WHEN TAG IN ('CREATE TABLE')
    EXECUTE FUNCTION public.lose_staged_rows();
"""

RETRY_S = 6.0


def test_staging_lost_past_the_deadline_fails_retryable_and_writes_nothing(
    spark: Any,
    pg_dsn: str,
    lake: Path,
    landing: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ONCEFLOW_PG_RETRY_S", str(RETRY_S))
    generate_payments(landing, records=300, files=1, duplicate_rate=0.1, invalid_rate=0.05, seed=8)
    engine = make_engine(spark, pg_dsn, lake, landing, tmp_path / "home")
    engine.prepare()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(LOSE_STAGED_ROWS)

    # Not five attempts and then a terminal SinkError: the one deadline, then retryable.
    with pytest.raises(TransientSinkError) as failed:
        engine.run()
    assert ops.exit_code(failed.value) == ops.EXIT_RETRYABLE  # 75: run it again
    assert (
        "ONCEFLOW_PG_RETRY_S" in failed.value.message
        and "run the job again" in str(failed.value).lower()
    )
    assert markers(pg_dsn) == {}
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM public.payments").fetchone() == (0,)

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP EVENT TRIGGER lose_staged_rows")
    make_engine(spark, pg_dsn, lake, landing, tmp_path / "home").run()
    # Nothing lost, nothing doubled.
    assert_exact(expected_outputs(landing), actual_outputs(pg_dsn, lake))
