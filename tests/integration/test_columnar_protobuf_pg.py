"""Protobuf through the Schema Registry on the columnar tier against the row path, end to end: the real
broker, the registry stand-in over HTTP, real PostgreSQL.

The same topic -- ``shop.Order`` messages made by confluent-kafka's own ProtobufSerializer (updates of
300 keys; proto3 scalars at their zero value, optional fields and wrappers set and unset, enums, a
Timestamp, a uint64 beyond the signed range) and hostile values: truncated messages, garbage after
the indexes, an unknown schema id, no magic byte, message indexes naming the file's second message
(``Refund``: no ``status``), values out of a column's range, a ``bytes`` value the row mapper turns
into text -- run by ``ingest run`` with the tier on (the default) and off (``columnar: false``), at
least once and exactly once: identical tables, identical DLQ entries (partition, offset, stage,
error class, message), offsets committed at the log end by both, and the tier stated
(``write_tier: columnar``) and actually taking records (``columnar_records``).
"""

from __future__ import annotations

import datetime as dt
import struct

import pytest
from harness.kafka import produce
from harness.proto_messages import classes
from harness.serde import protobuf_values
from pipeline_helpers import registry_runs_on_off

COLUMNS = {
    "id": {"type": "bigint", "required": True},
    "status": {"type": "text"},
    "active": {"type": "boolean"},
    "score": {"type": "double precision"},
    "ratio": {"type": "double precision"},
    "state": {"type": "text"},
    "at": {"type": "timestamptz"},
    "maybe": {"type": "bigint", "default": -1},
    "nickname": {"type": "text", "default": "anon"},
    "big": {"type": "numeric(20,0)"},
    "small": {"type": "smallint"},
}


def _stream(url: str, topic: str) -> list[tuple[bytes, bytes]]:
    order, refund = classes()
    messages = []
    for i in range(1500):
        m = order(id=i % 300, status="" if i % 7 == 0 else f"s{i}", active=i % 2 == 0, score=i / 8,
                  ratio=i / 3, state=i % 3, big=2**63 + i if i % 5 == 0 else i, small=i % 1000)
        if i % 4:
            m.at.FromDatetime(dt.datetime(2026, 1, 1) + dt.timedelta(milliseconds=i * 1001))
        if i % 6 == 0:
            m.maybe.value = i
        if i % 9 == 0:
            m.nickname = f"nick{i}"
        if i % 211 == 5:
            m.small = 40_000  # beyond smallint: out_of_range (poison) in both
        messages.append(m)
    values = protobuf_values(url, topic, messages)
    refund_value = protobuf_values(url, topic + "-refunds", [refund(id=7, reason="the file's second message")])[0]
    out = []
    for i, value in enumerate(values):
        if i % 97 == 5:
            value = value[:-2]  # truncated: schema_mismatch
        elif i % 131 == 7:
            value = value[:6] + b"\xff\xff\xff"  # garbage after the indexes
        elif i % 151 == 9:
            value = b"\x00" + struct.pack(">I", 9999) + value[5:]  # unknown_schema
        elif i % 163 == 11:
            value = b"\x7b" + value[1:]  # no magic byte
        elif i % 173 == 13:  # indexes [1]: a Refund -- no status, id 7 (keyed as id 7: its partition's order)
            out.append((b"7", refund_value))
            continue
        out.append((str(i % 300).encode(), value))
    return out


@pytest.mark.parametrize(("delivery", "lanes"), [("at_least_once", 1), ("exactly_once", 1), ("at_least_once", 2)])
def test_a_protobuf_run_on_the_columnar_tier_writes_and_dead_letters_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry, delivery, lanes):
    topic = new_topic(3)
    records = _stream(schema_registry.url, topic)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    runs = registry_runs_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, fmt="protobuf",
                                prefix="p", columns=COLUMNS, delivery=delivery, lanes=lanes)
    (rows_stats, rows, rows_dlq), (col_stats, cols, col_dlq) = runs
    assert len(rows) == 300
    assert cols == rows
    assert col_dlq == rows_dlq
    assert {r[3] for r in rows_dlq} == {"schema_mismatch", "unknown_schema", "bad_magic_byte", "out_of_range"}
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq) > 30
    assert rows_stats["write_tier"] == "rows (columnar: false)" and rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar"
    assert len(records) // 2 <= col_stats["columnar_records"] <= col_stats["records_consumed"] == len(records), col_stats
    # proto3 zero values are values; unset optional fields and wrappers take the column's default
    by_id = {r[0]: r for r in rows}
    assert any(r[1] == "" for r in rows) and {r[8] for r in rows} >= {"anon"} and -1 in {r[7] for r in rows}
    assert by_id[7][1] is None or by_id[7][1].startswith("s")  # a Refund or an Order, whichever came last
