"""Transforms end to end (issue #37): real broker, real PostgreSQL, ``python -m ingest`` as a subprocess.

One stream of orders through a pipeline with a filter, computed columns, flatten and a timestamp
step. Every test-tenant record is filtered (counted, its offset committed); a record the
``set`` step fails on (an amount sent as text) is dead-lettered as ``transform/transform_error``
naming the step; the rest land with the computed values. After the configuration is fixed,
``replay-dlq`` applies the current transforms and writes each dead-lettered record once. Ground
truth is the stream we produced; offsets are checked against the true log end.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from pipeline_helpers import assert_committed_at_log_end, dlq_rows, read_summary

pytestmark = pytest.mark.timeout(240)

PIPELINE = "orders"
TABLE = "orders_t"
N = 300
BASE_MS = 1_764_928_800_000  # 2025-12-05T10:00:00Z


def order(i: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"order_id": i, "tenant": "test" if i % 5 == 0 else "acme", "amount": i + 0.25,
                           "ms": BASE_MS + i, "meta": {"src": "web" if i % 2 else "app"}}
    if i % 17 == 3:  # poison for the first configuration: text where the expression multiplies a double
        doc["amount"] = f"{i}.25"
    return doc


def transforms(amount: str, drop_order: int = -1) -> list[dict[str, Any]]:
    return [
        {"filter": f"value.tenant != 'test' && value.order_id != {drop_order}", "name": "no-test"},
        {"set": {"amount_cents": amount, "source": "'shop'"}},
        {"flatten": {"fields": ["meta"]}},
        {"timestamp": {"field": "ms", "format": "epoch_ms", "into": "at"}},
    ]


def config(bootstrap: str, topic: str, group: str, dsn: str, amount: str, drop_order: int = -1) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": PIPELINE, "topics": [topic], "group_id": group, "commit_interval_ms": 200,
            "shutdown_timeout_s": 10, "transforms": transforms(amount, drop_order),
            "sink": {"kind": "postgres", "dsn": dsn, "table": TABLE, "conflict_key": ["order_id"], "columns": {
                "order_id": {"type": "bigint", "required": True},
                "tenant": {"type": "text"},
                "amount_cents": {"type": "bigint", "required": True},
                "source": {"type": "text"},
                "meta_src": {"type": "text"},
                "at": {"type": "timestamptz", "required": True},
            }},
        }],
    }


def ok(res: Any) -> None:
    assert res.returncode == 0, (f"ingest exited {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n"
                                 f"--- stderr ---\n{res.stderr[-6000:]}")


def rows(dsn: str) -> dict[int, tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        got = conn.execute(f"SELECT order_id, tenant, amount_cents, source, meta_src, at FROM {TABLE}").fetchall()
    return {r[0]: tuple(r[1:]) for r in got}


def expected_row(i: int) -> tuple:
    return ("acme", i * 100 + 25, "shop", "web" if i % 2 else "app",
            datetime.fromtimestamp((BASE_MS + i) / 1000, tz=timezone.utc))


def test_filter_set_and_transform_errors_then_replay_after_the_fix(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                      tmp_path: Path) -> None:
    topic = new_topic(3)
    docs = [order(i) for i in range(N)]
    assert produce(kafka_bootstrap, topic, [(str(d["order_id"]).encode(), json.dumps(d).encode()) for d in docs]) == N
    filtered = {d["order_id"] for d in docs if d["tenant"] == "test"}
    poison = {d["order_id"] for d in docs if isinstance(d["amount"], str) and d["order_id"] not in filtered}
    good = {d["order_id"] for d in docs} - filtered - poison
    assert filtered and poison and good

    first = write_config(tmp_path, config(kafka_bootstrap, topic, group_id, pg_dsn, "int(value.amount * 100.0)"))
    ok(run_ingest(["migrate", "--config", first], timeout_s=60, log_dir=tmp_path))
    summary_path = tmp_path / "summary.json"
    res = run_ingest(["run", "--config", first, "--until-idle", "3", "--metrics-port", "0",
                      "--summary-json", summary_path], timeout_s=150, log_dir=tmp_path)
    ok(res)

    # The good records landed with the computed values; no filtered or poison record did.
    assert rows(pg_dsn) == {i: expected_row(i) for i in good}
    # Every poison record is in the DLQ with its step, nothing else is; it was not passed on untransformed.
    dead = dlq_rows(pg_dsn)
    assert sorted(json.loads(d["value"])["order_id"] for d in dead) == sorted(poison)
    for d in dead:
        assert (d["stage"], d["error_class"], d["status"]) == ("transform", "transform_error", "pending")
        assert d["error_message"].startswith("transforms[1] (1-set): set.amount_cents: "), d["error_message"]
    # Filtered records are counted and their offsets committed with the rest: the group is at the log end.
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["records_consumed"] == N
    assert stats["filtered"] == len(filtered) and stats["filtered_by_step"] == {"no-test": len(filtered)}
    assert stats["dead_lettered_by_class"] == {"transform/transform_error": len(poison)}
    assert stats["skipped"] == 0
    assert f"filtered {len(filtered)}," in res.stderr
    assert sum(assert_committed_at_log_end(kafka_bootstrap, group_id, topic).values()) == N

    # A configuration that does not compile is refused at start-up, naming the step and the position.
    broken = write_config(tmp_path, config(kafka_bootstrap, topic, group_id, pg_dsn, "int(value.amount * )"),
                          name="broken.yaml")
    res = run_ingest(["run", "--config", broken, "--until-idle", "1", "--metrics-port", "0"], timeout_s=60,
                     log_dir=tmp_path)
    assert res.returncode == 2
    assert "pipelines[0].transforms[1].set.amount_cents: does not compile at line 1, column 20" in res.stderr

    # Fix the expression (amounts as text too), and filter one of the poison orders out, then replay:
    # the DLQ's records go through the current transforms and are written once; the one the filter
    # now drops is resolved without a row.
    dropped = min(poison)
    fixed = write_config(tmp_path, config(kafka_bootstrap, topic, group_id, pg_dsn,
                                          "int(double(value.amount) * 100.0)", drop_order=dropped), name="fixed.yaml")
    res = run_ingest(["replay-dlq", "--config", fixed, "--pipeline", PIPELINE], timeout_s=120, log_dir=tmp_path)
    ok(res)
    assert f"replayed {len(poison)}, still failing 0" in res.stdout and "filtered 1 " in res.stdout, res.stdout
    assert rows(pg_dsn) == {i: expected_row(i) for i in good | poison - {dropped}}
    assert {d["status"] for d in dlq_rows(pg_dsn)} == {"replayed"}
    res = run_ingest(["replay-dlq", "--config", fixed, "--pipeline", PIPELINE], timeout_s=120, log_dir=tmp_path)
    ok(res)
    assert "replayed 0," in res.stdout, res.stdout
    assert rows(pg_dsn) == {i: expected_row(i) for i in good | poison - {dropped}}
    assert len(dlq_rows(pg_dsn)) == len(poison)


def test_preview_from_the_topic_writes_and_commits_nothing(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                           tmp_path: Path) -> None:
    from harness.kafka import committed_offsets

    topic = new_topic(2)
    docs = [order(i) for i in range(20)]
    produce(kafka_bootstrap, topic, [(str(d["order_id"]).encode(), json.dumps(d).encode()) for d in docs])
    path = write_config(tmp_path, config(kafka_bootstrap, topic, group_id, pg_dsn, "int(value.amount * 100.0)"))
    res = run_ingest(["preview", "--config", path, "--pipeline", PIPELINE, "--from-topic", "--limit", "50",
                      "--format", "json"], timeout_s=60, log_dir=tmp_path)
    ok(res)
    out = json.loads(res.stdout)
    kept = [r["row"]["order_id"] for r in out["tables"][TABLE]]
    assert sorted(kept) == sorted(i for i in range(20) if i % 5 and i % 17 != 3)
    assert len(out["filtered"]) == 4 and {f["step"] for f in out["filtered"]} == {"no-test"}  # orders 0, 5, 10, 15
    assert [e["error_class"] for e in out["errors"]] == ["transform_error"]  # order 3
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # nothing written: not even the table exists
        assert conn.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone()[0] is None
    res = run_ingest(["preview", "--config", path, "--pipeline", PIPELINE, "--from-topic", "--limit", "3"],
                     timeout_s=60, log_dir=tmp_path)
    ok(res)
    last = res.stdout.strip().splitlines()[-1]  # "R rows for orders_t, F filtered, E errors, S without a row"
    counts = [int(word) for word in last.replace(",", "").split() if word.isdigit()]
    assert len(counts) == 4 and sum(counts) == 3, last


def test_check_and_start_up_refuse_a_transform_reading_a_field_the_declared_schema_lacks(
        kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path: Path) -> None:
    avsc = tmp_path / "order.avsc"
    avsc.write_text(json.dumps({"type": "record", "name": "Order", "fields": [
        {"name": "order_id", "type": "long"}, {"name": "tenant", "type": "string"},
        {"name": "amount", "type": "double"}, {"name": "ms", "type": "long"},
        {"name": "meta", "type": {"type": "record", "name": "Meta", "fields": [{"name": "src", "type": "string"}]}},
    ]}))
    topic = new_topic(1)
    good = config(kafka_bootstrap, topic, group_id, pg_dsn, "int(value.amount * 100.0)")
    good["pipelines"][0].update(format="avro", avro_schema=str(avsc))
    res = run_ingest(["check", "--config", write_config(tmp_path, good)], timeout_s=60, log_dir=tmp_path)
    ok(res)
    bad = config(kafka_bootstrap, topic, group_id, pg_dsn, "int(value.amount * 100.0) + value.nosuch")
    bad["pipelines"][0].update(format="avro", avro_schema=str(avsc))
    bad_path = write_config(tmp_path, bad, name="bad.yaml")
    res = run_ingest(["check", "--config", bad_path], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "pipelines[0].transforms[1].set.amount_cents: reads value.nosuch (line 1, column 29)" in res.stderr
    # The schema is in a file: start-up refuses it too, before reaching any service.
    res = run_ingest(["run", "--config", bad_path, "--until-idle", "1", "--metrics-port", "0"], timeout_s=60,
                     log_dir=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "pipelines[0].transforms[1].set.amount_cents: reads value.nosuch (line 1, column 29)" in res.stderr


def test_change_events_transformed_filtered_deleted_and_dead_lettered(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                      tmp_path: Path) -> None:
    """``envelope: debezium`` (the JSON converter with its schema part): the transforms apply to the
    ``after`` image; a filtered update leaves the row as it was; a delete whose ``before`` image holds
    the key alone (REPLICA IDENTITY DEFAULT) still deletes through a rename; an image a step fails on
    is dead-lettered; the group ends at the log end."""
    from harness.debezium import Field, encode_event, encode_key

    fields = (Field("id", "int64"), Field("name", "string"), Field("status", "string"), Field("amount", "float64"),
              Field("qty", "int32"))
    key_fields = (Field("id", "int64"),)
    records: list[tuple[bytes, bytes | None]] = []

    def event(op: str, i: int, lsn: int, *, status: str = "ok", amount: float | None = 2.5) -> None:
        key = encode_key({"id": i}, fields=key_fields, schemas=True)
        if op == "d":
            before = {"id": i, "name": None, "status": None, "amount": None, "qty": None}
            records.append((key, encode_event("d", before, None, fields=fields, lsn=lsn, ts_ms=lsn, schemas=True)))
            records.append((key, None))  # the tombstone Debezium sends after a delete
            return
        after = {"id": i, "name": f"item {i}", "status": status, "amount": amount, "qty": lsn}
        records.append((key, encode_event(op, None, after, fields=fields, lsn=lsn, ts_ms=lsn, schemas=True)))

    event("c", 1, 10)
    event("c", 2, 11)
    event("u", 1, 12, status="draft")  # filtered: row 1 stays as of lsn 10 ...
    event("u", 2, 13)
    event("d", 2, 14)                  # ... row 2 is deleted through the rename
    event("c", 3, 15, status="draft")  # filtered: never a row
    event("c", 4, 16, amount=None)     # the set step fails: dead-lettered
    event("c", 5, 17)
    topic = new_topic(1)
    assert produce(kafka_bootstrap, topic, records) == len(records)

    cfg = {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "cdc", "topics": [topic], "group_id": group_id, "commit_interval_ms": 200, "envelope": "debezium",
            "transforms": [
                {"filter": "value.status != 'draft'", "name": "no-drafts"},
                {"set": {"amount_cents": "int(value.amount * 100.0)",
                         "label": "value.name + ' x' + string(value.qty)"}},
                {"rename": {"id": "item_id"}},
            ],
            "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "items_t", "conflict_key": ["item_id"],
                     "version_column": "lsn", "columns": {
                         "item_id": {"type": "bigint", "required": True}, "amount_cents": {"type": "bigint"},
                         "label": {"type": "text"}, "lsn": {"type": "bigint", "source": "@source.lsn"}}},
        }],
    }
    path = write_config(tmp_path, cfg)
    ok(run_ingest(["migrate", "--config", path], timeout_s=60, log_dir=tmp_path))
    summary_path = tmp_path / "summary.json"
    ok(run_ingest(["run", "--config", path, "--until-idle", "3", "--metrics-port", "0", "--summary-json",
                   summary_path], timeout_s=150, log_dir=tmp_path))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        got = {r[0]: r[1:] for r in conn.execute("SELECT item_id, amount_cents, label, lsn FROM items_t")}
    assert got == {1: (250, "item 1 x10", 10), 5: (250, "item 5 x17", 17)}
    dead = dlq_rows(pg_dsn)
    assert [(d["stage"], d["error_class"], d["offset"]) for d in dead] == [("transform", "transform_error", 7)]  # c4
    assert dead[0]["error_message"].startswith("transforms[1] (1-set): set.amount_cents: ")
    stats = read_summary(summary_path)["pipelines"]["cdc"]
    assert stats["filtered_by_step"] == {"no-drafts": 2} and stats["rows_deleted"] == 1
    assert sum(assert_committed_at_log_end(kafka_bootstrap, group_id, topic).values()) == len(records)
