"""Debezium change events in the registry formats (``envelope: debezium`` with ``format: avro``,
``json_schema`` and ``protobuf``) on the columnar tier against the row path, end to end: the real broker,
the registry stand-in over HTTP, real PostgreSQL (issue #38 item 1).

Avro: the simulated source table's stream (``harness.cdc_source``: creates, updates, deletes with and
without a ``before`` image, their tombstones, key changes, short-lived rows) as Debezium's Avro converter
writes it -- the ``Envelope`` record of test_cdc_formats.py with nullable ``before``/``after`` records,
Avro keys -- in two writer schemas interleaved (V2: a column added, ``qty`` widened to ``long``, decimals
of a finer scale than the column's, which PostgreSQL rounds, ``timestamp-micros`` instead of
``timestamp-millis``, a ``date`` no column reads), with hostile records mixed in: truncated values, a byte
left over, an unknown schema id, no magic byte, garbage, a value out of a column's range, a NUL, an op
Debezium never writes, a truncate, a delete whose key does not decode, a delete without its version.
Protobuf: the same events as test_cdc_formats.py's ``Envelope`` message (Timestamps, decimal text, unset
images), JSON keys. JSON Schema: test_columnar_cdc_pg.py's schemaless stream behind the wire-format
prefix, with records the decoder refuses before any JSON is read. Each run by ``ingest run`` with the tier
on and off: the same table and tombstone table, the same DLQ entries (partition, offset, stage, error
class, message), offsets committed at the log end by both, the tier stated (``write_tier: columnar``)
and taking most records (``columnar_records``). Hard and soft deletes, lanes 1 and 2, exactly once.
"""

from __future__ import annotations

import json
import struct
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import orjson
import pytest
from harness.cdc_source import SourceTable, partition_of, produce_stream
from pipeline_helpers import registry_runs_on_off
from test_cdc_formats import JSON_SCHEMA, KEY_SCHEMA, VALUE_SCHEMA, Source
from test_cdc_formats import _encode_protobuf as encode_protobuf
from test_columnar_avro_pg import _datum as avro_datum
from test_columnar_cdc_pg import COLUMNS as JSON_COLUMNS
from test_columnar_cdc_pg import PARTITIONS, assert_same_changes, read_changes
from test_columnar_cdc_pg import _envelope as json_envelope
from test_columnar_cdc_pg import _stream as json_stream

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _envelope_schema(value_fields: list[dict[str, Any]]) -> dict[str, Any]:
    """test_cdc_formats.py's Debezium ``Envelope`` with these fields in its ``Value`` record."""
    schema = json.loads(VALUE_SCHEMA)
    schema["fields"][0]["type"][1]["fields"] = value_fields
    return schema


def _nullable(name: str, avro_type: Any) -> dict[str, Any]:
    return {"name": name, "type": ["null", avro_type], "default": None}


def _decimal(precision: int, scale: int) -> dict[str, Any]:
    return {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale,
            "connect.name": "org.apache.kafka.connect.data.Decimal"}


#: time.precision.mode=connect: timestamp-millis
V1 = _envelope_schema([
    {"name": "id", "type": "long"}, _nullable("name", "string"), _nullable("price", _decimal(12, 2)),
    _nullable("qty", "int"), _nullable("updated_at", {"type": "long", "logicalType": "timestamp-millis"})])
#: ``note`` and ``fee`` added (a decimal of scale 8: fastavro's ``Decimal('0E-8')``, ``Decimal('1E-8')``),
#: ``qty`` widened, ``price`` of a finer scale, microseconds, a date no column reads
V2 = _envelope_schema([
    {"name": "id", "type": "long"}, _nullable("name", "string"), _nullable("price", _decimal(14, 4)),
    _nullable("qty", "long"), _nullable("updated_at", {"type": "long", "logicalType": "timestamp-micros"}),
    _nullable("note", "string"), _nullable("fee", _decimal(20, 8)),
    _nullable("born", {"type": "int", "logicalType": "date"})])
SCHEMAS = {"v1": V1, "v2": V2, "key": json.loads(KEY_SCHEMA)}

AVRO_COLUMNS = {
    "id": {"type": "bigint"},
    "name": {"type": "text"},
    "price": {"type": "numeric(12,2)"},
    "qty": {"type": "integer"},
    "updated_at": {"type": "timestamptz"},
    "note": {"type": "text"},
    "fee": {"type": "numeric(20,8)"},
    "lsn": {"type": "bigint", "source": "@source.lsn"},
}
AVRO_SELECT = "id, name, price::text, qty, updated_at::text, note, fee::text, lsn"
PROTOBUF_COLUMNS = {name: AVRO_COLUMNS[name] for name in ("id", "name", "price", "updated_at", "lsn")}
PROTOBUF_SELECT = "id, name, price::text, updated_at::text, lsn"
JSON_SELECT = "id, name, price::text, qty, updated_at::text, lsn"


def _framed(schema_id: int, schema: str, doc: dict[str, Any]) -> bytes:
    """``doc`` in the wire format: magic byte, ``schema_id``, the Avro datum of ``SCHEMAS[schema]``."""
    return b"\x00" + struct.pack(">I", schema_id) + avro_datum(SCHEMAS[schema], doc)


def _value(image: dict[str, Any] | None) -> dict[str, Any] | None:
    """A row image of the schemaless JSON stream (decimal text, epoch milliseconds) with Python values, as the
    registry formats carry them (Decimal, aware datetime)."""
    if image is None:
        return None
    price, ms = image.get("price"), image.get("updated_at")
    return {"id": image["id"], "name": image.get("name"), "qty": image.get("qty"),
            "price": None if price is None else Decimal(price),
            "updated_at": None if ms is None else EPOCH + timedelta(milliseconds=ms)}


def _v2(image: dict[str, Any] | None, salt: int) -> dict[str, Any] | None:
    """``image`` as V2's ``Value``, its values varied by ``salt`` (sub-cent digits, microseconds, new fields)."""
    if image is None:
        return None
    out = dict(image)
    if out["price"] is not None and abs(out["price"]) < 10**9:
        out["price"] += Decimal(salt % 100).scaleb(-4)  # half-way cases of the column's scale among them
    if out["updated_at"] is not None:
        out["updated_at"] += timedelta(microseconds=salt % 1000)
    out["note"] = None if salt % 5 == 0 else f"note {salt % 13}"
    out["fee"] = Decimal(salt % 7 // 2 * salt).scaleb(-8)  # 0E-8 for every third or so
    out["born"] = date(2000, 1, 1) + timedelta(days=salt % 9000)
    return out


def _event(op: str, before: Any, after: Any, lsn: int | None) -> dict[str, Any]:
    """A hostile event's envelope (test_cdc_formats.py's, its ``source.lsn`` set to ``lsn``)."""
    envelope = Source.envelope(op, before, after, 0)
    envelope["source"]["lsn"] = lsn
    return envelope


#: An event of the stream, format-neutral: (key id, envelope with Python values -- None: a tombstone --,
#: partition, headers, how its encoded record is spoiled: one of SPOILED's keys, ``key``, or None)
Event = tuple[int, dict[str, Any] | None, int, Any, str | None]
#: how an encoded value is spoiled
SPOILED = {
    "truncated": lambda v: v[:-3],  # schema_mismatch
    "extra": lambda v: v + b"\x02",  # a byte left over: schema_mismatch
    "unknown": lambda v: b"\x00" + struct.pack(">I", 9999) + v[5:],  # unknown_schema
    "magic": lambda v: b"\x7b" + v[1:],  # no magic byte: bad_magic_byte
    "garbage": lambda v: v[:5] + b"\xff\xff\xff",  # schema_mismatch
}


def _events() -> list[Event]:
    """About 2400 events over 250 keys (see the module docstring), each hostile one in its key's partition."""
    source = SourceTable(39, keys=250, partitions=PARTITIONS, delete_frac=0.2, schemas=False, encoding="string",
                         rekey_frac=0.02, null_before_frac=0.05, short_lived_frac=0.01)
    out: list[Event] = []
    for i, (key, value, part, headers) in enumerate(source.events(2000)):
        event = None if value is None else orjson.loads(value)
        if event is not None:
            event = {**event, "before": _value(event["before"]), "after": _value(event["after"])}
        out.append((orjson.loads(key)["id"], event, part, headers, None))
        key_id = 10_000 + i
        row = {"id": key_id, "name": "h", "price": None, "qty": None, "updated_at": None}
        spoiled = next((how for how, every in (("truncated", 97), ("extra", 113), ("unknown", 101), ("magic", 103),
                                               ("garbage", 107), ("key", 79)) if i % every == 3), None)
        if spoiled == "key":  # a delete without a before image whose key does not decode: poison
            hostile = _event("d", None, None, 5 + i)
        elif spoiled is not None:
            hostile = _event("c", None, row, 5 + i)
        elif i % 89 == 11:
            hostile = _event("u", None, {**row, "qty": 2**40}, 5 + i)  # out of range for the integer column
        elif i % 71 == 13:
            hostile = _event("c", None, {**row, "name": "nul\x00"}, 5 + i)  # NUL: poison
        elif i % 109 == 15:
            hostile = _event("x", None, row, 5 + i)  # an op Debezium never writes
        elif i % 211 == 17:
            hostile = _event("t", None, None, 5 + i)  # a truncate (ignored by default)
        elif i == 777:
            hostile = _event("d", row, None, None)  # a delete without its version (missing_field)
        else:
            continue
        out.append((key_id, hostile, partition_of(key_id, PARTITIONS), None, spoiled))
    return out


def _spoiled(how: str | None, key: bytes, value: bytes | None) -> tuple[bytes, bytes | None]:
    if how == "key":
        return b"not a key", value
    return key, value if how is None or value is None else SPOILED[how](value)


def _avro_stream(ids: dict[str, int]) -> list[tuple]:
    """The events as Debezium's Avro converter writes them: V2 for every third (and where ``qty`` needs a
    ``long``), V1 for the others; keys in Avro."""
    out = []
    for i, (key_id, event, part, headers, how) in enumerate(_events()):
        value = None
        if event is not None:
            version = "v2" if i % 3 == 0 or (event["after"] or {}).get("qty") == 2**40 else "v1"
            if version == "v2":
                event = {**event, "before": _v2(event["before"], i), "after": _v2(event["after"], i)}
            value = _framed(ids[version], version, event)
        out.append((*_spoiled(how, _framed(ids["key"], "key", {"id": key_id}), value), part, headers))
    return out


def _protobuf_stream(url: str, topic: str) -> list[tuple]:
    """The events as Protobuf (test_cdc_formats.py's ``Envelope``: no ``qty``; a delete needs its version),
    keys in JSON."""
    events = [e for e in _events() if e[1] is None or e[1]["source"]["lsn"] is not None]
    encoded = encode_protobuf(url, topic, [(key_id, event) for key_id, event, *_ in events])
    return [(*_spoiled(how, key, value), part, headers)
            for (key, value), (_, _, part, headers, how) in zip(encoded, events, strict=True)]


def _json_schema_stream(schema_id: int) -> list[tuple]:
    """test_columnar_cdc_pg.py's schemaless stream, its values behind the wire-format prefix of ``schema_id``,
    and records of keys of their own the decoder refuses before any JSON is read: no prefix, an unknown
    schema id (spoiling the stream's own events instead would leave a key a delete after a delete, whose
    stored version by rows depends on the batch boundaries: a soft delete leaves a deleted row as it is)."""
    prefix = b"\x00" + struct.pack(">I", schema_id)
    out = []
    for i, (key, value, part, headers) in enumerate(json_stream(False)):
        out.append((key, None if value is None else prefix + value, part, headers))
        if i % 113 == 1 or i % 127 == 2:
            key_id = 20_000 + i
            value = json_envelope("c", None, {"id": key_id}, 5 + i, False)
            if i % 113 != 1:  # else no prefix: bad_magic_byte
                value = b"\x00" + struct.pack(">I", 9999) + value  # unknown_schema
            out.append((orjson.dumps({"id": key_id}), value, partition_of(key_id, PARTITIONS), None))
    return out


def _runs(tmp_path: Any, kafka_bootstrap: str, topic: str, pg_dsn: str, registry_url: str, fmt: str,
          columns: dict[str, Any], select: str, mode: str, delivery: str, lanes: int, **pipeline: Any) -> list[tuple]:
    """The stream on ``topic`` by rows and on the tier: per run ``(stats, rows, tombstones, DLQ rows)``."""
    runs = registry_runs_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, registry_url, fmt=fmt, prefix=f"cdc{mode}",
                                columns=columns, delivery=delivery, lanes=lanes, sink={"version_column": "lsn"},
                                read=lambda conn, name: read_changes(conn, name, select, mode),
                                envelope="debezium", deletes={"mode": mode}, **pipeline)
    return [(stats, *changes, dlq) for stats, changes, dlq in runs]


@pytest.mark.parametrize(("lanes", "mode", "delivery"), [(2, "hard", "at_least_once"), (1, "soft", "exactly_once")])
def test_an_avro_cdc_run_on_the_columnar_tier_writes_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry, lanes, mode, delivery):
    topic = new_topic(PARTITIONS)
    ids = {name: schema_registry.register(f"{topic}-value", json.dumps(schema)) for name, schema in (("v1", V1),
                                                                                                    ("v2", V2))}
    ids["key"] = schema_registry.register(f"{topic}-key", KEY_SCHEMA)
    records = _avro_stream(ids)
    assert produce_stream(kafka_bootstrap, topic, records) == len(records)
    by_rows, by_cols = _runs(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, "avro", AVRO_COLUMNS,
                             AVRO_SELECT, mode, delivery, lanes, key_format="avro")
    assert_same_changes(by_rows, by_cols, mode, len(records))
    rows, dlq = by_rows[1], by_rows[3]
    assert {r[3] for r in dlq} == {"schema_mismatch", "unknown_schema", "bad_magic_byte", "out_of_range",
                                   "invalid_value", "not_a_change_event", "missing_field"}, {r[3] for r in dlq}
    assert {r[5] for r in rows} > {None} and {r[6] for r in rows} >= {"0.00000000", None}  # V2's added columns


def test_a_json_schema_cdc_run_on_the_columnar_tier_writes_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry):
    """Soft deletes, two lanes: each event routed by its row's key read after the prefix."""
    topic = new_topic(PARTITIONS)
    records = _json_schema_stream(schema_registry.register(f"{topic}-value", JSON_SCHEMA, "JSON"))
    assert produce_stream(kafka_bootstrap, topic, records) == len(records)
    by_rows, by_cols = _runs(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, "json_schema",
                             JSON_COLUMNS, JSON_SELECT, "soft", "at_least_once", 2)
    assert_same_changes(by_rows, by_cols, "soft", len(records))
    assert {"bad_magic_byte", "unknown_schema", "invalid_json"} <= {r[3] for r in by_rows[3]}


def test_a_protobuf_cdc_run_on_the_columnar_tier_writes_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry):
    """Hard deletes, one lane, at least once: Protobuf envelopes (Timestamps, decimal text, unset images)."""
    topic = new_topic(PARTITIONS)
    records = _protobuf_stream(schema_registry.url, topic)
    assert produce_stream(kafka_bootstrap, topic, records) == len(records)
    by_rows, by_cols = _runs(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, "protobuf",
                             PROTOBUF_COLUMNS, PROTOBUF_SELECT, "hard", "at_least_once", 1)
    assert_same_changes(by_rows, by_cols, "hard", len(records))
    assert {"schema_mismatch", "unknown_schema", "bad_magic_byte", "invalid_value", "not_a_change_event",
            "invalid_json"} <= {r[3] for r in by_rows[3]}, {r[3] for r in by_rows[3]}


def test_a_decimal_listed_as_its_plain_digits_is_the_row_paths_number_in_postgresql(pg_dsn):
    """``decimal_text``: PostgreSQL reads the text the change plan stages as the very number (and scale) it
    reads the row path's Decimal as, unconstrained and in a ``numeric(20,8)`` column (which rounds both)."""
    import psycopg
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ingest.cdc.columnar import decimal_text

    with psycopg.connect(pg_dsn, autocommit=True) as conn:

        @settings(max_examples=200, deadline=None)
        @given(st.integers(-10**30, 10**30), st.integers(-40, 40))
        def check(unscaled: int, exponent: int) -> None:
            value = Decimal(unscaled).scaleb(exponent)
            text = decimal_text(value)
            assert "E" not in text and "e" not in text, text
            typed = "numeric(20,8)" if abs(value) < 10**11 else "numeric"  # else beyond numeric(20,8)
            query = f"SELECT %s::numeric::text, %s::{typed}::text"
            assert conn.execute(query, (text, text)).fetchone() == conn.execute(query, (value, value)).fetchone()

        check()
