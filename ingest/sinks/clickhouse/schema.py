"""``ingest migrate`` for ClickHouse: the database and the ``ReplacingMergeTree`` table, verified if they exist."""

from __future__ import annotations

from typing import Any

from ingest.config import PipelineSettings
from ingest.errors import ConfigError, IngestError, ServiceUnreachable, TransientError
from ingest.sinks.clickhouse.errors import classify
from ingest.sinks.clickhouse.settings import ClickHouseSinkSettings
from ingest.sinks.clickhouse.sink import (
    ClickHouseSink,
    ClientFactory,
    quote_ident,
    quote_str,
)


def create_table_sql(cfg: ClickHouseSinkSettings) -> list[str]:
    """``CREATE DATABASE`` and ``CREATE TABLE ... ReplacingMergeTree(version)`` for the sink."""
    on_cluster = f" ON CLUSTER {quote_ident(cfg.cluster)}" if cfg.cluster else ""
    db, table = quote_ident(cfg.database), quote_ident(cfg.table)
    cols = ",\n    ".join(f"{quote_ident(name)} {t.ddl}" for name, t in cfg.ch_types.items())
    version = quote_ident(cfg.version_column or "")
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
    missing = [c for c in cfg.columns if c not in present]
    if missing:
        raise ConfigError(f"pipelines.{p.name}.sink: table {cfg.database}.{cfg.table} exists without "
                          f"columns {missing}")


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
            for stmt in create_table_sql(cfg):
                client.command(stmt)
            _verify_table(client, p, cfg)
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
    return [f"{p.name}: table {cfg.database}.{cfg.table} ({engine}({cfg.version_column}) "
            f"ORDER BY ({', '.join(cfg.order_by)}))"]
