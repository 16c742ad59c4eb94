"""Avro through the Schema Registry on the columnar tier against the row path, end to end: the real
broker, the registry stand-in over HTTP, real PostgreSQL.

The same topic -- two writer schemas interleaved (a widened type, an added field with a default, a
removed one), updates of 700 keys, and hostile values: truncated datums, bytes left over, an unknown
schema id, no magic byte, garbage, values out of a column's range; decimals (nulls, half-way cases of
the column's scale, which PostgreSQL rounds) and timestamp-micros, which the tier stages; a few records
with a UUID for a text column, which it does not (their batches go by rows) -- run by ``ingest run`` with the tier on (the default) and
off: identical tables, identical DLQ entries (partition, offset, stage, error class, message),
offsets committed at the log end by both, and the tier stated (``write_tier: columnar``) and
actually taking the records (``columnar_records``).
"""

from __future__ import annotations

import io
import json
import struct
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from fastavro import parse_schema, schemaless_writer
from harness.kafka import produce
from pipeline_helpers import registry_runs_on_off

COMMON_FIELDS = [
    {"name": "id", "type": "long"},
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["NEW", "PAID", "SHIPPED"]}},
    {"name": "ratio", "type": "float"},
    {"name": "note", "type": ["null", "string"], "default": None},
]
#: epoch milliseconds and a double
V1 = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    *COMMON_FIELDS, {"name": "amount", "type": "double"}, {"name": "ts", "type": "long"},
    {"name": "n", "type": "int"}, {"name": "flag", "type": "boolean"}]}
#: the logical types: a nullable decimal of a finer scale than the column's, timestamp-micros; ``n``
#: widened, ``channel`` added with a default, ``flag`` removed
V2 = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    *COMMON_FIELDS,
    {"name": "amount", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 16, "scale": 5}]},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    {"name": "n", "type": "long"}, {"name": "channel", "type": "string", "default": "web"}]}
#: a logical type the tier does not stage (a UUID for a text column): its batches go by rows
UUIDS = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    {"name": "id", "type": "long"}, {"name": "kind", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

COLUMNS = {
    "id": {"type": "bigint", "required": True},
    "n": {"type": "integer"},
    "kind": {"type": "text"},
    "amount": {"type": "numeric(14,4)"},
    "ts": {"type": "timestamptz"},
    "ratio": {"type": "double precision"},
    "flag": {"type": "boolean"},
    "note": {"type": "text"},
    "channel": {"type": "text", "default": "none"},
}


def _datum(schema: dict, doc: dict) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(schema), doc)
    return buf.getvalue()


def _stream(ids: dict[str, int]) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(3000):
        key = i % 700
        common = {"id": key, "kind": ("NEW", "PAID", "SHIPPED")[i % 3], "ratio": i / 9,
                  "note": None if i % 4 else f"n\x01{i},\"q\""}
        if i % 3:
            value = b"\x00" + struct.pack(">I", ids["v1"]) + _datum(V1, {
                **common, "amount": i / 7, "ts": 1_764_460_800_000 + i, "n": i, "flag": i % 2 == 0})
        else:  # half-way cases of the column's scale (PostgreSQL rounds them), microseconds, nulls
            amount = None if i % 11 == 0 else Decimal(i * 125 - 4000) / 100000
            value = b"\x00" + struct.pack(">I", ids["v2"]) + _datum(V2, {
                **common, "amount": amount, "ts": EPOCH + timedelta(microseconds=1_764_460_800_000_001 * (i % 2) - i),
                "n": i, "channel": f"c{i % 5}"})
        if i % 97 == 5:
            value = value[:-3]  # truncated: schema_mismatch
        elif i % 131 == 7:
            value = value + b"\x02"  # a byte left over: schema_mismatch
        elif i % 151 == 9:
            value = b"\x00" + struct.pack(">I", 9999) + value[5:]  # unknown_schema
        elif i % 163 == 11:
            value = b"\x7b" + value[1:]  # no magic byte
        elif i % 173 == 13:
            value = b"\x00" + struct.pack(">I", ids["v1"]) + b"\xff\xff\xff"  # garbage
        elif i % 181 == 15:
            value = b"\x00" + struct.pack(">I", ids["v2"]) + _datum(V2, {
                **common, "amount": None, "ts": EPOCH, "n": 2**40, "channel": "x"})  # n out of range: poison
        elif i % 997 == 17:
            value = b"\x00" + struct.pack(">I", ids["uuids"]) + _datum(UUIDS, {
                "id": key, "kind": uuid.UUID(int=i), "ts": datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=timezone.utc)})
        out.append((str(key).encode(), value))
    return out


@pytest.mark.parametrize(("delivery", "lanes"), [("at_least_once", 1), ("exactly_once", 1), ("at_least_once", 2)])
def test_an_avro_run_on_the_columnar_tier_writes_and_dead_letters_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry, delivery, lanes):
    topic = new_topic(3)
    ids = {name: schema_registry.register(f"{topic}-value", json.dumps(schema))
           for name, schema in (("v1", V1), ("v2", V2), ("uuids", UUIDS))}
    records = _stream(ids)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    runs = registry_runs_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, fmt="avro",
                                prefix="a", columns=COLUMNS, delivery=delivery, lanes=lanes)
    (rows_stats, rows, rows_dlq), (col_stats, cols, col_dlq) = runs
    assert len(rows) == 700
    assert cols == rows
    assert col_dlq == rows_dlq
    assert {r[3] for r in rows_dlq} == {"schema_mismatch", "unknown_schema", "bad_magic_byte", "out_of_range"}
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq) > 60
    assert rows_stats["write_tier"] == "rows (columnar: false)" and rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar"
    # batches holding a UUID go by rows; the rest, poison, decimals and timestamps and all, are written columnar
    assert len(records) // 2 <= col_stats["columnar_records"] < col_stats["records_consumed"] == len(records), col_stats
    assert {r[8] for r in rows} >= {"none", "c0"}  # v1's missing field: the column's default; v2's value
