"""The ledger's tables: created if missing, and columns older ledgers lack added once."""

# Per-window detail a maintenance run dropped past the job's detail horizon
# (`onceflow.maintain._detail`): through which window, and what the dropped lineage rows summed
# to. A sink's windows through `through` can no longer be restated where restating reads that
# detail (an accumulating sink's contributions), so the PostgreSQL sinks' protocol, which reads
# it, creates it too (`Ledger.ensure_schema`, `PostgresGroup.prepare`).
DETAIL_DDL = """
CREATE TABLE IF NOT EXISTS onceflow.detail_pruned (
    job text NOT NULL,
    sink text NOT NULL,
    through bigint NOT NULL,
    windows bigint NOT NULL,
    rows_written numeric NOT NULL,
    last_version bigint,
    pruned_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink)
);
"""

DDL = """
CREATE SCHEMA IF NOT EXISTS onceflow;
CREATE TABLE IF NOT EXISTS onceflow.jobs (
    job text PRIMARY KEY,
    epoch bigint NOT NULL,
    run_id text,
    epoch_started_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS onceflow.windows (
    job text NOT NULL,
    window_id bigint NOT NULL,
    -- NULL (with `stats`) once folded past the detail horizon (`onceflow._plans_folded`).
    offsets jsonb,
    epoch bigint NOT NULL,
    planned_at timestamptz NOT NULL DEFAULT now(),
    stats jsonb,
    completed_at timestamptz,
    skipped_at timestamptz,
    skip_reason text,
    PRIMARY KEY (job, window_id)
);
-- Ledgers made before windows could be skipped get the columns once (no lock when present).
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'onceflow'
                   AND table_name = 'windows' AND column_name = 'skip_reason') THEN
        ALTER TABLE onceflow.windows ADD COLUMN skipped_at timestamptz,
                                     ADD COLUMN skip_reason text;
    END IF;
    -- Ledgers made before plans were folded let a folded window's offsets go once.
    IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'onceflow'
               AND table_name = 'windows' AND column_name = 'offsets'
               AND is_nullable = 'NO') THEN
        ALTER TABLE onceflow.windows ALTER COLUMN offsets DROP NOT NULL;
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS onceflow.source_units (
    job text NOT NULL,
    unit text NOT NULL,
    window_id bigint NOT NULL,
    PRIMARY KEY (job, unit)
);
CREATE TABLE IF NOT EXISTS onceflow.restatements (
    job text NOT NULL,
    seq bigint NOT NULL,
    window_id bigint NOT NULL,
    request_id text NOT NULL,
    epoch bigint NOT NULL,
    planned_at timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    cancelled_at timestamptz,
    cancel_reason text,
    PRIMARY KEY (job, seq),
    UNIQUE (job, request_id)
);
-- Ledgers made before restatements could be cancelled get the columns once.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'onceflow'
                   AND table_name = 'restatements' AND column_name = 'cancel_reason') THEN
        ALTER TABLE onceflow.restatements ADD COLUMN cancelled_at timestamptz,
                                          ADD COLUMN cancel_reason text;
    END IF;
END $$;
-- One record per sink commit of a window, whatever the sink's kind, for the lineage view: the
-- version of the sink's data holding it (a Delta table version), the id of the commit that
-- wrote it (a PostgreSQL transaction id) and its rows. The sink's own records stay the truth.
CREATE TABLE IF NOT EXISTS onceflow.sink_versions (
    job text NOT NULL,
    window_id bigint NOT NULL,
    sink text NOT NULL,
    version bigint,
    commit_ref text,
    rows_written bigint,
    restate_seq bigint,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, window_id, sink)
);
-- Ledgers made when only Delta versions were recorded get the generic columns once.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'onceflow'
                   AND table_name = 'sink_versions' AND column_name = 'commit_ref') THEN
        ALTER TABLE onceflow.sink_versions ADD COLUMN commit_ref text,
                                           ADD COLUMN rows_written bigint,
                                           ALTER COLUMN version DROP NOT NULL;
    END IF;
END $$;
-- Completed windows a sink lacks and whose input is gone, given up for that sink by an operator
-- (`onceflow windows abandon`): a known, named gap, never a silent one.
CREATE TABLE IF NOT EXISTS onceflow.abandoned_windows (
    job text NOT NULL,
    window_id bigint NOT NULL,
    sink text NOT NULL,
    reason text NOT NULL,
    epoch bigint NOT NULL,
    abandoned_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, window_id, sink)
);
CREATE TABLE IF NOT EXISTS onceflow.reconciliations (
    job text NOT NULL,
    sink text NOT NULL,
    verified_through bigint NOT NULL,
    verified_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink)
);
-- An accumulating sink's state as a reconcile left it (`onceflow.sinks.postgres._baseline`).
CREATE TABLE IF NOT EXISTS onceflow.reconcile_baselines (
    job text NOT NULL,
    sink text NOT NULL,
    through bigint NOT NULL,
    held bigint NOT NULL,
    held_sum numeric NOT NULL,
    restated_seq bigint NOT NULL,
    table_oid oid NOT NULL,
    keys text[] NOT NULL,
    amounts numeric[] NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, sink)
);
"""

# The ledger's verified point and the removal notes behind it (`onceflow._ledger_verified`).
VERIFIED_DDL = """
CREATE TABLE IF NOT EXISTS onceflow.ledger_verified (
    job text PRIMARY KEY,
    through bigint NOT NULL,
    tables oid[] NOT NULL,
    truncations_seen bigint[] NOT NULL,
    verified_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS onceflow.ledger_removals (
    id bigserial PRIMARY KEY,
    job text,
    window_id bigint,
    source text NOT NULL,
    removed_at timestamptz NOT NULL DEFAULT now()
);
-- Created only when missing: CREATE OR REPLACE and CREATE INDEX lock the tables against the
-- inserts of a run in progress even when there is nothing to do.
DO $$ DECLARE t text; BEGIN
    IF to_regprocedure('onceflow.note_moved_row()') IS NULL THEN
        CREATE FUNCTION onceflow.note_removed_rows() RETURNS trigger LANGUAGE plpgsql AS $f$
        BEGIN
            INSERT INTO onceflow.ledger_removals (job, window_id, source)
            SELECT DISTINCT r.job, r.window_id, TG_TABLE_NAME FROM removed r;
            RETURN NULL;
        END $f$;
        CREATE FUNCTION onceflow.note_moved_row() RETURNS trigger LANGUAGE plpgsql AS $f$
        BEGIN
            INSERT INTO onceflow.ledger_removals (job, window_id, source)
            VALUES (OLD.job, OLD.window_id, TG_TABLE_NAME);
            RETURN NULL;
        END $f$;
        CREATE FUNCTION onceflow.note_truncate() RETURNS trigger LANGUAGE plpgsql AS $f$
        BEGIN
            INSERT INTO onceflow.ledger_removals (job, window_id, source)
            VALUES (NULL, NULL, TG_TABLE_NAME);
            RETURN NULL;
        END $f$;
    END IF;
    FOREACH t IN ARRAY ARRAY['windows', 'source_units'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_trigger
                       WHERE tgrelid = format('onceflow.%I', t)::regclass
                       AND tgname = 'note_removed') THEN
            EXECUTE format('CREATE TRIGGER note_removed AFTER DELETE ON onceflow.%I'
                           ' REFERENCING OLD TABLE AS removed FOR EACH STATEMENT'
                           ' EXECUTE FUNCTION onceflow.note_removed_rows()', t);
            EXECUTE format('CREATE TRIGGER note_moved AFTER UPDATE OF job, window_id'
                           ' ON onceflow.%I FOR EACH ROW'
                           ' EXECUTE FUNCTION onceflow.note_moved_row()', t);
            EXECUTE format('CREATE TRIGGER note_truncated AFTER TRUNCATE ON onceflow.%I'
                           ' FOR EACH STATEMENT EXECUTE FUNCTION onceflow.note_truncate()', t);
        END IF;
    END LOOP;
    -- The checks above the verified point and the horizons read by index, not by scan.
    IF to_regclass('onceflow.source_units_by_window') IS NULL THEN
        CREATE INDEX source_units_by_window ON onceflow.source_units (job, window_id);
    END IF;
    IF to_regclass('onceflow.windows_by_planned_at') IS NULL THEN
        CREATE INDEX windows_by_planned_at ON onceflow.windows (job, planned_at);
    END IF;
    IF to_regclass('onceflow.windows_by_epoch') IS NULL THEN
        CREATE INDEX windows_by_epoch ON onceflow.windows (job, epoch);
    END IF;
    -- The windows not completed or skipped (`status`, a run's pending windows): a few rows.
    IF to_regclass('onceflow.windows_open') IS NULL THEN
        CREATE INDEX windows_open ON onceflow.windows (job, window_id)
            WHERE completed_at IS NULL OR skip_reason IS NOT NULL;
    END IF;
END $$;
"""
