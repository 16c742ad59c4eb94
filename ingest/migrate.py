"""``ingest migrate``: create sink tables, the DLQ table and bookkeeping tables, idempotently.

DDL for fixed tables lives in ``sql/*.sql`` with ``{placeholders}`` that are
filled only with :class:`psycopg.sql.Identifier`. Sink tables are composed from
the config the same way: names as identifiers, types as the normalised forms
from :func:`ingest.config.pg_base_type`.

An existing sink table is left as it is, but checked: ``migrate`` fails if it
lacks a unique index on the conflict key (the upsert would fail on every row).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ingest.config import PipelineSettings, PostgresSink, pg_base_type
from ingest.errors import ConfigError, IngestError, ServiceUnreachable
from ingest.drivers.postgres import classify

SQL_DIR = Path(__file__).parent / "sql"


class MigrationError(IngestError):
    """The database refused a migration statement (exit 1, message names the pipeline and object)."""

OFFSETS_TABLE = "ingest_offsets"
LANE_OFFSETS_TABLE = "ingest_lane_offsets"


def load_sql(name: str, **identifiers: str | tuple[str, ...]) -> sql.Composed:
    """Read ``sql/<name>`` and fill its placeholders with quoted identifiers."""
    text = (SQL_DIR / name).read_text(encoding="utf-8")
    args = {k: sql.Identifier(*v) if isinstance(v, tuple) else sql.Identifier(v) for k, v in identifiers.items()}
    return sql.SQL(text).format(**args)


def sink_table_sql(cfg: PostgresSink) -> list[sql.Composable]:
    cols = []
    for name, spec in cfg.columns.items():
        not_null = spec.required or name in cfg.conflict_key
        cols.append(
            sql.SQL("{} {}{}").format(
                sql.Identifier(name), sql.SQL(pg_base_type(spec.type)[1]), sql.SQL(" NOT NULL" if not_null else "")
            )
        )
    if cfg.conflict_key:
        cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(sql.Identifier(k) for k in cfg.conflict_key)))
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(cfg.db_schema)),
        sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            sql.Identifier(cfg.db_schema, cfg.table), sql.SQL(", ").join(cols)
        ),
    ]


def derived_name(table: str, suffix: str) -> str:
    """``<table>_<suffix>`` as a PostgreSQL name (≤ 63 bytes), distinct per suffix and never equal to ``table``.

    Long names keep a byte-safe prefix of the table plus a short hash of the whole name.
    """
    name = f"{table}_{suffix}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(table.encode()).hexdigest()[:8]
    room = 63 - len(suffix) - len(digest) - 2
    prefix = table.encode()[:room].decode("utf-8", "ignore")
    return f"{prefix}_{digest}_{suffix}"


def dlq_table_sql(schema: str, table: str) -> list[sql.Composable]:
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)),
        load_sql(
            "dlq_postgres.sql",
            schema=schema,
            table=table,
            uniq=derived_name(table, "record_key"),
            idx_time=derived_name(table, "pipeline_time_idx"),
            idx_status=derived_name(table, "pipeline_status_idx"),
        ),
    ]


def offsets_table_sql(schema: str) -> sql.Composed:
    return load_sql("offsets_postgres.sql", schema=schema, table=OFFSETS_TABLE, lane_table=LANE_OFFSETS_TABLE)


def _lane_offsets_keyed_by_routing(dsn: str, schema: str, what: str) -> None:
    """Give a lane offsets table made before the ``routing`` column a primary key that includes it."""
    query = """
        SELECT con.conname, array_agg(a.attname::text)
        FROM pg_constraint con JOIN pg_class c ON c.oid = con.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(con.conkey)
        WHERE con.contype = 'p' AND n.nspname = %s AND c.relname = %s GROUP BY con.conname
    """
    try:
        with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as conn:
            row = conn.execute(query, (schema, LANE_OFFSETS_TABLE)).fetchone()
            if row is None or "routing" in row[1]:
                return
            conn.execute(sql.SQL(
                'ALTER TABLE {t} DROP CONSTRAINT {pk}, ADD PRIMARY KEY (pipeline, topic, "partition", lanes, routing, lane)'
            ).format(t=sql.Identifier(schema, LANE_OFFSETS_TABLE), pk=sql.Identifier(row[0])))
    except psycopg.Error as exc:
        raise MigrationError(f"{what}: the database rejected the DDL: {classify(exc)}") from None


def dlq_dsn(p: PipelineSettings) -> str:
    """The DSN of a pipeline's PostgreSQL DLQ (dlq.dsn, else the sink's)."""
    if p.dlq.dsn is not None:
        return p.dlq.dsn.get_secret_value()
    if isinstance(p.sink, PostgresSink):
        return p.sink.dsn.get_secret_value()
    raise ConfigError(f"pipelines.{p.name}.dlq.dsn: required for a postgres DLQ when the sink is not PostgreSQL")


def _has_unique_on(conn: psycopg.Connection[Any], schema: str, table: str, columns: list[str]) -> bool:
    row = conn.execute(
        """
        SELECT count(*) FROM pg_index i
        JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %s AND c.relname = %s AND i.indisunique
          AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a
               WHERE a.attrelid = c.oid AND a.attnum = ANY(i.indkey)) = %s
        """,
        (schema, table, sorted(columns)),
    ).fetchone()
    return bool(row and row[0])


def _execute(dsn: str, what: str, statements: list[sql.Composable]) -> None:
    try:
        with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as conn:
            for stmt in statements:
                conn.execute(stmt)
    except psycopg.OperationalError as exc:
        if getattr(exc, "sqlstate", None) is None or str(exc.sqlstate).startswith("08"):
            raise ServiceUnreachable(what, str(classify(exc))) from None
        raise MigrationError(f"{what}: {classify(exc)}") from None
    except psycopg.Error as exc:
        raise MigrationError(f"{what}: the database rejected the DDL: {classify(exc)}") from None


def migrate_pipeline(p: PipelineSettings) -> list[str]:
    """Create everything pipeline ``p`` needs. Returns human-readable lines of what was ensured."""
    done: list[str] = []
    if isinstance(p.sink, PostgresSink):
        sink = p.sink
        dsn = sink.dsn.get_secret_value()
        what = f"postgres sink of pipeline {p.name!r}"
        _execute(dsn, what, sink_table_sql(sink) + [offsets_table_sql(sink.db_schema)])
        _lane_offsets_keyed_by_routing(dsn, sink.db_schema, what)
        if sink.conflict_key:
            with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as conn:
                if not _has_unique_on(conn, sink.db_schema, sink.table, list(sink.conflict_key)):
                    raise ConfigError(
                        f"pipelines.{p.name}.sink: table {sink.db_schema}.{sink.table} exists without a unique "
                        f"index on conflict_key {list(sink.conflict_key)}; add one (upserts need it)"
                    )
        done.append(f"{p.name}: table {sink.db_schema}.{sink.table}")
        done.append(f"{p.name}: table {sink.db_schema}.{OFFSETS_TABLE}")
    else:
        from ingest.sinks.clickhouse import migrate_clickhouse  # noqa: PLC0415 - optional backend

        done.extend(migrate_clickhouse(p))
    if p.dlq.uses_postgres_table:
        _execute(dlq_dsn(p), f"postgres DLQ of pipeline {p.name!r}", dlq_table_sql(p.dlq.db_schema, p.dlq.table))
        done.append(f"{p.name}: DLQ table {p.dlq.db_schema}.{p.dlq.table}")
    return done
