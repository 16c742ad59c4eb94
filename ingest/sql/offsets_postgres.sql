-- Offsets stored beside the rows (exactly-once delivery): one row per partition.
-- {schema} and {table} are replaced by quoted identifiers.
CREATE TABLE IF NOT EXISTS {schema}.{table} (
    pipeline    text        NOT NULL,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    next_offset bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, topic, "partition")
);
