"""Avro and Protobuf through the Schema Registry on the columnar tier into ClickHouse (chDB: modern
ClickHouse in-process) against the row path, end to end: the real broker, the registry stand-in over HTTP.

The streams of the PostgreSQL differentials (``test_columnar_avro_pg.py``: two writer schemas
interleaved -- epoch milliseconds and doubles, then ``timestamp-micros`` and nullable ``decimal`` of a
finer scale than the column's --, a UUID for a text column, truncated datums, bytes left over, an
unknown schema id, no magic byte, garbage, an integer out of its column's range; and
``test_columnar_protobuf_pg.py``: proto3 zero values, optional fields and wrappers, enums, a
``Timestamp``, a uint64 beyond the signed range, the file's second message, the same hostile bytes),
plus Avro decimals and timestamps out of their ClickHouse column's range, run by ``ingest run`` with the
tier on (the default) and off into ``Decimal(P,S)``, ``DateTime64(p)``, ``Nullable``/``LowCardinality``
columns and columns with defaults: identical tables (read with FINAL, ``_version`` included: the same
record won each key), identical DLQ entries (partition, offset, stage, error class, message), offsets
committed at the log end by both, and the tier stated (``write_tier: columnar``) and taking records
(``columnar_records``), with one lane and two.
"""

from __future__ import annotations

import json
import struct
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from harness.kafka import produce
from pipeline_helpers import registry_runs_on_off
from test_columnar_avro_pg import UUIDS, V1, V2, _datum
from test_columnar_avro_pg import _stream as avro_stream
from test_columnar_protobuf_pg import _stream as protobuf_stream

pytestmark = pytest.mark.timeout(240)

AVRO_COLUMNS = {
    "id": {"type": "Int64"},  # neither Nullable nor defaulted: required
    "n": {"type": "Nullable(Int32)"},
    "kind": {"type": "LowCardinality(String)"},
    "amount": {"type": "Nullable(Decimal(9, 4))"},  # v1's doubles and v2's decimals of scale 5: rounded
    "ts": {"type": "DateTime64(6)"},  # v1's epoch milliseconds, v2's timestamp-micros
    "note": {"type": "Nullable(String)"},
    "channel": {"type": "String", "default": "none"},
}
PROTOBUF_COLUMNS = {
    "id": {"type": "Int64"},
    "status": {"type": "String"},
    "score": {"type": "Decimal(10, 2)"},  # doubles of three decimals: rounded
    "state": {"type": "LowCardinality(String)"},
    "at": {"type": "Nullable(DateTime64(3))", "default": "2025-06-01T12:00:00.250Z"},  # Timestamp; unset: default
    "maybe": {"type": "Int64", "default": -1},
    "nickname": {"type": "String", "default": "anon"},
    "big": {"type": "Decimal(20, 0)"},  # uint64 beyond the signed range
    "small": {"type": "Int16"},
}


def _avro_records(ids: dict[str, int]) -> list[tuple[bytes, bytes]]:
    """The PostgreSQL differential's stream, then v2 records whose decimal or timestamp is at or beyond
    the edge of its ClickHouse column: poison (out_of_range) or taken, as the row mapper says."""
    def v2(key: int, amount: Decimal | None, ts: datetime) -> tuple[bytes, bytes]:
        return str(key).encode(), b"\x00" + struct.pack(">I", ids["v2"]) + _datum(V2, {
            "id": key, "kind": "PAID", "ratio": 0.5, "note": None, "amount": amount, "ts": ts, "n": 1, "channel": "e"})

    utc = timezone.utc
    return avro_stream(ids) + [
        v2(1, Decimal("99999.99995"), datetime(2026, 1, 1, tzinfo=utc)),  # rounds to 100000: out of range
        v2(2, Decimal("-99999.99994"), datetime(2026, 1, 1, tzinfo=utc)),  # rounds to -99999.9999: taken
        v2(3, Decimal("0.00005"), datetime(1899, 12, 31, 23, 59, 59, tzinfo=utc)),  # before 1900: out of range
        v2(4, Decimal("-0.00005"), datetime(2299, 12, 31, 23, 59, 59, 999999, tzinfo=utc)),  # the last microsecond
    ]


#: one lane and two, each format once (a run pair takes ~20 s: group joins, idle ends, chDB start-ups)
@pytest.mark.parametrize(("fmt", "lanes"), [("avro", 1), ("protobuf", 2)])
def test_a_registry_run_on_the_columnar_tier_into_clickhouse_writes_and_dead_letters_what_the_row_path_does(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path, schema_registry, chdb, fmt, lanes):
    topic = new_topic(3)
    if fmt == "avro":
        ids = {name: schema_registry.register(f"{topic}-value", json.dumps(schema))
               for name, schema in (("v1", V1), ("v2", V2), ("uuids", UUIDS))}
        records, columns, keys, missing = _avro_records(ids), AVRO_COLUMNS, 700, set()
    else:  # the file's second message has no status, a required column here
        records, columns, keys = protobuf_stream(schema_registry.url, topic), PROTOBUF_COLUMNS, 300
        missing = {"missing_field"}
    assert produce(kafka_bootstrap, topic, records) == len(records)
    runs = registry_runs_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, schema_registry.url, fmt=fmt,
                                prefix=fmt[0] + "ch", columns=columns, delivery="at_least_once", lanes=lanes,
                                chdb=chdb)
    (rows_stats, rows, rows_dlq), (col_stats, cols, col_dlq) = runs
    assert len(rows) == keys
    assert cols == rows
    assert col_dlq == rows_dlq
    assert {r[3] for r in rows_dlq} == {"schema_mismatch", "unknown_schema", "bad_magic_byte", "out_of_range",
                                        *missing}
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq) > 30
    assert rows_stats["write_tier"] == "rows (columnar: false)" and rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar"
    assert len(records) // 2 <= col_stats["columnar_records"] <= col_stats["records_consumed"] == len(records), col_stats
