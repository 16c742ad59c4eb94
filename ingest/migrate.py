"""``ingest migrate``: create every table a pipeline writes, idempotently -- its sink's (through the sink's
backend) and its DLQ table's. Safe to run twice; refuses an existing table that cannot work."""

from __future__ import annotations

from ingest.config import PipelineSettings
from ingest.dlq.postgres import migrate_dlq_table
from ingest.sinks import registry


def migrate_pipeline(p: PipelineSettings) -> list[str]:
    """Create everything pipeline ``p`` needs. Returns human-readable lines of what was ensured."""
    done = registry.backend(p.sink.kind).migrate(p)
    if p.dlq.uses_postgres_table:
        dsn = p.dlq_dsn
        assert dsn is not None  # validated: a PostgreSQL DLQ table has a DSN
        migrate_dlq_table(dsn.get_secret_value(), p.dlq.db_schema, p.dlq.table, f"postgres DLQ of pipeline {p.name!r}")
        done.append(f"{p.name}: DLQ table {p.dlq.db_schema}.{p.dlq.table}")
    return done
