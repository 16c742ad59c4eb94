"""``ingest migrate`` for PostgreSQL: the sink table and the exactly-once bookkeeping tables, idempotently.

Sink tables are composed from the config: names as :class:`psycopg.sql.Identifier`,
types as the normalised forms of :func:`ingest.core.dialects.pg_base_type`.
Fixed tables come from ``ingest/sql/offsets_postgres.sql``.

An existing sink table is left as it is, but checked: ``migrate`` fails if it
lacks a unique index on the conflict key (the upsert would fail on every row).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from ingest.config import PipelineSettings
from ingest.drivers.postgres import classify, connect, execute_ddl, load_sql
from ingest.errors import ConfigError, MigrationError
from ingest.sinks.postgres.exactly_once import LANE_OFFSETS_TABLE, OFFSETS_TABLE
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.statements import DeleteStatements, sink_table_sql, tombstone_table_name


def offsets_table_sql(schema: str) -> sql.Composed:
    return load_sql("offsets_postgres.sql", schema=schema, table=OFFSETS_TABLE, lane_table=LANE_OFFSETS_TABLE)


def _lane_offsets_keyed_by_routing(conn: psycopg.Connection[Any], schema: str) -> None:
    """Give a lane offsets table made before the ``routing`` column a primary key that includes it."""
    row = conn.execute("""
        SELECT con.conname, array_agg(a.attname::text)
        FROM pg_constraint con JOIN pg_class c ON c.oid = con.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(con.conkey)
        WHERE con.contype = 'p' AND n.nspname = %s AND c.relname = %s GROUP BY con.conname
    """, (schema, LANE_OFFSETS_TABLE)).fetchone()
    if row is None or "routing" in row[1]:
        return
    conn.execute(sql.SQL(
        'ALTER TABLE {t} DROP CONSTRAINT {pk}, ADD PRIMARY KEY (pipeline, topic, "partition", lanes, routing, lane)'
    ).format(t=sql.Identifier(schema, LANE_OFFSETS_TABLE), pk=sql.Identifier(row[0])))


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


def migrate_postgres(p: PipelineSettings) -> list[str]:
    """Create (or check) the sink table of ``p`` and the offsets tables beside it."""
    cfg = p.sink
    assert isinstance(cfg, PostgresSinkSettings)
    dsn = cfg.dsn.get_secret_value()
    what = f"postgres sink of pipeline {p.name!r}"
    if p.routes_tables:  # each table is created when its first record arrives (PostgresSink, routed)
        execute_ddl(dsn, what, [sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(cfg.db_schema)),
                                offsets_table_sql(cfg.db_schema)], cfg.network)
        try:
            with connect(dsn, cfg.network.model_copy(update={"client_timeout_ms": 0}), autocommit=True) as conn:
                _lane_offsets_keyed_by_routing(conn, cfg.db_schema)
        except psycopg.Error as exc:
            raise MigrationError(f"{what}: the database rejected the DDL: {classify(exc)}") from None
        return [f"{p.name}: tables {cfg.db_schema}.{cfg.table} (each created when its first record arrives)",
                f"{p.name}: table {cfg.db_schema}.{OFFSETS_TABLE}"]
    ddl = sink_table_sql(cfg) + [offsets_table_sql(cfg.db_schema)]
    made = []
    for _, explode in p.explode_steps:  # child tables of explode steps
        child = p.explode_sink(explode)
        ddl += sink_table_sql(child)
        made.append(f"{p.name}: table {child.db_schema}.{child.table} (exploded from {explode.path})")
    if p.has_deletes:
        d = DeleteStatements(cfg, p.deletes)
        ddl.append(d.create_tombstones)
        if d.soft_column_ddl is not None:
            ddl.append(d.soft_column_ddl)
        made.append(f"{p.name}: table {cfg.db_schema}.{tombstone_table_name(cfg, p.deletes)} (tombstones)")
    execute_ddl(dsn, what, ddl, cfg.network)
    try:
        with connect(dsn, cfg.network.model_copy(update={"client_timeout_ms": 0}), autocommit=True) as conn:
            _lane_offsets_keyed_by_routing(conn, cfg.db_schema)
            unique = not cfg.conflict_key or _has_unique_on(conn, cfg.db_schema, cfg.table, list(cfg.conflict_key))
    except psycopg.Error as exc:
        raise MigrationError(f"{what}: the database rejected the DDL: {classify(exc)}") from None
    if not unique:
        raise ConfigError(
            f"pipelines.{p.name}.sink: table {cfg.db_schema}.{cfg.table} exists without a unique "
            f"index on conflict_key {list(cfg.conflict_key)}; add one (upserts need it)"
        )
    return [f"{p.name}: table {cfg.db_schema}.{cfg.table}", *made,
            f"{p.name}: table {cfg.db_schema}.{OFFSETS_TABLE}"]
