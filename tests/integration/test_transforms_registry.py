"""Transforms on Schema Registry formats (issue #37, loose ends): real broker, real PostgreSQL, the
registry stand-in (harness/schema_registry.py) with confluent-kafka's own serializers producing the
records, ``python -m ingest`` as a subprocess.

- ``ingest check`` and ``ingest run`` at start-up fetch each value subject's latest schema and refuse
  (exit 2) an expression reading a field it lacks, naming the step's config path and the position --
  Avro, Protobuf and JSON Schema alike;
- a registry that cannot answer at start-up is no refusal: the run holds the records (nothing
  decoded, dead-lettered or committed) and checks once the registry answers -- then writes them, or
  stops (exit 1) naming the step;
- an Avro ``decimal``, a ``timestamp-millis`` and a ``uuid`` read by CEL, and ``ingest_time`` in a
  ``replay_stable: false`` step, end to end.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from formats_helpers import format_config
from harness import run_ingest, start_ingest, write_config
from harness.kafka import committed_offsets, produce
from harness.serde import avro_values, json_schema_values, protobuf_values
from pipeline_helpers import dlq_rows, log_events, wait_until

pytestmark = pytest.mark.timeout(240)

UTC = dt.timezone.utc
PAYMENT = {"type": "record", "name": "Payment", "namespace": "test.ingest", "fields": [
    {"name": "id", "type": "long"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
    {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
]}
JSON_SCHEMA = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Payment", "type": "object",
               "properties": {"id": {"type": "integer"}, "status": {"type": "string"}}, "required": ["id"]}
COLUMNS = {"id": {"type": "bigint", "required": True}, "x": {"type": "bigint"}}
BAD = "value.id + value.nosuch"  # value.nosuch at line 1, column 12
REFUSAL = "pipelines[0].transforms[0].set.x: reads value.nosuch (line 1, column 12), a field subject {}-value version 1"


def payment(i: int) -> dict[str, Any]:
    return {"id": i, "amount": Decimal(f"{i}.29") if i % 7 else Decimal("-1.00"),
            "at": dt.datetime(2026, 12, 5, i % 24, 0, 1, 250000, tzinfo=UTC), "ref": uuid.UUID(int=i)}


def config(fmt: str, *, bootstrap: str, topic: str, group: str, dsn: str, registry: str,
           transforms: list[dict[str, Any]], columns: dict[str, Any] = COLUMNS, **pipeline: Any) -> dict[str, Any]:
    sink = {"kind": "postgres", "dsn": dsn, "table": "payments", "conflict_key": ["id"], "columns": columns}
    return format_config(bootstrap=bootstrap, topic=topic, group=group, fmt=fmt, sink=sink, registry=registry,
                         name="pay", transforms=transforms, **pipeline)


def ok(res: Any) -> None:
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"


def register(fmt: str, url: str, topic: str) -> list[bytes]:
    """Register the format's schema for ``topic``'s values through the real serializer; its records."""
    if fmt == "avro":
        return avro_values(url, topic, json.dumps(PAYMENT), [payment(i) for i in range(3)])
    if fmt == "json_schema":
        return json_schema_values(url, topic, json.dumps(JSON_SCHEMA), [{"id": i, "status": "s"} for i in range(3)])
    from harness.proto_messages import classes

    order, _ = classes()
    return protobuf_values(url, topic, [order(id=i, status="s") for i in range(3)])


@pytest.mark.parametrize("fmt", ["avro", "protobuf", "json_schema"])
def test_check_and_start_up_refuse_a_field_the_registry_schema_lacks(fmt, tmp_path: Path, kafka_bootstrap, pg_dsn,
                                                                     new_topic, group_id, schema_registry) -> None:
    topic = new_topic(1)
    values = register(fmt, schema_registry.url, topic)
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
    common = {"bootstrap": kafka_bootstrap, "topic": topic, "group": group_id, "dsn": pg_dsn,
              "registry": schema_registry.url}
    good = write_config(tmp_path, config(fmt, transforms=[{"set": {"x": "value.id * 2"}}], **common))
    ok(run_ingest(["check", "-c", good], timeout_s=60, log_dir=tmp_path))
    bad = write_config(tmp_path, config(fmt, transforms=[{"set": {"x": BAD}}], **common), name="bad.yaml")
    res = run_ingest(["check", "-c", bad], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 2 and REFUSAL.format(topic) in res.stderr, res.stdout + res.stderr
    res = run_ingest(["run", "-c", bad, "--until-idle", "1", "--metrics-port", "0"], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 2 and REFUSAL.format(topic) in res.stderr, res.stderr[-3000:]
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {}  # refused before consuming anything


def test_a_registry_down_at_start_up_is_no_refusal_the_check_waits_for_it(tmp_path: Path, kafka_bootstrap, pg_dsn,
                                                                          new_topic, group_id,
                                                                          schema_registry) -> None:
    topic = new_topic(2)
    values = register("avro", schema_registry.url, topic)
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
    common = {"bootstrap": kafka_bootstrap, "topic": topic, "dsn": pg_dsn, "registry": schema_registry.url,
              "retry": {"max_attempts": 0, "initial_backoff_ms": 100, "max_backoff_ms": 500}}

    # A refused expression: held while the registry is down (nothing consumed into the sink, the DLQ
    # or the offsets), then the pipeline stops naming the step once the registry answers.
    bad = write_config(tmp_path, config("avro", group=group_id, transforms=[{"set": {"x": BAD}}], **common),
                       name="bad.yaml")
    ok(run_ingest(["migrate", "-c", bad], timeout_s=60, log_dir=tmp_path))
    schema_registry.stop()
    res = run_ingest(["check", "-c", bad], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 3 and "schema registry" in res.stderr, res.stdout + res.stderr  # unreachable, not invalid
    proc = start_ingest(["run", "-c", bad, "--until-idle", "2", "--metrics-port", "0"], log_dir=tmp_path)
    wait_until(lambda: _warned(proc), 60, what="the start-up warning", proc=proc)
    wait_until(lambda: sum(e.get("event") == "schema registry unavailable: holding records, partitions paused"
                           for e in log_events(proc)) >= 2, 60, what="the hold to retry", proc=proc)
    assert proc.poll() is None, proc.describe()
    assert dlq_rows(pg_dsn) == [] and _count(pg_dsn) == 0
    assert all(v <= 0 for v in committed_offsets(kafka_bootstrap, group_id, topic).values())
    schema_registry.start()
    assert proc.wait(120) == 1, proc.describe()
    err = proc.output()[1]
    assert REFUSAL.format(topic) in err, err[-3000:]
    assert dlq_rows(pg_dsn) == [] and _count(pg_dsn) == 0
    assert all(v <= 0 for v in committed_offsets(kafka_bootstrap, group_id, topic).values())

    # A good expression, the registry down at start-up again: held, then checked and written.
    good = write_config(tmp_path, config("avro", group=group_id + "-good", transforms=[{"set": {"x": "value.id * 2"}}],
                                         **common))
    schema_registry.stop()
    proc = start_ingest(["run", "-c", good, "--until-idle", "2", "--metrics-port", "0"], log_dir=tmp_path)
    wait_until(lambda: _warned(proc), 60, what="the start-up warning", proc=proc)
    schema_registry.start()
    assert proc.wait(120) == 0, proc.describe()
    assert _count(pg_dsn) == len(values) and dlq_rows(pg_dsn) == []


def test_avro_decimal_timestamp_uuid_and_ingest_time_end_to_end(tmp_path: Path, kafka_bootstrap, pg_dsn, new_topic,
                                                                 group_id, schema_registry) -> None:
    topic = new_topic(3)
    n = 120
    docs = [payment(i) for i in range(n)]
    values = avro_values(schema_registry.url, topic, json.dumps(PAYMENT), docs)
    produce(kafka_bootstrap, topic, [(str(d["id"]).encode(), v) for d, v in zip(docs, values)])
    transforms = [
        {"filter": "value.amount > 0.0", "name": "refunds-out"},
        {"set": {"cents": "int(math.round(value.amount * 100.0))", "hour": "value.at.getHours()",
                 "ref_text": "value.ref"}},
        {"set": {"loaded_at": "ingest_time", "waited_s": "ingest_time - value.at"}, "replay_stable": False},
    ]
    columns = {"id": {"type": "bigint", "required": True}, "amount": {"type": "numeric(12,2)"},
               "cents": {"type": "bigint"}, "hour": {"type": "integer"}, "ref_text": {"type": "text"},
               "loaded_at": {"type": "timestamptz", "required": True}, "waited_s": {"type": "double precision"}}
    path = write_config(tmp_path, config("avro", bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                                         registry=schema_registry.url, transforms=transforms, columns=columns))
    ok(run_ingest(["check", "-c", path], timeout_s=60, log_dir=tmp_path))
    ok(run_ingest(["migrate", "-c", path], timeout_s=60, log_dir=tmp_path))
    before = dt.datetime.now(UTC)
    ok(run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0"], timeout_s=150, log_dir=tmp_path))
    after = dt.datetime.now(UTC)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        got = {r[0]: r[1:] for r in conn.execute(
            "SELECT id, amount, cents, hour, ref_text, loaded_at, waited_s FROM payments")}
    kept = [d for d in docs if d["amount"] > 0]
    assert sorted(got) == [d["id"] for d in kept] and len(kept) < n
    for d in kept:
        amount, cents, hour, ref_text, loaded_at, waited_s = got[d["id"]]
        assert amount == d["amount"]  # the column reads the decoded decimal itself, exactly
        assert cents == int(d["amount"] * 100) and hour == d["at"].hour and ref_text == str(d["ref"])
        assert before <= loaded_at <= after  # when the run transformed it: not replay-stable
        assert waited_s == pytest.approx((loaded_at - d["at"]).total_seconds(), abs=1e-3)
    assert dlq_rows(pg_dsn) == []


def _warned(proc: Any) -> bool:
    return any(str(e.get("event")).startswith("schema registry cannot answer at start-up") for e in log_events(proc))


def _count(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('payments')").fetchone()[0] is None:
            return 0
        return conn.execute("SELECT count(*) FROM payments").fetchone()[0]
