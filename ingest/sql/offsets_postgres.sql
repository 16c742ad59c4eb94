-- Offsets stored beside the rows (exactly-once delivery): one row per partition.
-- {schema}, {table} and {lane_table} are replaced by quoted identifiers.
CREATE TABLE IF NOT EXISTS {schema}.{table} (
    pipeline    text        NOT NULL,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    next_offset bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, topic, "partition")
);

-- Exactly-once delivery, per lane: every record of (topic, partition) routed to
-- `lane` (of `lanes`, under routing scheme `routing`) with offset < next_offset is
-- in the sink table or the DLQ. Written in the same transaction as the rows (see
-- ingest/exactly_once.py). Tables made before `routing` existed get the column
-- (and a primary key with it) from `ingest migrate`.
CREATE TABLE IF NOT EXISTS {schema}.{lane_table} (
    pipeline    text        NOT NULL,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    lanes       integer     NOT NULL,
    routing     text        NOT NULL DEFAULT 'kafka-key',
    lane        integer     NOT NULL,
    next_offset bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, topic, "partition", lanes, routing, lane)
);
ALTER TABLE {schema}.{lane_table} ADD COLUMN IF NOT EXISTS routing text NOT NULL DEFAULT 'kafka-key';
