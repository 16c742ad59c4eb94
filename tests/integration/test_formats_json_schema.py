"""``format: json_schema`` end to end: records made by confluent-kafka's own JSONSerializer against the
Schema Registry stand-in, on the real broker, into real PostgreSQL and chDB: types, two schema versions
in one batch, each decode poison class, and ``check``."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from formats_helpers import format_config, migrate, run_until_idle
from harness import run_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from harness.serde import json_schema_values
from pipeline_helpers import dlq_rows

V1 = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Order", "type": "object",
      "properties": {"id": {"type": "integer"}, "status": {"type": "string"}, "amount": {"type": "number"},
                     "at": {"type": "string", "format": "date-time"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}},
                     "address": {"type": "object", "properties": {"city": {"type": "string"}}}},
      "required": ["id"]}
V2 = {**V1, "properties": {**V1["properties"], "channel": {"type": "string"}}}

PG = {"id": {"type": "bigint", "required": True}, "status": {"type": "text"}, "amount": {"type": "numeric(12,2)"},
      "at": {"type": "timestamptz"}, "second_tag": {"type": "text", "source": "$.tags[1]"},
      "city": {"type": "text", "source": "$.address.city"}, "channel": {"type": "text", "default": "none"}}
CH = {"id": {"type": "Int64"}, "status": {"type": "String"}, "amount": {"type": "Decimal(12, 2)"},
      "at": {"type": "DateTime64(3)"}, "second_tag": {"type": "Nullable(String)", "source": "$.tags[1]"},
      "city": {"type": "String", "source": "$.address.city"}, "channel": {"type": "String", "default": "none"}}


def _doc(i: int, **extra: Any) -> dict[str, Any]:
    return {"id": i, "status": f"s{i}", "amount": 12.5 + i, "at": f"2026-11-30T10:00:{i:02d}+00:00",
            "tags": ["a", f"t{i}"], "address": {"city": "Roma"}, **extra}


@pytest.mark.parametrize("sink", ["postgres", "clickhouse"])
def test_json_schema_records_round_trip_with_two_versions_and_poison(sink, tmp_path, kafka_bootstrap, pg_dsn,
                                                                     new_topic, group_id, schema_registry, chdb):
    topic = new_topic(partitions=1)
    url = schema_registry.url
    v1 = json_schema_values(url, topic, json.dumps(V1), [_doc(i) for i in range(3)])
    v2 = json_schema_values(url, topic, json.dumps(V2), [_doc(i, channel="app") for i in range(3, 6)])
    v1_id, v2_id = (int.from_bytes(v[0][1:5], "big") for v in (v1, v2))
    assert v1_id != v2_id
    records = [(str(i).encode(), v) for i, v in enumerate(v1[:2] + v2[:1] + v1[2:] + v2[1:])]
    records += [(b"plain", json.dumps(_doc(90)).encode()),
                (b"unknown", b"\x00" + (777).to_bytes(4, "big") + json.dumps(_doc(91)).encode()),
                (b"broken", v1[0][:5] + b'{"id": 92,'),
                (b"missing", v1[0][:5] + b'{"status": "no id"}')]
    produce(kafka_bootstrap, topic, records)
    sink_cfg: dict[str, Any] = (
        {"kind": "postgres", "dsn": pg_dsn, "table": "orders", "conflict_key": ["id"], "columns": PG}
        if sink == "postgres" else
        {"kind": "clickhouse", "url": chdb.url, "database": "js", "table": "orders", "order_by": ["id"],
         "columns": CH})
    cfg = format_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, fmt="json_schema", sink=sink_cfg,
                        registry=schema_registry.url, name="js", dlq={"kind": "postgres", "dsn": pg_dsn,
                                                                          "max_ratio": 1.0})
    run_until_idle(migrate(tmp_path, cfg), tmp_path)
    if sink == "postgres":
        with psycopg.connect(pg_dsn) as conn:
            cur = conn.execute("SELECT id, status, amount, at, second_tag, city, channel FROM orders ORDER BY id")
            rows = cur.fetchall()
    else:
        client = chdb.client()
        try:
            rows = [tuple(r) for r in client.query(
                "SELECT id, status, amount, at, second_tag, city, channel FROM js.orders FINAL ORDER BY id"
            ).result_rows]
        finally:
            chdb.close()
    assert len(rows) == 6
    for i, (rid, status, amount, at, second_tag, city, channel) in enumerate(rows):
        assert (rid, status, amount, second_tag, city) == (i, f"s{i}", Decimal("12.5") + i, f"t{i}", "Roma")
        assert at.replace(tzinfo=dt.timezone.utc) == dt.datetime(2026, 11, 30, 10, 0, i, tzinfo=dt.timezone.utc)
        assert channel == ("app" if i >= 3 else "none")
    dead = {d["key"].decode(): (d["stage"], d["error_class"], d["error_message"]) for d in dlq_rows(pg_dsn)}
    assert {k: v[:2] for k, v in dead.items()} == {
        "plain": ("decode", "bad_magic_byte"), "unknown": ("decode", "unknown_schema"),
        "broken": ("decode", "invalid_json"), "missing": ("map", "missing_field")}
    assert f"value schema id {v1_id}" in dead["missing"][2]


def test_check_compares_columns_with_the_latest_json_schema(tmp_path, kafka_bootstrap, pg_dsn, new_topic,
                                                            schema_registry):
    topic = new_topic(partitions=1)
    schema_registry.register(f"{topic}-value", json.dumps(V1), "JSON")
    cfg = {"kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
           "schema_registry": {"url": schema_registry.url},
           "pipelines": [{"name": "js", "topics": [topic], "format": "json_schema",
                          "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "orders", "conflict_key": ["id"],
                                   "columns": {**PG, "channel": {"type": "text", "required": True}}}}]}
    res = run_ingest(["check", "-c", write_config(tmp_path, cfg)], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"ok   pipeline js: subject {topic}-value version 1" in res.stdout
    assert "FAIL pipeline js: column channel (source $.channel) is not a field of subject" in res.stderr
    assert "column city" not in res.stderr + res.stdout
