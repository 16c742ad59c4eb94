"""``columns: auto`` at the PostgreSQL sink (issue #36): the defects a review found, each failing first.

Real PostgreSQL; the records are mapped by the pipeline's own mapper (:func:`ingest.cdc.mapper.mapper_for`)
and written by the sink as a lane writes them.
"""

from __future__ import annotations

import threading
from typing import Any

import orjson
import psycopg
import pytest
from harness.debezium import Field, encode_event, encode_key

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.core.collapse import collapse
from ingest.errors import PermanentError
from ingest.sinks.postgres.backend import PostgresBackend
from ingest.types import Item, Record

FIELDS = (Field("id", "int64", optional=False), Field("name", "string"), Field("price", "decimal(12,2)"))
KEY = (Field("id", "int64", optional=False),)


def settings(dsn: str, **extra: Any) -> PipelineSettings:
    sink = {"kind": "postgres", "dsn": dsn, "table": "{source.table}", "columns": "auto", **extra.pop("sink", {})}
    return PipelineSettings.model_validate({"name": "m", "topics": ["^db\\..*"], "envelope": "debezium",
                                            "sink": sink, "dlq": {"kind": "postgres", "dsn": dsn}, **extra})


def event(i: int, *, fields: tuple[Field, ...] = FIELDS, offset: int = 0, table: str = "items",
          **values: Any) -> Record:
    after = {"id": i, "name": "n", "price": "1.50", **values}
    value = encode_event("c", None, after, fields=fields, lsn=offset, ts_ms=1, schemas=True, table=table)
    return Record("db.public." + table, 0, offset, encode_key({"id": i}, fields=KEY, schemas=True, table=table),
                  value, 0)


def rows(dsn: str, query: str) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query).fetchall()


def test_a_fresh_process_sees_the_rows_of_tables_it_has_not_written(pg_dsn) -> None:
    """replay-dlq's order guard asks a new process where rows were last written from."""
    p = settings(pg_dsn)
    m = mapper_for(p)
    first = PostgresBackend().build(p, lanes=1)
    first.write([m.map(event(1, offset=10))[0]])
    first.close()
    fresh = PostgresBackend().build(p, lanes=1)
    try:
        got = fresh.row_sources([((1,), "items"), ((2,), "items"), ((1,), "no_such_table")])
    finally:
        fresh.close()
    assert set(got) == {((1,), "items")} and got[((1,), "items")].offset == 10


def test_a_lane_prepared_for_an_older_shape_writes_with_what_it_prepared(pg_dsn) -> None:
    p = settings(pg_dsn)
    sink = PostgresBackend().build(p, lanes=2)
    m = mapper_for(p)
    r1, _ = m.map(event(1, offset=1))
    sink.write([r1])
    r2, _ = m.map(event(2, offset=2, fields=(*FIELDS, Field("note", "string")), note="x"))
    try:
        with sink.connection() as lane_a:
            sink.before_transaction(lane_a, [r1])  # lane A prepared for the first shape
            sink.write([r2])  # lane B adds a column meanwhile
            with lane_a.transaction():
                sink.write_rows_in(lane_a, [r1])
    finally:
        sink.close()
    assert rows(pg_dsn, "SELECT id, note FROM items ORDER BY id") == [(1, None), (2, "x")]


def test_two_processes_creating_the_same_tables_with_deletes_both_succeed(pg_dsn) -> None:
    p = settings(pg_dsn, deletes={"mode": "soft"})
    sinks = [PostgresBackend().build(p, lanes=1) for _ in range(2)]
    m = mapper_for(p)
    errors: list[str] = []
    try:
        for n in range(12):
            row, _ = m.map(event(1, offset=1, table=f"tab{n}"))
            barrier = threading.Barrier(2)

            def write(sink: Any, row: Any = row, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    sink.write([row])
                except Exception as exc:  # noqa: BLE001 - collected for the assertion
                    errors.append(f"{type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=write, args=(s,)) for s in sinks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        for s in sinks:
            s.close()
    assert errors == []
    assert rows(pg_dsn, "SELECT count(*) FROM tab11_ingest_deleted") == [(0,)]


def test_a_not_null_column_the_schema_lacks_is_schema_incompatible_by_name(pg_dsn) -> None:
    """A column added by hand as NOT NULL (a default or not) that no field fills: ingest writes NULL there,
    so the records are refused as schema_incompatible, naming it -- not as a constraint violation."""
    p = settings(pg_dsn)
    m = mapper_for(p)
    sink = PostgresBackend().build(p, lanes=1)
    sink.write([m.map(event(1, offset=1))[0]])
    sink.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE items ADD COLUMN region text NOT NULL DEFAULT 'eu'")
    restarted = PostgresBackend().build(p, lanes=1)
    try:
        with pytest.raises(PermanentError) as err:
            restarted.write([m.map(event(2, offset=2))[0]])
    finally:
        restarted.close()
    assert err.value.error_class == "schema_incompatible" and "'region'" in str(err.value)


def test_a_schema_wider_than_postgresql_allows_is_schema_incompatible(pg_dsn) -> None:
    p = settings(pg_dsn)
    fields = (Field("id", "int64", optional=False), *(Field(f"c{i}", "string") for i in range(1700)))
    value = encode_event("c", None, {"id": 1}, fields=fields, lsn=1, ts_ms=1, schemas=True, table="wide")
    key = encode_key({"id": 1}, fields=KEY, schemas=True, table="wide")
    row, _ = mapper_for(p).map(Record("db.public.wide", 0, 1, key, value, 0))
    sink = PostgresBackend().build(p, lanes=1)
    try:
        with pytest.raises(PermanentError) as err:
            sink.write([row])
    finally:
        sink.close()
    assert err.value.error_class == "schema_incompatible" and "1600" in str(err.value)


def test_ddl_the_database_refuses_is_schema_incompatible_and_bad_override_types_are_config_errors(pg_dsn) -> None:
    with pytest.raises(Exception) as config_error:
        settings(pg_dsn, sink={"tables": {"items": {"columns": {"price": {"type": "numeric(2000,0)"}}}}})
    assert "precision" in str(config_error.value)
    p = settings(pg_dsn, sink={"tables": {"items": {"columns": {"name": {"type": "varchar(10)"}}}}})
    sink = PostgresBackend().build(p, lanes=1)
    m = mapper_for(p)
    try:
        sink.write([m.map(event(1, offset=1))[0]])  # the override applies
        with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a table no ALTER can evolve: a view
            conn.execute("CREATE VIEW blocked AS SELECT 1 AS id")
        with pytest.raises(PermanentError) as err:
            sink.write([m.map(event(1, offset=2, table="blocked"))[0]])
    finally:
        sink.close()
    assert err.value.error_class == "schema_incompatible"


def test_plain_json_keys_name_one_row_whatever_the_order_of_their_fields(pg_dsn) -> None:
    schema = {"type": "struct", "optional": False, "fields": [
        {"field": "a", "type": "int64", "optional": False}, {"field": "b", "type": "int64", "optional": False},
        {"field": "v", "type": "string", "optional": True}]}

    def record(offset: int, key: dict[str, int], v: str) -> Record:
        return Record("db.t", 0, offset, orjson.dumps(key),
                      orjson.dumps({"schema": schema, "payload": {**key, "v": v}}), 0)

    p = PipelineSettings.model_validate({"name": "m", "topics": ["^db\\..*"], "sink": {
        "kind": "postgres", "dsn": pg_dsn, "table": "{topic}", "columns": "auto"}})
    m = mapper_for(p)
    batch = [record(0, {"a": 1, "b": 2}, "a1 b2"), record(1, {"b": 1, "a": 2}, "a2 b1"),
             record(2, {"b": 1, "a": 2}, "a2 b1 again")]
    items = [Item(r, m.map(r)[0], None, 0, 1) for r in batch]
    _, groups = collapse(items, p.collapse_rule())
    sink = PostgresBackend().build(p, lanes=1)
    try:
        sink.write([g[0].row for g in groups])
    finally:
        sink.close()
    assert rows(pg_dsn, 'SELECT a, b, v FROM "db_t" ORDER BY a') == [(1, 2, "a1 b2"), (2, 1, "a2 b1 again")]
