"""``format: avro`` end to end: records made by confluent-kafka's own AvroSerializer against a Schema
Registry (the stand-in of harness/schema_registry.py, over real HTTP), on the real broker, into real
PostgreSQL (and chDB for ClickHouse).

Covers every Avro type the README's table lists, schema evolution mid-topic, each decode poison class,
a registry outage (nothing dead-lettered, the run resumes), an empty registry (the pipeline stops
instead of dead-lettering the topic), replay after a schema is registered, and plain Avro with
``avro_schema: FILE``.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from fastavro import parse_schema, schemaless_writer
from formats_helpers import format_config, migrate, run_until_idle
from harness import run_ingest, start_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, committed_offsets, produce
from harness.schema_registry import SchemaRegistryStandIn
from harness.serde import avro_values, avro_values_with_id_headers
from pipeline_helpers import dlq_rows, log_events, wait_until

UTC = dt.timezone.utc

TYPES_SCHEMA = json.dumps({
    "type": "record", "name": "Typed", "namespace": "test.ingest",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "small", "type": "int"},
        {"name": "label", "type": "string"},
        {"name": "active", "type": "boolean"},
        {"name": "ratio", "type": "float"},
        {"name": "score", "type": "double"},
        {"name": "blob", "type": "bytes"},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
        {"name": "fixed_amount", "type": {"type": "fixed", "name": "Money", "size": 8, "logicalType": "decimal",
                                          "precision": 18, "scale": 4}},
        {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "local_at", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "clock_ms", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "clock_us", "type": {"type": "long", "logicalType": "time-micros"}},
        {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "state", "type": {"type": "enum", "name": "State", "symbols": ["NEW", "PAID", "SHIPPED"]}},
        {"name": "address", "type": {"type": "record", "name": "Address", "fields": [
            {"name": "city", "type": "string"}, {"name": "zip", "type": ["null", "string"], "default": None}]}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "maybe", "type": ["null", "long"], "default": None},
    ],
})

TYPES_DOC: dict[str, Any] = {
    "id": 7, "small": -12, "label": "naïve — ünïcødé ✓", "active": True, "ratio": 0.5, "score": 1e-300,
    "blob": b"\x00\x01\xffbytes", "amount": Decimal("12345.67"), "fixed_amount": Decimal("-98765.4321"),
    "at_ms": dt.datetime(2026, 11, 30, 10, 34, 56, 789000, tzinfo=UTC),
    "at_us": dt.datetime(2026, 11, 30, 10, 34, 56, 789123, tzinfo=UTC),
    "local_at": dt.datetime(2026, 11, 30, 1, 2, 3, 4000), "day": dt.date(2026, 2, 28),
    "clock_ms": dt.time(13, 14, 15, 16000), "clock_us": dt.time(23, 59, 59, 999999),
    "ref": uuid.UUID("8c7d1a2e-4f3b-4c5d-9e8f-0a1b2c3d4e5f"), "state": "PAID",
    "address": {"city": "Milano", "zip": None}, "tags": ["a", "b", "c"], "attrs": {"color": 3, "size": 9},
    "note": "hello", "maybe": None,
}

PG_COLUMNS = {
    "id": {"type": "bigint", "required": True},
    "small": {"type": "smallint"},
    "label": {"type": "text"},
    "active": {"type": "boolean"},
    "ratio": {"type": "real"},
    "score": {"type": "double precision"},
    "blob": {"type": "bytea"},
    "amount": {"type": "numeric(12,2)"},
    "fixed_amount": {"type": "numeric(18,4)"},
    "amount_text": {"type": "text", "source": "$.amount"},
    "at_ms": {"type": "timestamptz"},
    "at_us": {"type": "timestamptz"},
    "local_at": {"type": "timestamp"},
    "day": {"type": "date"},
    "clock_ms": {"type": "time"},
    "clock_us": {"type": "time"},
    "ref": {"type": "uuid"},
    "ref_text": {"type": "text", "source": "$.ref"},
    "state": {"type": "text"},
    "city": {"type": "text", "source": "$.address.city"},
    "zip": {"type": "text", "source": "$.address.zip"},
    "second_tag": {"type": "text", "source": "$.tags[1]"},
    "color": {"type": "integer", "source": "$.attrs.color"},
    "address": {"type": "jsonb"},
    "tags": {"type": "jsonb"},
    "note": {"type": "text"},
    "maybe": {"type": "bigint"},
}


def _config(*, bootstrap: str, topic: str, group: str, dsn: str, registry: str | None, columns: dict[str, Any],
            table: str = "typed", conflict_key: tuple[str, ...] = ("id",), **pipeline: Any) -> dict[str, Any]:
    sink = {"kind": "postgres", "dsn": dsn, "table": table, "conflict_key": list(conflict_key), "columns": columns}
    return format_config(bootstrap=bootstrap, topic=topic, group=group, fmt="avro", sink=sink, registry=registry,
                         name="avro", **pipeline)


_migrate = migrate
_run = run_until_idle


def _rows(dsn: str, sql: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(sql)
        names = [d.name for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


def test_every_avro_type_round_trips_into_postgres(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                   schema_registry):
    topic = new_topic(partitions=1)
    second = {**TYPES_DOC, "id": 8, "note": None, "maybe": 2**62, "tags": [], "address": {"city": "X", "zip": "1"}}
    values = avro_values(schema_registry.url, topic, TYPES_SCHEMA, [TYPES_DOC, second])
    produce(kafka_bootstrap, topic, [(b"7", values[0]), (b"8", values[1])])
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=schema_registry.url, columns=PG_COLUMNS))
    _run(path, tmp_path)
    assert dlq_rows(pg_dsn) == []
    rows = {r["id"]: r for r in _rows(pg_dsn, "SELECT * FROM typed")}
    row = rows[7]
    assert row["small"] == -12 and row["label"] == TYPES_DOC["label"] and row["active"] is True
    assert row["ratio"] == 0.5 and row["score"] == 1e-300
    assert bytes(row["blob"]) == b"\x00\x01\xffbytes"
    assert row["amount"] == Decimal("12345.67") and row["fixed_amount"] == Decimal("-98765.4321")
    assert row["amount_text"] == "12345.67"
    assert row["at_ms"] == TYPES_DOC["at_ms"] and row["at_us"] == TYPES_DOC["at_us"]
    assert row["local_at"] == TYPES_DOC["local_at"] and row["day"] == dt.date(2026, 2, 28)
    assert row["clock_ms"] == dt.time(13, 14, 15, 16000) and row["clock_us"] == dt.time(23, 59, 59, 999999)
    assert row["ref"] == TYPES_DOC["ref"] and row["ref_text"] == str(TYPES_DOC["ref"])
    assert row["state"] == "PAID" and row["city"] == "Milano" and row["zip"] is None
    assert row["second_tag"] == "b" and row["color"] == 3
    assert row["address"] == {"city": "Milano", "zip": None} and row["tags"] == ["a", "b", "c"]
    assert row["note"] == "hello" and row["maybe"] is None
    other = rows[8]
    assert other["note"] is None and other["maybe"] == 2**62 and other["second_tag"] is None
    assert other["tags"] == [] and other["zip"] == "1"


EVOLVING = [
    # v1
    {"type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "order_id", "type": "int"}, {"name": "status", "type": "string"},
        {"name": "legacy", "type": "string"}]},
    # v2: a field added with a default
    {"type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "order_id", "type": "int"}, {"name": "status", "type": "string"},
        {"name": "legacy", "type": "string"}, {"name": "channel", "type": "string", "default": "web"}]},
    # v3: a field removed
    {"type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "order_id", "type": "int"}, {"name": "status", "type": "string"},
        {"name": "channel", "type": "string", "default": "web"}]},
    # v4: int widened to long
    {"type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "order_id", "type": "long"}, {"name": "status", "type": "string"},
        {"name": "channel", "type": "string", "default": "web"}]},
]


def test_schema_evolving_three_times_mid_topic_keeps_working(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                             schema_registry):
    """Four schema ids interleaved in one partition (so one batch holds several): each record maps by
    field name with its own writer schema; a required column the new schema dropped is poison naming it."""
    topic = new_topic(partitions=1)
    url = schema_registry.url
    records: list[tuple[bytes, bytes]] = []
    for i in range(40):
        version = i % 4
        doc: dict[str, Any] = {"order_id": i if version < 3 else 2**40 + i, "status": f"s{i}"}
        if version < 2:
            doc["legacy"] = f"old{i}"
        if version >= 1:
            doc["channel"] = "app" if i % 8 == 1 else "web"
        records.append((str(i).encode(), avro_values(url, topic, json.dumps(EVOLVING[version]), [doc])[0]))
    produce(kafka_bootstrap, topic, records)
    schema_ids = [int.from_bytes(records[v][1][1:5], "big") for v in range(4)]
    assert len(set(schema_ids)) == 4
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text", "required": True},
               "channel": {"type": "text", "default": "unknown"}, "legacy": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=url, columns=columns, table="orders", conflict_key=("order_id",)))
    _run(path, tmp_path)
    assert dlq_rows(pg_dsn) == []
    rows = {r["order_id"]: r for r in _rows(pg_dsn, "SELECT * FROM orders")}
    assert len(rows) == 40
    for i in range(40):
        version = i % 4
        row = rows[i if version < 3 else 2**40 + i]
        assert row["status"] == f"s{i}"
        assert row["legacy"] == (f"old{i}" if version < 2 else None)
        assert row["channel"] == ("unknown" if version == 0 else ("app" if i % 8 == 1 else "web"))

    # The config now requires `legacy`, which v3 and v4 dropped: their records are poison, naming the schema.
    strict = {**columns, "legacy": {"type": "text", "required": True}}
    cfg = _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id + "-strict", dsn=pg_dsn, registry=url,
                  columns=strict, table="orders", conflict_key=("order_id",), dlq={"max_ratio": 1.0})
    _run(write_config(tmp_path / "strict", cfg), tmp_path)
    dead = dlq_rows(pg_dsn)
    assert len(dead) == 20 and {d["error_class"] for d in dead} == {"missing_field"}
    ids = {int(d["key"]) % 4: d["error_message"] for d in dead}
    assert sorted(ids) == [2, 3]
    assert f"value schema id {schema_ids[2]}" in ids[2] and f"value schema id {schema_ids[3]}" in ids[3], ids


def test_each_decode_poison_class_goes_to_the_dlq_with_its_reason(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                  group_id, schema_registry):
    topic = new_topic(partitions=1)
    schema = json.dumps(EVOLVING[0])
    good = avro_values(schema_registry.url, topic, schema, [{"order_id": i, "status": "ok", "legacy": "x"}
                                                            for i in range(3)])
    schema_id = int.from_bytes(good[0][1:5], "big")
    records = [
        (b"0", good[0]),
        (b"json", b'{"order_id": 9, "status": "plain json"}'),           # no magic byte
        (b"short", b"\x00\x00\x01"),                                     # too short for an id
        (b"unknown", b"\x00" + (4242).to_bytes(4, "big") + good[1][5:]),  # an id the registry lacks
        (b"truncated", good[1][:-2]),                                    # does not decode with its schema
        (b"trailing", good[1] + b"\x02\x04"),                            # bytes left over
        (b"2", good[2]),
    ]
    produce(kafka_bootstrap, topic, records)
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=schema_registry.url, columns=columns, table="orders",
                                      conflict_key=("order_id",), dlq={"max_ratio": 1.0}))
    _run(path, tmp_path)
    assert sorted(r["order_id"] for r in _rows(pg_dsn, "SELECT order_id FROM orders")) == [0, 2]
    dead = {d["key"].decode(): d for d in dlq_rows(pg_dsn)}
    assert {k: (d["stage"], d["error_class"]) for k, d in dead.items()} == {
        "json": ("decode", "bad_magic_byte"), "short": ("decode", "bad_magic_byte"),
        "unknown": ("decode", "unknown_schema"), "truncated": ("decode", "schema_mismatch"),
        "trailing": ("decode", "schema_mismatch"),
    }
    assert "schema id 4242" in dead["unknown"]["error_message"]
    assert f"schema id {schema_id}" in dead["truncated"]["error_message"]
    assert "2 bytes left" in dead["trailing"]["error_message"]
    assert bytes(dead["truncated"]["value"]) == good[1][:-2]  # the DLQ keeps the raw bytes
    assert schema_registry.requests["schemas/ids"] == 2  # one lookup per id, cached after


def test_registry_outage_pauses_and_resumes_without_dead_letters(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                 group_id, schema_registry):
    topic = new_topic(partitions=3)
    url = schema_registry.url
    docs = [{"order_id": i, "status": f"s{i}", "legacy": ""} for i in range(300)]
    values = avro_values(url, topic, json.dumps(EVOLVING[0]), docs)
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
    schema_registry.stop()  # the consumer finds the registry down from its first record
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}
    cfg = _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, registry=url,
                  columns=columns, table="orders", conflict_key=("order_id",),
                  retry={"max_attempts": 0, "initial_backoff_ms": 100, "max_backoff_ms": 500})
    path = _migrate(tmp_path, cfg)
    proc = start_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0"], log_dir=tmp_path)
    wait_until(lambda: sum(e.get("event") == "schema registry unavailable: holding records, partitions paused"
                           for e in log_events(proc)) >= 3, 60, what="the hold to retry", proc=proc)
    assert proc.poll() is None, proc.describe()  # still running: held, not idle, not failed
    assert _rows(pg_dsn, "SELECT count(*) AS n FROM orders")[0]["n"] == 0
    assert dlq_rows(pg_dsn) == []
    assert all(v <= 0 for v in committed_offsets(kafka_bootstrap, group_id, topic).values())
    schema_registry.start()
    assert proc.wait(120) == 0, proc.describe()
    assert _rows(pg_dsn, "SELECT count(*) AS n FROM orders")[0]["n"] == 300
    assert dlq_rows(pg_dsn) == []
    events = [e.get("event") for e in log_events(proc)]
    assert "schema registry answers again: resuming" in events


@pytest.mark.parametrize("fault", ["503", "401", "429"])
def test_registry_error_statuses_are_transient_and_give_up_without_committing(fault, tmp_path, kafka_bootstrap,
                                                                              pg_dsn, new_topic, group_id,
                                                                              schema_registry):
    topic = new_topic(partitions=1)
    values = avro_values(schema_registry.url, topic, json.dumps(EVOLVING[0]),
                         [{"order_id": i, "status": "s", "legacy": ""} for i in range(20)])
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
    schema_registry.fault(fault)
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=schema_registry.url, columns=columns, table="orders",
                                      conflict_key=("order_id",),
                                      retry={"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 100}))
    res = _run(path, tmp_path, expect=1)
    assert f"HTTP {fault}" in res.stderr and "gave up after 3 attempts" in res.stderr, res.stderr[-2000:]
    assert dlq_rows(pg_dsn) == []
    assert _rows(pg_dsn, "SELECT count(*) AS n FROM orders")[0]["n"] == 0
    assert committed_offsets(kafka_bootstrap, group_id, topic).get(0, -1) <= 0


def test_an_empty_registry_stops_the_pipeline_instead_of_dead_lettering(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                        group_id, schema_registry):
    topic = new_topic(partitions=1)
    values = avro_values(schema_registry.url, topic, json.dumps(EVOLVING[0]),
                         [{"order_id": i, "status": "s", "legacy": ""} for i in range(50)])
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
    schema_registry.fault("empty")  # every lookup: not found; no subjects
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=schema_registry.url, columns=columns, table="orders",
                                      conflict_key=("order_id",)))
    res = _run(path, tmp_path, expect=1)
    assert "holds no subjects at all" in res.stderr, res.stderr[-2000:]
    assert dlq_rows(pg_dsn) == []
    assert committed_offsets(kafka_bootstrap, group_id, topic).get(0, -1) <= 0


def test_replay_dlq_decodes_once_the_schema_is_registered(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                          schema_registry):
    topic = new_topic(partitions=1)
    url = schema_registry.url
    known = avro_values(url, topic, json.dumps(EVOLVING[0]), [{"order_id": 1, "status": "a", "legacy": ""}])
    later = avro_values(url, topic, json.dumps(EVOLVING[1]),
                        [{"order_id": i, "status": "b", "legacy": "", "channel": "app"} for i in range(2, 6)])
    later_id = int.from_bytes(later[0][1:5], "big")
    schema_registry.hide(later_id)  # as if those producers had registered their schema somewhere else
    produce(kafka_bootstrap, topic, [(b"1", known[0])] + [(str(i).encode(), v) for i, v in zip(range(2, 6), later)])
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"},
               "channel": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=url, columns=columns, table="orders", conflict_key=("order_id",),
                                      dlq={"max_ratio": 1.0}))
    _run(path, tmp_path)
    assert [d["error_class"] for d in dlq_rows(pg_dsn)] == ["unknown_schema"] * 4
    schema_registry.reveal(later_id)
    res = run_ingest(["replay-dlq", "-c", path, "-p", "avro"], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["order_id"]: r for r in _rows(pg_dsn, "SELECT * FROM orders")}
    assert sorted(rows) == [1, 2, 3, 4, 5] and rows[4]["channel"] == "app"
    assert {d["status"] for d in dlq_rows(pg_dsn)} == {"replayed"}


def test_plain_avro_with_a_schema_file(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=2)
    schema = EVOLVING[1]
    (tmp_path / "order.avsc").write_text(json.dumps(schema))
    parsed = parse_schema(schema)

    def encode(doc: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        schemaless_writer(buf, parsed, doc)
        return buf.getvalue()

    records = [(str(i).encode(), encode({"order_id": i, "status": f"s{i}", "legacy": "", "channel": "web"}))
               for i in range(100)]
    records.append((b"bad", b"\x00\x00\x00\x00\x01"))  # does not decode with the file's schema
    produce(kafka_bootstrap, topic, records)
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"},
               "channel": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=None, columns=columns, table="orders", conflict_key=("order_id",),
                                      avro_schema=str(tmp_path / "order.avsc"), dlq={"max_ratio": 1.0}))
    _run(path, tmp_path)
    assert _rows(pg_dsn, "SELECT count(*) AS n FROM orders")[0]["n"] == 100
    dead = dlq_rows(pg_dsn)
    assert [(d["key"], d["error_class"]) for d in dead] == [(b"bad", "schema_mismatch")]
    assert "order.avsc" in dead[0]["error_message"]


CH_COLUMNS = {
    "id": {"type": "Int64"},
    "small": {"type": "Int16"},
    "label": {"type": "String"},
    "active": {"type": "Bool"},
    "score": {"type": "Float64"},
    "amount": {"type": "Decimal(12, 2)"},
    "fixed_amount": {"type": "Decimal(18, 4)"},
    "at_ms": {"type": "DateTime64(3)"},
    "at_us": {"type": "DateTime64(6)"},
    "day": {"type": "Date"},
    "clock_us": {"type": "String"},
    "ref": {"type": "UUID"},
    "state": {"type": "LowCardinality(String)"},
    "city": {"type": "String", "source": "$.address.city"},
    "tags": {"type": "Array(String)"},
    "note": {"type": "Nullable(String)"},
    "maybe": {"type": "Nullable(Int64)"},
}


def test_every_avro_type_round_trips_into_clickhouse(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                     schema_registry, chdb):
    topic = new_topic(partitions=1)
    second = {**TYPES_DOC, "id": 8, "note": None, "maybe": -5, "tags": []}
    values = avro_values(schema_registry.url, topic, TYPES_SCHEMA, [TYPES_DOC, second])
    produce(kafka_bootstrap, topic, [(b"7", values[0]), (b"8", values[1]), (b"bad", b"{}")])
    cfg = {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "schema_registry": {"url": schema_registry.url},
        "pipelines": [{
            "name": "avro", "topics": [topic], "group_id": group_id, "format": "avro", "commit_interval_ms": 200,
            "batch": {"max_rows": 100, "max_latency_ms": 100},
            "sink": {"kind": "clickhouse", "url": chdb.url, "database": "avro", "table": "typed",
                     "order_by": ["id"], "columns": CH_COLUMNS},
            "dlq": {"kind": "postgres", "dsn": pg_dsn, "max_ratio": 1.0},
        }],
    }
    path = _migrate(tmp_path, cfg)
    _run(path, tmp_path)
    assert [(d["key"], d["error_class"]) for d in dlq_rows(pg_dsn)] == [(b"bad", "bad_magic_byte")]
    client = chdb.client()
    try:
        result = client.query("SELECT * FROM avro.typed FINAL ORDER BY id")
        rows = [dict(zip(result.column_names, r)) for r in result.result_rows]
    finally:
        chdb.close()
    assert [r["id"] for r in rows] == [7, 8]
    row = rows[0]
    assert row["small"] == -12 and row["label"] == TYPES_DOC["label"] and row["active"] is True
    assert row["score"] == 1e-300
    assert row["amount"] == Decimal("12345.67") and row["fixed_amount"] == Decimal("-98765.4321")
    assert row["at_ms"].replace(tzinfo=UTC) == TYPES_DOC["at_ms"]
    assert row["at_us"].replace(tzinfo=UTC) == TYPES_DOC["at_us"]
    assert row["day"] == dt.date(2026, 2, 28) and row["clock_us"] == "23:59:59.999999"
    assert row["ref"] == TYPES_DOC["ref"] and row["state"] == "PAID" and row["city"] == "Milano"
    assert row["tags"] == ["a", "b", "c"] and row["note"] == "hello" and row["maybe"] is None
    assert rows[1]["note"] is None and rows[1]["maybe"] == -5 and rows[1]["tags"] == []


def test_check_reports_subjects_and_the_columns_their_schemas_lack(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                   schema_registry):
    topic, missing = new_topic(partitions=1), new_topic(partitions=1)
    url = schema_registry.url
    schema_id = schema_registry.register(f"{topic}-value", json.dumps(EVOLVING[0]))
    v2 = schema_registry.register(f"{topic}-value", json.dumps(EVOLVING[2]))  # latest: legacy dropped
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"},
               "channel": {"type": "text"}, "nowhere": {"type": "text", "source": "$.no.such"}}

    def check(cfg: dict[str, Any]) -> Any:
        return run_ingest(["check", "-c", write_config(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)

    base = dict(bootstrap=kafka_bootstrap, topic=topic, group="g", dsn=pg_dsn, registry=url, table="orders",
                conflict_key=("order_id",))
    res = check(_config(**base, columns=columns))
    assert res.returncode == 0, res.stderr
    assert f"ok   pipeline avro: subject {topic}-value version 2 (schema id {v2})" in res.stdout
    assert "warn pipeline avro: column nowhere (source $.no.such) is not a field of" in res.stdout
    assert "column channel" not in res.stdout and schema_id != v2

    res = check(_config(**base, columns={**columns, "legacy": {"type": "text", "required": True}}))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "FAIL pipeline avro: column legacy (source $.legacy) is not a field of subject" in res.stderr
    assert "every record would be dead-lettered" in res.stderr

    res = check(_config(**{**base, "topic": missing}, columns=columns))
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"subject {missing}-value is not in the schema registry at {url}" in res.stderr

    # A typed key: its subject (<topic>-key) and the @key.$ columns are checked the same way.
    key_id = schema_registry.register(f"{topic}-key", KEY_SCHEMA)
    keyed = {**columns, "tenant": {"type": "text", "source": "@key.$.tenant"},
             "shop": {"type": "text", "source": "@key.$.shop", "required": True}}
    res = check(_config(**base, columns=keyed, key_format="avro"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"ok   pipeline avro: subject {topic}-key version 1 (schema id {key_id})" in res.stdout
    assert "FAIL pipeline avro: column shop (source @key.$.shop) is not a field of subject" in res.stderr
    assert "column tenant" not in res.stdout + res.stderr

    schema_registry.stop()
    res = check(_config(**base, columns=columns))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "schema registry at" in res.stderr and "Connection refused" in res.stderr


def test_a_bad_avro_schema_file_is_a_config_error_naming_the_field(tmp_path, kafka_bootstrap, pg_dsn):
    (tmp_path / "bad.avsc").write_text('{"type": "record", "name": "X", "fields": [{"name": "a", "type": "nope"}]}')
    for schema_file in (tmp_path / "bad.avsc", tmp_path / "absent.avsc"):
        cfg = _config(bootstrap=kafka_bootstrap, topic="t", group="g", dsn=pg_dsn, registry=None,
                      columns={"id": {"type": "bigint", "required": True}}, avro_schema=str(schema_file))
        res = run_ingest(["check", "-c", write_config(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "avro_schema" in res.stderr, res.stderr


KEY_SCHEMA = json.dumps({"type": "record", "name": "OrderKey", "namespace": "shop",
                         "fields": [{"name": "tenant", "type": "string"}, {"name": "id", "type": "long"}]})


@pytest.mark.parametrize("key_format", ["avro", "json"])
def test_columns_and_the_ordering_key_read_into_a_decoded_key(key_format, tmp_path, kafka_bootstrap, pg_dsn,
                                                              new_topic, group_id, schema_registry):
    """``@key.$.PATH`` with ``key_format``: the conflict key comes from the record key; records of one key
    written in order across lanes; a key that does not decode is poison (stage decode)."""
    topic = new_topic(partitions=2)
    url = schema_registry.url
    keys = [{"tenant": f"t{i % 3}", "id": i % 10} for i in range(60)]
    docs = [{"order_id": 0, "status": f"s{i}", "legacy": ""} for i in range(60)]
    if key_format == "avro":
        encoded_keys = avro_values(url, topic, KEY_SCHEMA, keys, field="key")
    else:
        encoded_keys = [json.dumps(k).encode() for k in keys]
    values = avro_values(url, topic, json.dumps(EVOLVING[0]), docs)
    records = [(k, v, i % 2) for i, (k, v) in enumerate(zip(encoded_keys, values))]
    records.append((b"\xff not a key", values[0], 0))
    produce(kafka_bootstrap, topic, records)
    columns = {"tenant": {"type": "text", "source": "@key.$.tenant", "required": True},
               "id": {"type": "bigint", "source": "@key.$.id", "required": True},
               "status": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=url, columns=columns, table="orders", conflict_key=("tenant", "id"),
                                      key_format=key_format, key="@key.$.id", lanes=3, dlq={"max_ratio": 1.0}))
    _run(path, tmp_path)
    rows = {(r["tenant"], r["id"]): r["status"] for r in _rows(pg_dsn, "SELECT * FROM orders")}
    expected: dict[tuple[str, int], str] = {}
    for partition in (0, 1):  # the last record of each key in its partition (a key lives in one partition here)
        for i in range(partition, 60, 2):
            expected[(keys[i]["tenant"], keys[i]["id"])] = f"s{i}"
    assert rows == expected
    dead = dlq_rows(pg_dsn)
    assert [(d["stage"], d["error_class"]) for d in dead] == [
        ("decode", "bad_magic_byte" if key_format == "avro" else "invalid_utf8")]
    assert "record key" in dead[0]["error_message"]


def test_schema_guids_in_headers_are_looked_up_by_guid(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                       schema_registry):
    """confluent-kafka's header_schema_id_serializer: the value is bare Avro, a ``__value_schema_id``
    header holds magic byte 1 + the schema's GUID."""
    topic = new_topic(partitions=1)
    encoded = avro_values_with_id_headers(schema_registry.url, topic, json.dumps(EVOLVING[0]),
                                          [{"order_id": i, "status": f"h{i}", "legacy": ""} for i in range(5)])
    assert all(h[0][0] == "__value_schema_id" and h[0][1][0] == 1 for _, h in encoded)
    produce(kafka_bootstrap, topic, [(str(i).encode(), v, None, h) for i, (v, h) in enumerate(encoded)])
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}
    _run(_migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                    registry=schema_registry.url, columns=columns, table="orders",
                                    conflict_key=("order_id",))), tmp_path)
    assert dlq_rows(pg_dsn) == []
    assert {r["order_id"]: r["status"] for r in _rows(pg_dsn, "SELECT * FROM orders")} == {
        i: f"h{i}" for i in range(5)}
    assert schema_registry.requests["schemas/guids"] == 1


def test_basic_auth_works_and_the_password_is_never_printed(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    password = "p@ss:w0rd %$ 'quoted'"
    registry = SchemaRegistryStandIn(user="ingest", password=password)
    try:
        topic = new_topic(partitions=1)
        values = avro_values(registry.url, topic, json.dumps(EVOLVING[0]),
                             [{"order_id": i, "status": "s", "legacy": ""} for i in range(3)],
                             client_conf={"basic.auth.user.info": f"ingest:{password}"})
        produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
        columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}

        def cfg(secret: str, group: str) -> dict[str, Any]:
            c = _config(bootstrap=kafka_bootstrap, topic=topic, group=group, dsn=pg_dsn, registry=None,
                        columns=columns, table="orders", conflict_key=("order_id",),
                        retry={"max_attempts": 2, "initial_backoff_ms": 50, "max_backoff_ms": 100})
            c["schema_registry"] = {"url": registry.url, "username": "ingest", "password": secret}
            return c

        res = _run(_migrate(tmp_path, cfg(password, group_id)), tmp_path)
        assert _rows(pg_dsn, "SELECT count(*) AS n FROM orders")[0]["n"] == 3
        wrong = password + "-wrong"
        path = write_config(tmp_path / "wrong", cfg(wrong, group_id + "-2"))
        failed = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0", "--log-level", "debug"],
                            timeout_s=120, log_dir=tmp_path)
        checked = run_ingest(["check", "-c", path], timeout_s=60, log_dir=tmp_path)
        assert failed.returncode == 1 and "HTTP 401" in failed.stderr, failed.stderr[-2000:]
        assert checked.returncode == 3 and "HTTP 401" in checked.stderr, checked.stderr[-2000:]
        for out in (res.stdout, res.stderr, failed.stdout, failed.stderr, checked.stdout, checked.stderr):
            assert password not in out and wrong not in out and "w0rd" not in out
        assert dlq_rows(pg_dsn) == []
    finally:
        registry.stop()


def test_registry_down_when_a_new_schema_appears_mid_run(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                         schema_registry):
    """The run is under way with v1 cached; the registry goes down; records of a new schema version
    arrive: they are held (partitions paused, nothing dead-lettered, nothing of them committed) until
    the registry is back, while the v1 records before them are written."""
    topic = new_topic(partitions=2)
    url = schema_registry.url
    v1 = avro_values(url, topic, json.dumps(EVOLVING[0]),
                     [{"order_id": i, "status": "v1", "legacy": ""} for i in range(200)])
    v2 = avro_values(url, topic, json.dumps(EVOLVING[1]),
                     [{"order_id": i, "status": "v2", "legacy": "", "channel": "app"} for i in range(200, 400)])
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(v1)])
    columns = {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"},
               "channel": {"type": "text"}}
    path = _migrate(tmp_path, _config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                      registry=url, columns=columns, table="orders", conflict_key=("order_id",),
                                      retry={"max_attempts": 0, "initial_backoff_ms": 100, "max_backoff_ms": 400}))
    proc = start_ingest(["run", "-c", path, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
    count = "SELECT count(*) AS n FROM orders"
    wait_until(lambda: _rows(pg_dsn, count)[0]["n"] == 200, 90, what="the v1 rows", proc=proc)
    schema_registry.stop()
    produce(kafka_bootstrap, topic, [(str(200 + i).encode(), v) for i, v in enumerate(v2)])
    wait_until(lambda: any(e.get("event") == "schema registry unavailable: holding records, partitions paused"
                           for e in log_events(proc)), 60, what="the hold", proc=proc)
    assert proc.poll() is None, proc.describe()
    assert _rows(pg_dsn, count)[0]["n"] == 200 and dlq_rows(pg_dsn) == []
    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    assert sum(committed.values()) <= 200, committed  # nothing of the held v2 records
    schema_registry.start()
    assert proc.wait(120) == 0, proc.describe()
    rows = {r["order_id"]: (r["status"], r["channel"]) for r in _rows(pg_dsn, "SELECT * FROM orders")}
    assert rows == {**{i: ("v1", None) for i in range(200)}, **{i: ("v2", "app") for i in range(200, 400)}}
    assert dlq_rows(pg_dsn) == []
