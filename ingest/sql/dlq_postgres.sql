-- Dead-letter table for poison records (one per DLQ table name; shared by pipelines).
-- Placeholders {schema}, {table}, {uniq}, {idx_time}, {idx_status} are replaced by
-- quoted identifiers (psycopg.sql.Identifier); nothing else is substituted.
CREATE TABLE IF NOT EXISTS {schema}.{table} (
    id               bigserial PRIMARY KEY,
    pipeline         text        NOT NULL,
    topic            text        NOT NULL,
    "partition"      integer     NOT NULL,
    "offset"         bigint      NOT NULL,
    record_timestamp timestamptz,
    key              bytea,
    value            bytea,
    headers          jsonb       NOT NULL DEFAULT '[]'::jsonb,
    stage            text        NOT NULL,  -- decode | map | write
    error_class      text        NOT NULL,
    error_message    text        NOT NULL,
    sqlstate         text,
    first_failed_at  timestamptz NOT NULL DEFAULT now(),
    last_failed_at   timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 1,
    status           text        NOT NULL DEFAULT 'pending',  -- pending | replayed | gave_up
    replays          integer     NOT NULL DEFAULT 0,
    replayed_at      timestamptz,
    CONSTRAINT {uniq} UNIQUE (pipeline, topic, "partition", "offset")
);
CREATE INDEX IF NOT EXISTS {idx_time} ON {schema}.{table} (pipeline, last_failed_at);
CREATE INDEX IF NOT EXISTS {idx_status} ON {schema}.{table} (pipeline, status, id);
