"""``format: protobuf`` end to end: messages made by confluent-kafka's own ProtobufSerializer (classes built at
run time from descriptors: harness/proto_messages.py) against the Schema Registry stand-in, with a referenced
``.proto`` and the well-known types, on the real broker, into real PostgreSQL and chDB."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from formats_helpers import format_config, migrate, run_until_idle
from harness import run_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from harness.proto_messages import classes
from harness.serde import protobuf_values
from pipeline_helpers import dlq_rows

UTC = dt.timezone.utc
AT = dt.datetime(2026, 11, 30, 10, 34, 56, 789000)

PG = {"id": {"type": "bigint", "required": True}, "status": {"type": "text"}, "active": {"type": "boolean"},
      "score": {"type": "double precision"}, "blob": {"type": "bytea"}, "state": {"type": "text"},
      "at": {"type": "timestamptz"}, "wait": {"type": "interval"}, "maybe": {"type": "bigint"},
      "note": {"type": "text", "default": "no note"}, "city": {"type": "text", "source": "$.address.city"},
      "zip": {"type": "text", "source": "$.address.zip"}, "second_tag": {"type": "text", "source": "$.tags[1]"},
      "color": {"type": "bigint", "source": "$.attrs.color"}, "nickname": {"type": "text"},
      "big": {"type": "numeric(20,0)"}, "small": {"type": "integer"}, "extra": {"type": "jsonb"},
      "first_sku": {"type": "text", "source": "$.lines[0].sku"}}
CH = {"id": {"type": "Int64"}, "status": {"type": "String", "default": "-"},
      "active": {"type": "Bool", "default": False}, "score": {"type": "Float64", "default": 0},
      "state": {"type": "LowCardinality(String)", "default": "-"}, "at": {"type": "Nullable(DateTime64(3))"},
      "maybe": {"type": "Nullable(Int64)"}, "note": {"type": "String", "default": "no note"},
      "city": {"type": "String", "source": "$.address.city", "default": ""},
      "second_tag": {"type": "Nullable(String)", "source": "$.tags[1]"}, "tags": {"type": "Array(String)"},
      "nickname": {"type": "Nullable(String)"}, "big": {"type": "UInt64", "default": 0},
      "small": {"type": "Int32", "default": 0}}
# (ClickHouse columns that are not Nullable need a default: the refund message has none of those fields.)


def _messages() -> tuple[list[Any], list[Any]]:
    order, refund = classes()
    full = order(id=7, status="paid", active=True, score=0.25, blob=b"\x00\x01bytes", state=1, tags=["a", "b"],
                 nickname="nick", big=2**63 + 5, small=-3)
    full.at.FromDatetime(AT)
    full.wait.FromSeconds(90)
    full.maybe.value = 0  # a wrapper has presence: 0 is a value, not "absent"
    full.note.value = "hello"
    full.address.city = "Milano"
    full.attrs["color"] = 3
    full.extra.update({"k": [1, "x"]})
    full.lines.add(sku="s1", qty=2)
    empty = order(id=8)  # every proto3 scalar at its zero value; no optional field set
    return [full, empty], [refund(id=9, reason="second message of the file")]


@pytest.mark.parametrize("sink", ["postgres", "clickhouse"])
def test_protobuf_messages_round_trip(sink, tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id, schema_registry,
                                      chdb):
    topic = new_topic(partitions=1)
    orders, refunds = _messages()
    values = protobuf_values(schema_registry.url, topic, orders)
    refund = protobuf_values(schema_registry.url, topic + "-refunds", refunds)[0]
    assert values[0][5] == 0 and refund[5:7] == b"\x02\x02"  # message indexes [0] and [1], as the serializer wrote
    records = [(b"7", values[0]), (b"8", values[1]), (b"refund", refund),
               (b"broken", values[0][:6] + b"\xff\xff\xff"), (b"json", b'{"id": 1}')]
    produce(kafka_bootstrap, topic, records)
    sink_cfg: dict[str, Any] = (
        {"kind": "postgres", "dsn": pg_dsn, "table": "orders", "conflict_key": ["id"], "columns": PG}
        if sink == "postgres" else
        {"kind": "clickhouse", "url": chdb.url, "database": "pb", "table": "orders", "order_by": ["id"],
         "columns": CH})
    cfg = format_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, fmt="protobuf", sink=sink_cfg,
                        registry=schema_registry.url, name="pb", dlq={"kind": "postgres", "dsn": pg_dsn,
                                                                          "max_ratio": 1.0})
    run_until_idle(migrate(tmp_path, cfg), tmp_path)
    columns = list(PG if sink == "postgres" else CH)
    if sink == "postgres":
        with psycopg.connect(pg_dsn) as conn:
            cur = conn.execute(f"SELECT {', '.join(columns)} FROM orders ORDER BY id")
            rows = [dict(zip(columns, r)) for r in cur.fetchall()]
    else:
        client = chdb.client()
        try:
            rows = [dict(zip(columns, r)) for r in client.query(
                f"SELECT {', '.join(columns)} FROM pb.orders FINAL ORDER BY id").result_rows]
        finally:
            chdb.close()
    # The refund (the file's second message) has id 9 and none of the other fields.
    assert [r["id"] for r in rows] == [7, 8, 9], [(d["key"], d["error_message"]) for d in dlq_rows(pg_dsn)]
    full, empty, second = rows
    assert full["status"] == "paid" and full["active"] is True and full["score"] == 0.25
    assert full["state"] == "PAID" and full["at"].replace(tzinfo=UTC) == AT.replace(tzinfo=UTC)
    assert full["maybe"] == 0 and full["note"] == "hello" and full["city"] == "Milano"
    assert full["second_tag"] == "b" and full["nickname"] == "nick" and full["big"] == 2**63 + 5
    assert full["small"] == -3
    # No presence: zero values are there. Presence, unset: missing (NULL or the column's default).
    assert empty["status"] == "" and empty["active"] is False and empty["state"] == "NEW" and empty["small"] == 0
    assert empty["maybe"] is None and empty["note"] == "no note" and empty["nickname"] is None
    assert empty["second_tag"] is None
    assert second["status"] == (None if sink == "postgres" else "-")
    if sink == "postgres":
        assert bytes(full["blob"]) == b"\x00\x01bytes" and full["wait"] == dt.timedelta(seconds=90)
        assert full["zip"] is None and full["color"] == 3 and full["extra"] == {"k": [1, "x"]}
        assert full["first_sku"] == "s1" and empty["city"] is None and empty["first_sku"] is None
    else:
        assert full["tags"] == ["a", "b"] and empty["tags"] == [] and empty["city"] == ""
    dead = {d["key"].decode(): (d["stage"], d["error_class"]) for d in dlq_rows(pg_dsn)}
    assert dead == {"broken": ("decode", "schema_mismatch"), "json": ("decode", "bad_magic_byte")}


def test_check_compares_columns_with_the_latest_protobuf_schema(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                                schema_registry):
    topic = new_topic(partitions=1)
    orders, _ = _messages()
    protobuf_values(schema_registry.url, topic, orders[:1])
    cfg = {"kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
           "schema_registry": {"url": schema_registry.url},
           "pipelines": [{"name": "pb", "topics": [topic], "format": "protobuf",
                          "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "orders", "conflict_key": ["id"],
                                   "columns": {**PG, "gone": {"type": "text", "required": True},
                                               "nested_gone": {"type": "text", "source": "$.address.street"}}}}]}
    res = run_ingest(["check", "-c", write_config(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"ok   pipeline pb: subject {topic}-value version 1" in res.stdout
    assert "FAIL pipeline pb: column gone (source $.gone) is not a field of subject" in res.stderr
    assert "warn pipeline pb: column nested_gone (source $.address.street)" in res.stdout
    for present in ("city", "color", "second_tag", "first_sku", "extra"):
        assert f"column {present} " not in res.stdout + res.stderr
