"""Every supported PostgreSQL column type round-trips through ``ingest run`` (binary COPY stage → upsert).

One record per write method; the row read back must equal what the record
says, type by type, so a wrong binary wire format or a lossy coercion fails here.
"""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from decimal import Decimal

import orjson
import psycopg
import pytest
from harness import run_ingest, write_config
from harness.kafka import produce

COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "small": {"type": "smallint"},
    "medium": {"type": "integer"},
    "amount": {"type": "numeric(12,2)"},
    "ratio": {"type": "real"},
    "score": {"type": "double precision"},
    "label": {"type": "text"},
    "code": {"type": "varchar(8)"},
    "active": {"type": "boolean"},
    "at": {"type": "timestamptz"},
    "at_ms": {"type": "timestamptz", "source": "$.at_ms"},
    "local_at": {"type": "timestamp"},
    "day": {"type": "date"},
    "doc": {"type": "jsonb"},
    "doc_text": {"type": "json"},
    "ref": {"type": "uuid"},
    "blob": {"type": "bytea"},
    "kafka_key": {"type": "text", "source": "@key"},
    "kafka_offset": {"type": "bigint", "source": "@offset"},
}

RECORD = {
    "id": 7, "small": -12, "medium": 2_000_000_000, "amount": "12345.67", "ratio": 0.5, "score": 1e-300,
    "label": "naïve — ünïcødé ✓\ttab", "code": "ABCDEFGH", "active": True,
    "at": "2026-11-30T12:34:56.789+02:00", "at_ms": 1764460800123, "local_at": "2026-11-30T01:02:03",
    "day": "2026-02-28", "doc": {"a": [1, 2, {"b": None}], "s": "x\"y"}, "doc_text": [1, "two"],
    "ref": "8c7d1a2e-4f3b-4c5d-9e8f-0a1b2c3d4e5f", "blob": base64.b64encode(b"\x00\x01\xffbytes").decode(),
}


@pytest.mark.parametrize("write_method", ["copy", "values"])
def test_every_type_round_trips(write_method, tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=1)
    produce(kafka_bootstrap, topic, [(b"k-7", orjson.dumps(RECORD))])
    cfg = {
        "kafka": {"bootstrap_servers": kafka_bootstrap,
                  "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": "types", "topics": [topic], "group_id": group_id,
            "batch": {"max_rows": 10, "max_latency_ms": 100},
            "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "typed", "conflict_key": ["id"],
                     "write_method": write_method, "columns": COLUMNS},
        }],
    }
    path = write_config(tmp_path, cfg)
    assert run_ingest(["migrate", "-c", path], timeout_s=60).returncode == 0
    res = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0"], timeout_s=90)
    assert res.returncode == 0, res.stderr[-2000:]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM ingest_dlq").fetchone()[0] == 0
        cur = conn.execute("SELECT * FROM typed")
        names = [d.name for d in cur.description]
        row = dict(zip(names, cur.fetchone()))
    utc = dt.timezone.utc
    assert row["id"] == 7 and row["small"] == -12 and row["medium"] == 2_000_000_000
    assert row["amount"] == Decimal("12345.67")
    assert row["ratio"] == 0.5 and row["score"] == 1e-300
    assert row["label"] == RECORD["label"] and row["code"] == "ABCDEFGH" and row["active"] is True
    assert row["at"] == dt.datetime(2026, 11, 30, 10, 34, 56, 789000, tzinfo=utc)
    assert row["at_ms"] == dt.datetime.fromtimestamp(1764460800.123, tz=utc)
    assert row["local_at"] == dt.datetime(2026, 11, 30, 1, 2, 3)
    assert row["day"] == dt.date(2026, 2, 28)
    assert row["doc"] == RECORD["doc"] and row["doc_text"] == RECORD["doc_text"]
    assert row["ref"] == uuid.UUID(RECORD["ref"])
    assert bytes(row["blob"]) == b"\x00\x01\xffbytes"
    assert row["kafka_key"] == "k-7" and row["kafka_offset"] == 0
