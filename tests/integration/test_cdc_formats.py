"""Debezium change events in the registry formats (``envelope: debezium`` with ``format: avro``,
``json_schema``, ``protobuf``): the envelope is read from the decoded record, so deletes, tombstones
and the version guard work as with Debezium's JSON converter (test_cdc_deletes.py).

Avro events are shaped as Debezium's Avro converter writes them (record ``<topic>.Envelope`` whose
``before``/``after`` are ``["null", <topic>.Value]``, a ``source`` record, keys in ``<topic>.Key`` on
the key subject), made by confluent-kafka's own AvroSerializer against the Schema Registry stand-in.
JSON Schema and Protobuf events carry the same envelope (``before``/``after`` nullable objects / unset
message fields). Every case runs ``ingest migrate`` and ``ingest run --until-idle`` as subprocesses
against the real broker and PostgreSQL.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest, write_config
from harness.kafka import produce
from harness.serde import avro_values, json_schema_values, protobuf_values
from integration.formats_helpers import format_config, migrate
from integration.pipeline_helpers import (
    assert_committed_at_log_end,
    dlq_rows,
    read_summary,
)
from psycopg.rows import dict_row

UTC = timezone.utc
T0 = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
#: PostgreSQL LSNs are large (beyond 32 bits): the version column must keep them exactly.
LSN0 = 0x2_16B3_4D48

# --------------------------------------------------------------------------- Avro schemas (Debezium's Avro converter)

_DECIMAL = {"type": "bytes", "scale": 2, "precision": 12, "connect.version": 1,
            "connect.parameters": {"scale": "2", "connect.decimal.precision": "12"},
            "connect.name": "org.apache.kafka.connect.data.Decimal", "logicalType": "decimal"}
VALUE_SCHEMA = json.dumps({
    "type": "record", "name": "Envelope", "namespace": "dbserver1.public.items",
    "connect.name": "dbserver1.public.items.Envelope",
    "fields": [
        {"name": "before", "default": None, "type": ["null", {
            "type": "record", "name": "Value", "connect.name": "dbserver1.public.items.Value",
            "fields": [
                {"name": "id", "type": "long"},
                {"name": "name", "type": ["null", "string"], "default": None},
                {"name": "price", "type": ["null", _DECIMAL], "default": None},
                {"name": "updated_at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}],
                 "default": None},
            ]}]},
        {"name": "after", "type": ["null", "Value"], "default": None},
        {"name": "source", "type": {
            "type": "record", "name": "Source", "namespace": "io.debezium.connector.postgresql",
            "connect.name": "io.debezium.connector.postgresql.Source",
            "fields": [
                {"name": "version", "type": "string"},
                {"name": "connector", "type": "string"},
                {"name": "name", "type": "string"},
                {"name": "ts_ms", "type": "long"},
                {"name": "snapshot", "default": "false", "type": [
                    {"type": "string", "connect.version": 1, "connect.default": "false",
                     "connect.parameters": {"allowed": "true,last,false,incremental"},
                     "connect.name": "io.debezium.data.Enum"}, "null"]},
                {"name": "db", "type": "string"},
                {"name": "sequence", "type": ["null", "string"], "default": None},
                {"name": "schema", "type": "string"},
                {"name": "table", "type": "string"},
                {"name": "txId", "type": ["null", "long"], "default": None},
                {"name": "lsn", "type": ["null", "long"], "default": None},
                {"name": "xmin", "type": ["null", "long"], "default": None},
            ]}},
        {"name": "op", "type": "string"},
        {"name": "ts_ms", "type": ["null", "long"], "default": None},
        {"name": "transaction", "default": None, "type": ["null", {
            "type": "record", "name": "block", "namespace": "event",
            "fields": [{"name": "id", "type": "string"}, {"name": "total_order", "type": "long"},
                       {"name": "data_collection_order", "type": "long"}]}]},
    ],
})
KEY_SCHEMA = json.dumps({"type": "record", "name": "Key", "namespace": "dbserver1.public.items",
                         "connect.name": "dbserver1.public.items.Key",
                         "fields": [{"name": "id", "type": "long"}]})

# --------------------------------------------------------------------------- the source table's history


def _row(i: int, n: int, **over: Any) -> dict[str, Any]:
    return {"id": i, "name": f"item {i} at {n}", "price": Decimal(f"{i}.{n % 100:02d}"),
            "updated_at": T0 + timedelta(microseconds=n), **over}


class Source:
    """A source table's change stream, format-neutral (Python values), and the table it leaves.

    ``events`` holds ``(key id, envelope or None)``: None is the tombstone Debezium writes after a delete.
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, dict[str, Any] | None]] = []
        self.table: dict[int, dict[str, Any]] = {}

    @staticmethod
    def envelope(op: str, before: dict[str, Any] | None, after: dict[str, Any] | None, n: int) -> dict[str, Any]:
        source = {"version": "3.0.1.Final", "connector": "postgresql", "name": "dbserver1", "ts_ms": 1_700_000_000 + n,
                  "snapshot": "true" if op == "r" else "false", "db": "shop", "sequence": None,
                  "schema": "public", "table": "items", "txId": 700 + n, "lsn": LSN0 + n, "xmin": None}
        return {"before": before, "after": after, "source": source, "op": op, "ts_ms": 1_700_000_100 + n,
                "transaction": None}

    def upsert(self, i: int, n: int, *, op: str = "c", with_before: bool = False, apply: bool = True,
               **over: Any) -> None:
        after = _row(i, n, **over)
        before = ({**self.table[i]} if with_before else None)
        if before is not None:
            before.pop("lsn")
        self.events.append((i, self.envelope(op, before, after, n)))
        if apply:
            self.table[i] = {**after, "lsn": LSN0 + n}

    def delete(self, i: int, n: int, *, with_before: bool = True, tombstone: bool = True, apply: bool = True) -> None:
        # REPLICA IDENTITY DEFAULT: the before image holds the key, every other column null
        before = {"id": i, "name": None, "price": None, "updated_at": None} if with_before else None
        self.events.append((i, self.envelope("d", before, None, n)))
        if tombstone:
            self.events.append((i, None))
        if apply:
            self.table.pop(i, None)


def _history() -> Source:
    """Inserts, updates, deletes (each with its tombstone), a re-insert, then stale and repeated records."""
    s = Source()
    s.upsert(1, 10)
    s.upsert(2, 11)
    s.upsert(1, 12, op="u", with_before=True)  # REPLICA IDENTITY FULL: the update has its before image
    s.delete(2, 13)
    s.upsert(3, 14)
    s.delete(3, 15)
    s.upsert(3, 16, name=None)                 # a key reused after its delete; a null in the row image
    s.upsert(4, 17)
    s.delete(4, 18)
    s.delete(1, 5, apply=False)                # a stale delete (lower lsn than the row): the row stays
    s.upsert(2, 12, op="u", apply=False)       # a stale upsert older than the delete: no resurrection
    s.delete(2, 13)                            # the delete again: a no-op
    s.delete(99, 19)                           # a key that never existed: handled, not poison
    s.upsert(5, 20, op="r", price=None)        # a snapshot read, a null decimal
    return s


# --------------------------------------------------------------------------- encodings


def _interleave(keys: list[bytes], events: list[tuple[int, dict[str, Any] | None]],
                values: list[bytes]) -> list[tuple[bytes, bytes | None]]:
    it = iter(values)
    return [(k, None if doc is None else next(it)) for k, (_, doc) in zip(keys, events)]


def _encode_avro(url: str, topic: str, events: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[bytes, bytes | None]]:
    keys = avro_values(url, topic, KEY_SCHEMA, [{"id": i} for i, _ in events], field="key")
    values = avro_values(url, topic, VALUE_SCHEMA, [doc for _, doc in events if doc is not None])
    return _interleave(keys, events, values)


def _json_key(i: int) -> bytes:
    return json.dumps({"id": i}).encode()


# JSON Schema (as Confluent's JsonSchemaConverter describes the envelope): before/after nullable objects;
# decimals as exact text (decimal.handling.mode=string), timestamptz as ISO 8601 (ZonedTimestamp).
_JS_ROW = {"oneOf": [{"type": "null"}, {
    "type": "object", "title": "dbserver1.public.items.Value",
    "properties": {"id": {"type": "integer"}, "name": {"oneOf": [{"type": "null"}, {"type": "string"}]},
                   "price": {"oneOf": [{"type": "null"}, {"type": "string"}]},
                   "updated_at": {"oneOf": [{"type": "null"}, {"type": "string"}]}},
    "required": ["id"]}]}
JSON_SCHEMA = json.dumps({
    "$schema": "http://json-schema.org/draft-07/schema#", "title": "dbserver1.public.items.Envelope",
    "type": "object",
    "properties": {"before": _JS_ROW, "after": _JS_ROW,
                   "source": {"type": "object", "properties": {"lsn": {"oneOf": [{"type": "null"},
                                                                                 {"type": "integer"}]},
                                                               "ts_ms": {"type": "integer"},
                                                               "db": {"type": "string"},
                                                               "table": {"type": "string"}},
                              "required": ["ts_ms", "db", "table"]},
                   "op": {"type": "string"}, "ts_ms": {"oneOf": [{"type": "null"}, {"type": "integer"}]}},
    "required": ["source", "op"]})


def _js_image(image: dict[str, Any] | None) -> dict[str, Any] | None:
    if image is None:
        return None
    out = dict(image)
    out["price"] = None if image["price"] is None else str(image["price"])
    out["updated_at"] = None if image["updated_at"] is None else image["updated_at"].isoformat()
    return out


def _encode_json_schema(url: str, topic: str,
                        events: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[bytes, bytes | None]]:
    docs = [{**doc, "before": _js_image(doc["before"]), "after": _js_image(doc["after"])}
            for _, doc in events if doc is not None]
    values = json_schema_values(url, topic, JSON_SCHEMA, docs)
    return _interleave([_json_key(i) for i, _ in events], events, values)


def _proto_envelope_class() -> Any:
    """``Envelope {Value before; Value after; Source source; string op; optional int64 ts_ms}`` (message
    fields have presence: a null image is an unset field), built at run time like harness/proto_messages."""
    from google.protobuf import (
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        timestamp_pb2,
    )

    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="dbserver1/public/items.proto", package="dbserver1.public.items",
                                            syntax="proto3")
    fd.dependency.append("google/protobuf/timestamp.proto")

    def field(msg: Any, name: str, number: int, kind: int, type_name: str = "", optional: bool = False) -> None:
        f = msg.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = type_name
        if optional:
            f.proto3_optional = True
            f.oneof_index = len(msg.oneof_decl)
            msg.oneof_decl.add(name=f"_{name}")

    env = fd.message_type.add(name="Envelope")
    field(env, "before", 1, F.TYPE_MESSAGE, ".dbserver1.public.items.Value")
    field(env, "after", 2, F.TYPE_MESSAGE, ".dbserver1.public.items.Value")
    field(env, "source", 3, F.TYPE_MESSAGE, ".dbserver1.public.items.Source")
    field(env, "op", 4, F.TYPE_STRING)
    field(env, "ts_ms", 5, F.TYPE_INT64, optional=True)
    value = fd.message_type.add(name="Value")
    field(value, "id", 1, F.TYPE_INT64)
    field(value, "name", 2, F.TYPE_STRING, optional=True)
    field(value, "price", 3, F.TYPE_STRING, optional=True)
    field(value, "updated_at", 4, F.TYPE_MESSAGE, ".google.protobuf.Timestamp")
    source = fd.message_type.add(name="Source")
    for number, (name, kind) in enumerate((("connector", F.TYPE_STRING), ("ts_ms", F.TYPE_INT64),
                                           ("db", F.TYPE_STRING), ("schema", F.TYPE_STRING),
                                           ("table", F.TYPE_STRING)), start=1):
        field(source, name, number, kind)
    field(source, "txId", 6, F.TYPE_INT64, optional=True)
    field(source, "lsn", 7, F.TYPE_INT64, optional=True)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("dbserver1.public.items.Envelope"))


def _encode_protobuf(url: str, topic: str,
                     events: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[bytes, bytes | None]]:
    envelope = _proto_envelope_class()
    messages = []
    for _, doc in events:
        if doc is None:
            continue
        m = envelope(op=doc["op"], ts_ms=doc["ts_ms"])
        for which in ("before", "after"):
            image = doc[which]
            if image is None:
                continue
            target = getattr(m, which)
            target.id = image["id"]
            if image["name"] is not None:
                target.name = image["name"]
            if image["price"] is not None:
                target.price = str(image["price"])
            if image["updated_at"] is not None:
                target.updated_at.FromDatetime(image["updated_at"])
        src = doc["source"]
        m.source.connector, m.source.ts_ms, m.source.db = src["connector"], src["ts_ms"], src["db"]
        m.source.schema, m.source.table, m.source.txId, m.source.lsn = (src["schema"], src["table"], src["txId"],
                                                                         src["lsn"])
        messages.append(m)
    values = protobuf_values(url, topic, messages)
    return _interleave([_json_key(i) for i, _ in events], events, values)


ENCODERS = {"avro": _encode_avro, "json_schema": _encode_json_schema, "protobuf": _encode_protobuf}

# --------------------------------------------------------------------------- config and run


def _pg_sink(dsn: str) -> dict[str, Any]:
    return {"kind": "postgres", "dsn": dsn, "table": "items", "conflict_key": ["id"], "version_column": "lsn",
            "columns": {"id": {"type": "bigint"}, "name": {"type": "text"}, "price": {"type": "numeric(12,2)"},
                        "updated_at": {"type": "timestamptz"},
                        "lsn": {"type": "bigint", "source": "@source.lsn"}}}


def _config(kafka_bootstrap: str, topic: str, group: str, fmt: str, registry: str, sink: dict[str, Any],
            **pipeline: Any) -> dict[str, Any]:
    return format_config(bootstrap=kafka_bootstrap, topic=topic, group=group, fmt=fmt, sink=sink, registry=registry,
                         name="cdc", envelope="debezium", **pipeline)


def _pg_rows(dsn: str, sql: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(sql).fetchall()


def _items(dsn: str) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in _pg_rows(dsn, "SELECT id, name, price, updated_at, lsn FROM items")}


def _run(path: Path, tmp_path: Path) -> dict[str, Any]:
    summary = tmp_path / "summary.json"
    res = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0", "--summary-json", summary],
                     timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-4000:]}"
    return read_summary(summary)["pipelines"]["cdc"]


def _dead(dsn: str) -> list[tuple[Any, ...]]:
    return [(d["offset"], d["stage"], d["error_class"], d["error_message"]) for d in dlq_rows(dsn)]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", ["avro", "json_schema", "protobuf"])
def test_debezium_events_in_a_registry_format_mirror_the_source_table(fmt, tmp_path, kafka_bootstrap, pg_dsn,
                                                                      new_topic, group_id, schema_registry):
    topic = new_topic(partitions=1)
    source = _history()
    records = ENCODERS[fmt](schema_registry.url, topic, source.events)
    assert sum(v is None for _, v in records) == 6  # a tombstone after each delete
    produce(kafka_bootstrap, topic, records)
    keys = {"key_format": "avro"} if fmt == "avro" else {}
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, fmt, schema_registry.url, _pg_sink(pg_dsn),
                                     dlq={"kind": "postgres", "dsn": pg_dsn}, **keys))
    pipeline = _run(path, tmp_path)
    assert _dead(pg_dsn) == []
    rows = _items(pg_dsn)
    assert rows == source.table
    assert sorted(rows) == [1, 3, 5]
    assert rows[3]["name"] is None and rows[5]["price"] is None
    assert rows[1]["price"] == Decimal("1.12") and type(rows[1]["price"]) is Decimal
    assert rows[1]["updated_at"] == T0 + timedelta(microseconds=12) and rows[1]["updated_at"].tzinfo is not None
    assert rows[1]["lsn"] == LSN0 + 12
    # deletes written: 2, 4 and 99 (the stale delete of 1 and the repeated delete of 2 are written too,
    # the version guard makes them no-ops in the table)
    assert pipeline["rows_deleted"] >= 3
    deleted = {r["id"]: r["lsn"] - LSN0 for r in _pg_rows(pg_dsn, "SELECT id, lsn FROM items_ingest_deleted")}
    # 1's stale delete and 3's delete are written only when a later change of the key is in another batch
    assert {k: v for k, v in deleted.items() if k not in (1, 3)} == {2: 13, 4: 18, 99: 19}
    assert deleted.get(1, 5) == 5 and deleted.get(3, 15) == 15
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_avro_delete_without_before_image_reads_the_avro_record_key(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                    group_id, schema_registry):
    """op d with ``before`` null (a table without a replica identity key): with ``key_format: avro`` the
    record key decodes to ``{"id": ...}`` and the row is deleted; the event's lsn is the delete's version."""
    topic = new_topic(partitions=1)
    s = Source()
    for i in (1, 2, 3):
        s.upsert(i, 10 + i)
    s.delete(1, 20, with_before=False)
    s.delete(77, 21, with_before=False)           # a key that never existed
    s.delete(3, 5, with_before=False, apply=False)  # stale: lower lsn than the row
    s.upsert(2, 22, op="u")
    records = _encode_avro(schema_registry.url, topic, s.events)
    produce(kafka_bootstrap, topic, records)
    path = migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, "avro", schema_registry.url, _pg_sink(pg_dsn),
                                     key_format="avro", dlq={"kind": "postgres", "dsn": pg_dsn}))
    pipeline = _run(path, tmp_path)
    assert _dead(pg_dsn) == []
    assert _items(pg_dsn) == s.table
    assert sorted(s.table) == [2, 3]
    assert pipeline["rows_deleted"] >= 2
    deleted = {r["id"]: r["lsn"] - LSN0 for r in _pg_rows(pg_dsn, "SELECT id, lsn FROM items_ingest_deleted")}
    assert {k: v for k, v in deleted.items() if k != 3} == {1: 20, 77: 21} and deleted.get(3, 5) == 5
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_check_reads_the_columns_of_a_debezium_avro_subject_in_the_row_image(tmp_path, kafka_bootstrap, pg_dsn,
                                                                             new_topic, group_id, schema_registry):
    """``ingest check`` on a Debezium pipeline: ``$`` paths read the row image, so the Envelope's ``Value``
    record holds ``id``/``name``/``price``/``updated_at`` -- a required key column passes, nothing is warned."""
    topic = new_topic(partitions=1)
    s = Source()
    s.upsert(1, 10)
    produce(kafka_bootstrap, topic, _encode_avro(schema_registry.url, topic, s.events))
    sink = _pg_sink(pg_dsn)
    sink["columns"]["id"] = {"type": "bigint", "required": True}
    cfg = _config(kafka_bootstrap, topic, group_id, "avro", schema_registry.url, sink, key_format="avro")
    res = run_ingest(["check", "-c", write_config(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "is not a field of" not in res.stdout + res.stderr
    sink["columns"]["colour"] = {"type": "text"}  # not in the row image: warned
    cfg = _config(kafka_bootstrap, topic, group_id, "avro", schema_registry.url, sink, key_format="avro")
    res = run_ingest(["check", "-c", write_config(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)
    assert "column colour (source $.colour) is not a field of" in res.stdout + res.stderr
    assert "column id " not in res.stdout + res.stderr
