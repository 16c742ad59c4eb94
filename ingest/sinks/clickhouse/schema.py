"""``ingest migrate`` for ClickHouse: the database and the ``ReplacingMergeTree`` table, verified if they exist."""

from __future__ import annotations

from typing import Any

from ingest.config import PipelineSettings
from ingest.errors import ConfigError, IngestError, ServiceUnreachable, TransientError
from ingest.sinks.clickhouse.errors import classify
from ingest.sinks.clickhouse.settings import DELETED_COLUMN, ClickHouseSinkSettings
from ingest.sinks.clickhouse.sink import (
    ClickHouseSink,
    ClientFactory,
    parse_version,
    quote_ident,
    quote_str,
)


def create_table_sql(cfg: ClickHouseSinkSettings, deletes: bool = False) -> list[str]:
    """``CREATE DATABASE`` and ``CREATE TABLE ... ReplacingMergeTree(version)`` for the sink
    (``deletes``: ``ReplacingMergeTree(version, _ingest_deleted)`` with that hidden column)."""
    on_cluster = f" ON CLUSTER {quote_ident(cfg.cluster)}" if cfg.cluster else ""
    db, table = quote_ident(cfg.database), quote_ident(cfg.table)
    types = {name: t.ddl for name, t in cfg.ch_types.items()} | ({DELETED_COLUMN: "UInt8"} if deletes else {})
    cols = ",\n    ".join(f"{quote_ident(name)} {ddl}" for name, ddl in types.items())
    version = quote_ident(cfg.version_column or "")
    if deletes:
        version += f", {quote_ident(DELETED_COLUMN)}"
    if cfg.cluster:
        path = quote_str(f"/clickhouse/tables/{{shard}}/{cfg.database}/{cfg.table}")
        engine = f"ReplicatedReplacingMergeTree({path}, '{{replica}}', {version})"
        window = f"replicated_deduplication_window = {cfg.deduplication_window}"
    else:
        engine = f"ReplacingMergeTree({version})"
        window = f"non_replicated_deduplication_window = {cfg.deduplication_window}"
    order_by = ", ".join(quote_ident(k) for k in cfg.order_by)
    if len(cfg.order_by) > 1:
        order_by = f"({order_by})"
    return [
        f"CREATE DATABASE IF NOT EXISTS {db}{on_cluster}",
        f"CREATE TABLE IF NOT EXISTS {db}.{table}{on_cluster} (\n    {cols}\n)\n"
        f"ENGINE = {engine}\nORDER BY {order_by}\nSETTINGS {window}",
    ]


def _verify_table(client: Any, p: PipelineSettings, cfg: ClickHouseSinkSettings) -> None:
    """An existing table must be a ReplacingMergeTree ordered by ``order_by`` with every column."""
    where = {"db": cfg.database, "t": cfg.table}
    rows = client.query(
        "SELECT engine, sorting_key FROM system.tables WHERE database = %(db)s AND name = %(t)s",
        parameters=where,
    ).result_rows
    if not rows:
        raise ConfigError(f"pipelines.{p.name}.sink: table {cfg.database}.{cfg.table} was not created")
    engine, sorting_key = rows[0]
    expected_key = ", ".join(cfg.order_by)
    actual_key = str(sorting_key).replace("`", "").replace(" ", "")
    if actual_key.startswith("(") and actual_key.endswith(")"):
        actual_key = actual_key[1:-1]
    if not str(engine).endswith("ReplacingMergeTree") or actual_key != expected_key.replace(" ", ""):
        raise ConfigError(
            f"pipelines.{p.name}.sink: table {cfg.database}.{cfg.table} exists as {engine} ORDER BY "
            f"({sorting_key}); the sink needs ReplacingMergeTree ORDER BY ({expected_key}) to deduplicate"
        )
    present = {r[0] for r in client.query(
        "SELECT name FROM system.columns WHERE database = %(db)s AND table = %(t)s", parameters=where,
    ).result_rows}
    missing = [c for c in [*cfg.columns, *([DELETED_COLUMN] if p.has_deletes else [])] if c not in present]
    if missing:
        raise ConfigError(f"pipelines.{p.name}.sink: table {cfg.database}.{cfg.table} exists without "
                          f"columns {missing}")


#: ``ReplacingMergeTree(version, is_deleted)`` appeared in ClickHouse 23.2.
MIN_DELETES_VERSION = (23, 2)


def _check_deletes_supported(client: Any, p: PipelineSettings) -> None:
    """Refuse a server too old for the is_deleted column of ReplacingMergeTree (ConfigError)."""
    version = str(client.command("SELECT version()"))
    if parse_version(version)[:2] < MIN_DELETES_VERSION:
        raise ConfigError(f"pipelines.{p.name}: deletes need ClickHouse {'.'.join(map(str, MIN_DELETES_VERSION))} "
                          f"or later (ReplacingMergeTree(version, is_deleted)); the server is {version}")


def migrate_clickhouse(p: PipelineSettings, *, client_factory: ClientFactory | None = None) -> list[str]:
    """Create the sink's database and table if missing (idempotent) and verify an existing one.

    Returns the lines ``ingest migrate`` prints. Raises ServiceUnreachable when the
    server cannot be reached or is too old, ConfigError when the table cannot be
    created as configured or exists in an incompatible shape.
    """
    cfg = p.sink
    assert isinstance(cfg, ClickHouseSinkSettings)
    sink = ClickHouseSink(cfg, pipeline=p.name, client_factory=client_factory)
    what = f"{sink.name} of pipeline {p.name!r}"
    try:
        try:
            client = sink.client()
        except IngestError as exc:
            raise ServiceUnreachable(what, str(exc)) from None
        try:
            if p.has_deletes or p.explode_steps:
                _check_deletes_supported(client, p)
            if p.routes_tables:  # each table is created when its first record arrives (ClickHouseSink, routed)
                client.command(create_table_sql(cfg, p.has_deletes)[0])  # the database
                return [f"{p.name}: tables {cfg.database}.{cfg.table} (each created when its first record arrives)"]
            for stmt in create_table_sql(cfg, p.has_deletes):
                client.command(stmt)
            _verify_table(client, p, cfg)
            for _, explode in p.explode_steps:  # child tables: replaced children are marked deleted
                for stmt in create_table_sql(p.explode_sink(explode), True):
                    client.command(stmt)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            err = classify(exc)
            if isinstance(err, TransientError):
                raise ServiceUnreachable(what, str(err)) from None
            raise ConfigError(f"pipelines.{p.name}.sink: ClickHouse rejected the table definition: {err}") from None
    finally:
        sink.close()
    engine = "ReplicatedReplacingMergeTree" if cfg.cluster else "ReplacingMergeTree"
    version = f"{cfg.version_column}, {DELETED_COLUMN}" if p.has_deletes else cfg.version_column
    children = [f"{p.name}: table {cfg.database}.{e.table} ({engine}(_version, {DELETED_COLUMN}) ORDER BY "
                f"({', '.join(e.conflict_key)}); exploded from {e.path})" for _, e in p.explode_steps]
    return [f"{p.name}: table {cfg.database}.{cfg.table} ({engine}({version}) "
            f"ORDER BY ({', '.join(cfg.order_by)}))", *children]
