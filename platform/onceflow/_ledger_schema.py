"""The ledger's tables: created if missing, and columns older ledgers lack added once."""

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
    offsets jsonb NOT NULL,
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
"""
