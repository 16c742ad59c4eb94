"""Change data capture on real services: Debezium change events and tombstones that delete rows.

Every case runs ``ingest migrate`` and ``ingest run --until-idle`` as subprocesses against the real
broker and PostgreSQL (or chDB), with events in Debezium's real JSON encoding (the schema part,
precise decimals as base64, MicroTimestamp) from ``harness.debezium``. The ordering rules under
test (README, "Mirroring a table with CDC"): the last change of a key wins; with a version column
a stale delete leaves a newer row, a stale upsert older than a delete does not resurrect the row,
a duplicated delete is a no-op, a delete of a key that never existed is handled, not poison.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest
from harness.debezium import Field, encode_event, encode_key
from harness.kafka import produce
from integration.formats_helpers import format_config, migrate
from integration.pipeline_helpers import (
    assert_committed_at_log_end,
    dlq_rows,
    read_summary,
)
from psycopg.rows import dict_row

FIELDS = (Field("id", "int64"), Field("name", "string"), Field("price", "decimal(12,2)"),
          Field("qty", "int32"), Field("updated_at", "micro_timestamp"))
KEY_FIELDS = (Field("id", "int64"),)
T0 = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=timezone.utc)


def _row(i: int, lsn: int, qty: int = 1) -> dict[str, Any]:
    return {"id": i, "name": f"item {i} at {lsn}", "price": Decimal(f"{i}.{lsn % 100:02d}"), "qty": qty,
            "updated_at": T0 + timedelta(microseconds=lsn)}


class Source:
    """A source table's change stream: Debezium events (schema form) and the table they leave."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []
        self.table: dict[int, dict[str, Any]] = {}

    def upsert(self, i: int, lsn: int, *, qty: int = 1, op: str = "c", apply: bool = True) -> None:
        after = _row(i, lsn, qty)
        self.records.append((encode_key({"id": i}, fields=KEY_FIELDS, schemas=True),
                             encode_event(op, None, after, fields=FIELDS, lsn=lsn, ts_ms=lsn, schemas=True)))
        if apply:
            self.table[i] = {**after, "lsn": lsn}

    def delete(self, i: int, lsn: int, *, apply: bool = True, tombstone: bool = True) -> None:
        key = encode_key({"id": i}, fields=KEY_FIELDS, schemas=True)
        before = {"id": i, "name": None, "price": None, "qty": None, "updated_at": None}
        self.records.append((key, encode_event("d", before, None, fields=FIELDS, lsn=lsn, ts_ms=lsn, schemas=True)))
        if tombstone:
            self.records.append((key, None))
        if apply:
            self.table.pop(i, None)


def _history() -> Source:
    """Inserts, updates, deletes and re-inserts, then the stale and repeated records the guards must refuse."""
    s = Source()
    s.upsert(1, 10)
    s.upsert(2, 11)
    s.upsert(1, 12, op="u")
    s.delete(2, 13)
    s.upsert(3, 14)
    s.delete(3, 15)
    s.upsert(3, 16)                      # a key reused after its delete
    s.upsert(4, 17)
    s.delete(4, 18)
    s.delete(1, 5, apply=False)          # a stale delete (older than the row): the row stays
    s.upsert(2, 12, op="u", apply=False)  # a stale upsert older than the delete: no resurrection
    s.delete(2, 13)                      # the delete again: a no-op
    s.delete(99, 19)                     # a key that never existed: handled, not poison
    s.upsert(5, 20, op="r")              # a snapshot read
    return s


def _pg_sink(dsn: str, **extra: Any) -> dict[str, Any]:
    return {"dsn": dsn, "table": "items", "conflict_key": ["id"], "version_column": "lsn", **extra,
            "columns": {"id": {"type": "bigint"}, "name": {"type": "text"}, "price": {"type": "numeric(12,2)"},
                        "qty": {"type": "integer"}, "updated_at": {"type": "timestamptz"},
                        "lsn": {"type": "bigint", "source": "@source.lsn"}}}


def _config(kafka_bootstrap: str, topic: str, group: str, sink: dict[str, Any], **pipeline: Any) -> dict[str, Any]:
    return format_config(bootstrap=kafka_bootstrap, topic=topic, group=group, fmt="json", sink=sink, registry=None,
                         name="cdc", envelope="debezium", **pipeline)


def _pg_rows(dsn: str, sql: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(sql).fetchall()


def _run(path: Path, tmp_path: Path) -> dict[str, Any]:
    summary = tmp_path / "summary.json"
    res = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0", "--summary-json", summary],
                     timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-4000:]}"
    return read_summary(summary)


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_debezium_events_mirror_the_source_table_in_postgres(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                             delivery):
    topic = new_topic(partitions=1)
    source = _history()
    produce(kafka_bootstrap, topic, source.records)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _pg_sink(pg_dsn, delivery=delivery)))
    summary = _run(path, tmp_path)
    rows = {r["id"]: r for r in _pg_rows(pg_dsn, "SELECT id, name, price, qty, updated_at, lsn FROM items")}
    assert rows == source.table
    assert dlq_rows(pg_dsn) == []
    pipeline = summary["pipelines"]["cdc"] if "pipelines" in summary else summary
    # deletes written: 2@13, 3@15, 4@18 (the stale delete of 1 and the repeated delete of 2 are written
    # too -- the guard makes them no-ops in the table -- and so is the delete of 99)
    assert pipeline["rows_deleted"] >= 3
    tombstones = {r["id"]: r["lsn"] for r in _pg_rows(pg_dsn, "SELECT id, lsn FROM items_ingest_deleted")}
    # 1's stale delete and 3's delete are written only when a later change of the key is in another batch
    assert {k: v for k, v in tombstones.items() if k not in (1, 3)} == {2: 13, 4: 18, 99: 19}
    assert tombstones.get(1, 5) == 5 and tombstones.get(3, 15) == 15
    if delivery == "at_least_once":
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_soft_deletes_keep_the_row_and_mark_it(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    """Soft deletes mark the row and keep its values, whether its upsert came in an earlier batch or in the
    delete's own. An upsert undeletes; stale records change nothing; a key that never existed gets no row."""
    topic = new_topic(partitions=1)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _pg_sink(pg_dsn),
                                     deletes={"mode": "soft", "soft_column": "deleted_at"}))
    first, then = Source(), Source()
    for i in range(1, 5):
        first.upsert(i, 10 + i)
    produce(kafka_bootstrap, topic, first.records)
    _run(path, tmp_path)
    then.table = dict(first.table)
    then.delete(2, 20)
    then.delete(3, 21)
    then.upsert(3, 22)                    # undeleted
    then.delete(4, 23)
    then.upsert(4, 14, apply=False)       # stale: older than its delete
    then.delete(99, 24)                   # never existed: no row appears
    then.delete(2, 20)                    # again: a no-op
    then.upsert(5, 25)
    then.upsert(5, 26, op="u")
    then.delete(5, 27)                    # inserted and deleted in one batch: kept, marked deleted
    produce(kafka_bootstrap, topic, then.records)
    _run(path, tmp_path)
    rows = {r["id"]: r for r in _pg_rows(pg_dsn, "SELECT id, name, price, qty, updated_at, lsn, deleted_at FROM items")}
    live = {i: {k: v for k, v in r.items() if k != "deleted_at"} for i, r in rows.items() if r["deleted_at"] is None}
    assert live == then.table
    deleted = {i: (r["lsn"], r["name"]) for i, r in rows.items() if r["deleted_at"] is not None}
    # the row's values kept, its version moved
    assert deleted == {2: (20, "item 2 at 12"), 4: (23, "item 4 at 14"), 5: (27, "item 5 at 26")}
    assert dlq_rows(pg_dsn) == []


def test_debezium_events_mirror_the_source_table_in_clickhouse(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                               chdb):
    topic = new_topic(partitions=1)
    source = _history()
    produce(kafka_bootstrap, topic, source.records)
    url = chdb.url
    chdb.close()  # the ingest subprocess owns the chDB path while it runs
    sink = {"kind": "clickhouse", "url": url, "database": "cdc", "table": "items", "order_by": ["id"],
            "version_column": "lsn",
            "columns": {"id": {"type": "Int64"}, "name": {"type": "String"}, "price": {"type": "Decimal(12, 2)"},
                        "qty": {"type": "Int32"}, "updated_at": {"type": "DateTime64(6)"},
                        "lsn": {"type": "UInt64", "source": "@source.lsn"}}}
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, sink, dlq={"dsn": pg_dsn}))
    summary = _run(path, tmp_path)
    client = chdb.client()
    try:
        got = client.query("SELECT id, name, price, qty, updated_at, lsn FROM cdc.items FINAL ORDER BY id").result_rows
        engine = client.query("SELECT engine_full FROM system.tables WHERE database = 'cdc' AND name = 'items'"
                              ).result_rows[0][0]
    finally:
        chdb.close()
    expected = [(i, r["name"], r["price"], r["qty"], r["updated_at"].replace(tzinfo=None), r["lsn"])
                for i, r in sorted(source.table.items())]
    assert [(*r[:4], r[4].replace(tzinfo=None), r[5]) for r in got] == expected
    assert "ReplacingMergeTree(lsn, _ingest_deleted)" in engine
    assert dlq_rows(pg_dsn) == []
    pipeline = summary["pipelines"]["cdc"] if "pipelines" in summary else summary
    assert pipeline["rows_deleted"] >= 3


def test_plain_tombstones_delete_by_the_record_key(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    """``tombstones: delete`` without an envelope: the key column reads the record key; rows apply in order."""
    topic = new_topic(partitions=2)
    records = [(b"1", b'{"v": "a"}', 0), (b"2", b'{"v": "b"}', 1), (b"1", None, 0), (b"3", b'{"v": "c"}', 1),
               (b"2", None, 1), (b"2", b'{"v": "again"}', 1), (b"4", None, 0)]
    produce(kafka_bootstrap, topic, records)
    sink = {"dsn": pg_dsn, "table": "kv", "conflict_key": ["k"],
            "columns": {"k": {"type": "bigint", "source": "@key"}, "v": {"type": "text"}}}
    cfg = format_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, fmt="json", sink=sink,
                        registry=None, name="cdc", tombstones="delete")
    path = migrate(tmp_path, cfg)
    summary = _run(path, tmp_path)
    assert {r["k"]: r["v"] for r in _pg_rows(pg_dsn, "SELECT k, v FROM kv")} == {2: "again", 3: "c"}
    assert dlq_rows(pg_dsn) == []
    pipeline = summary["pipelines"]["cdc"] if "pipelines" in summary else summary
    assert pipeline["rows_deleted"] in (2, 3)  # 2's tombstone is written only when "again" is in another batch
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_replay_dlq_applies_a_dead_lettered_change_with_the_same_rules(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                        group_id):
    """Two upserts the database refuses (a CHECK) are dead-lettered; one of their keys is deleted later.
    Replayed after the CHECK is dropped: the other row appears, the deleted key stays deleted."""
    topic = new_topic(partitions=1)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _pg_sink(pg_dsn), dlq={"max_ratio": 1.0}))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE items ADD CONSTRAINT qty_positive CHECK (qty >= 0)")
    s = Source()
    s.upsert(7, 20, qty=-1, apply=False)  # refused now; deleted later, so it must never appear
    s.upsert(8, 22, qty=-1)               # refused now; replayed, it appears
    produce(kafka_bootstrap, topic, s.records)
    _run(path, tmp_path)
    s.records.clear()
    s.delete(7, 21)                       # a later run: the delete of 7 is in another batch than its upsert
    s.upsert(9, 23)
    produce(kafka_bootstrap, topic, s.records)
    _run(path, tmp_path)
    assert [(d["stage"], d["error_class"]) for d in dlq_rows(pg_dsn)] == [("write", "integrity_constraint_violation")] * 2
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE items DROP CONSTRAINT qty_positive")
    res = run_ingest(["replay-dlq", "-c", path, "-p", "cdc"], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["id"]: r for r in _pg_rows(pg_dsn, "SELECT id, name, price, qty, updated_at, lsn FROM items")}
    assert rows == s.table
    assert {d["status"] for d in dlq_rows(pg_dsn)} == {"replayed"}


def test_truncate_events_are_ignored_or_dead_lettered(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=1)
    s = Source()
    s.upsert(1, 10)
    s.records.append((encode_key({"id": 0}, fields=KEY_FIELDS, schemas=True),
                      encode_event("t", None, None, fields=FIELDS, lsn=11, ts_ms=11, schemas=True)))
    s.upsert(2, 12)
    produce(kafka_bootstrap, topic, s.records)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _pg_sink(pg_dsn), truncate="dlq",
                                     dlq={"max_ratio": 1.0}))
    _run(path, tmp_path)
    assert sorted(r["id"] for r in _pg_rows(pg_dsn, "SELECT id FROM items")) == [1, 2]
    assert [(d["stage"], d["error_class"]) for d in dlq_rows(pg_dsn)] == [("map", "truncate")]
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_a_burst_of_deletes_never_trips_the_dlq_guard(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    """Deletes are handled records: 2,000 in a row (with their tombstones) pass a strict guard."""
    topic = new_topic(partitions=1)
    s = Source()
    for i in range(2000):
        s.upsert(i, 10 + i)
    for i in range(2000):
        s.delete(i, 5000 + i)
    produce(kafka_bootstrap, topic, s.records)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _pg_sink(pg_dsn),
                                     dlq={"max_consecutive": 10, "max_ratio": 0.01}))
    summary = _run(path, tmp_path)
    assert _pg_rows(pg_dsn, "SELECT count(*) AS n FROM items") == [{"n": 0}]
    pipeline = summary["pipelines"]["cdc"] if "pipelines" in summary else summary
    assert pipeline["rows_deleted"] == 2000  # each key's delete wins over its upsert, in one batch or two


def test_tombstones_past_their_retention_are_expired(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    """``deletes.tombstone_retention_s``: a later batch removes the tombstones older than that (here 1 s);
    younger ones stay and keep guarding their keys."""
    topic = new_topic(partitions=1)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _pg_sink(pg_dsn),
                                     deletes={"tombstone_retention_s": 1}))
    s = Source()
    s.upsert(1, 10)
    s.upsert(2, 11)
    s.delete(1, 12)
    produce(kafka_bootstrap, topic, s.records)
    _run(path, tmp_path)
    assert [r["id"] for r in _pg_rows(pg_dsn, "SELECT id FROM items_ingest_deleted")] == [1]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # as if the delete were 2 s old
        conn.execute("UPDATE items_ingest_deleted SET deleted_at = now() - interval '2 seconds'")
    s.records.clear()
    s.delete(2, 13)
    produce(kafka_bootstrap, topic, s.records)
    _run(path, tmp_path)
    assert [r["id"] for r in _pg_rows(pg_dsn, "SELECT id FROM items_ingest_deleted")] == [2]
    assert _pg_rows(pg_dsn, "SELECT count(*) AS n FROM items") == [{"n": 0}]


def test_soft_deletes_of_a_table_with_json_columns(pg_dsn):
    """Soft deletes into a table with ``json`` / ``jsonb`` columns (staged as text): a batch with a delete
    runs the statement that writes a delete with its row's values, which must cast them like the upsert
    (it once read the stage's text into the json columns, and every batch with a delete failed with
    SQLSTATE 42804, a transient error: the pipeline retried and stopped). A delete with its row's values
    keeps them, marked."""
    from ingest.config.cdc import DeleteSettings
    from ingest.sinks.postgres.settings import PostgresSinkSettings
    from ingest.sinks.postgres.sink import PostgresSink
    from ingest.sinks.postgres.statements import DeleteStatements, sink_table_sql
    from ingest.types import DeleteRow, ImageDeleteRow

    cfg = PostgresSinkSettings(dsn=pg_dsn, table="docs", conflict_key=["id"],
                               columns={"id": {"type": "bigint"}, "doc": {"type": "jsonb"}, "raw": {"type": "json"}})
    deletes = DeleteSettings(mode="soft")
    d = DeleteStatements(cfg, deletes)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in [*sink_table_sql(cfg), d.create_tombstones, d.soft_column_ddl]:
            conn.execute(statement)
    sink = PostgresSink(cfg, pool_size=1, deletes=deletes)
    try:
        sink.write([(1, '{"a": 1}', '[1,  2]', 7, 1), (2, '{"b": 2}', '"x"', 7, 2)])
        sink.write([DeleteRow((1, None, None, 7, 3)), ImageDeleteRow((2, '{"b": 3}', '"y"', 7, 4))])
    finally:
        sink.close()
    rows = _pg_rows(pg_dsn, "SELECT id, doc, raw::text AS raw, deleted_at IS NOT NULL AS gone FROM docs ORDER BY id")
    assert rows == [{"id": 1, "doc": {"a": 1}, "raw": "[1,  2]", "gone": True},
                    {"id": 2, "doc": {"b": 3}, "raw": '"y"', "gone": True}]
