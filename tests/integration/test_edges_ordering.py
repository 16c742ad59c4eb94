"""Review findings 1-4 (issue 15): ordering and "no row made older", against the real broker and
PostgreSQL (and chDB), with ``python -m ingest`` as a subprocess.

1. exactly-once after a partition is *lost* (a process pause past the session timeout) and handed
   back: each record lands once;
2. records without a Kafka key, lanes > 1: two records of one row are never written by two lanes
   at once, the partition's last record wins;
3. ``version_column`` decides the in-batch collapse (PostgreSQL and ClickHouse); a NULL version is
   poison, not a silent skip;
4. ``replay-dlq`` (``--to sink`` and ``--to topic``) never makes a row older, and still gives a key
   whose latest record was poison its fixed record.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from harness import run_ingest, start_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce
from harness.metrics import metric, scrape
from pipeline_helpers import (
    log_events,
    pipeline_config,
    table_rows,
    wait_assigned,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ok(res: Any) -> None:
    assert res.returncode == 0, (f"{' '.join(map(str, res.args[2:]))} exited {res.returncode}\n"
                                 f"--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-6000:]}")


def _order(order_id: int, seq: int, **extra: Any) -> bytes:
    return orjson.dumps({"order_id": order_id, "status": extra.pop("status", f"s{seq}"), "seq": seq,
                         "amount": extra.pop("amount", 1.5), "updated_at": "2024-01-01T00:00:00+00:00", **extra})


# --------------------------------------------------------------------------- finding 1


@pytest.mark.slow
def test_exactly_once_partition_lost_and_handed_back_writes_each_record_once(
        kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """SIGSTOP past the session timeout while records sit in a lane's batcher, then SIGCONT: the
    consumer loses its partitions, gets them back and reads the records again. Each must land once."""
    topic = new_topic(partitions=2)
    port = _free_port()
    config = write_and_migrate(tmp_path, {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "events", "topics": [topic], "group_id": group_id, "lanes": 2, "commit_interval_ms": 200,
            # Records stay in the batchers until shutdown: the lost partition's records are buffered.
            "batch": {"max_rows": 100_000, "max_latency_ms": 120_000},
            "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "events", "on_conflict": "none",
                     "delivery": "exactly_once",
                     "columns": {"id": {"type": "bigint", "required": True},
                                 "part": {"type": "integer", "source": "@partition"},
                                 "off": {"type": "bigint", "source": "@offset"}}},
        }],
    })
    proc = start_ingest(["run", "-c", config, "--metrics-port", str(port)], log_dir=tmp_path)
    wait_assigned(proc)
    n = 40
    produce(kafka_bootstrap, topic, [(str(i).encode(), orjson.dumps({"id": i})) for i in range(n)])

    def consumed() -> float | None:
        text = scrape(port)
        return text is not None and (metric(text, "ingest_records_consumed_total") or 0) >= n

    wait_until(consumed, 30, what=f"{n} records consumed", proc=proc)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(10)  # session.timeout.ms is 6000: the broker expires the member
    proc.send_signal(signal.SIGCONT)

    def lost_then_assigned() -> bool:
        events = [e.get("event") for e in log_events(proc)]
        return "partitions lost" in events and events[::-1].index("partitions assigned") < events[::-1].index(
            "partitions lost")

    wait_until(lost_then_assigned, 60, what="the partitions lost and assigned again", proc=proc)
    wait_until(lambda: (metric(scrape(port) or "", "ingest_records_consumed_total") or 0) >= 2 * n, 30,
               what="the records read again", proc=proc)
    assert proc.stop(signal.SIGTERM, 60) == 0, proc.describe()
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT id, part, off FROM events ORDER BY id").fetchall()
    ids = [r[0] for r in rows]
    assert sorted(ids) == list(range(n)), f"each record once; duplicated: {sorted({i for i in ids if ids.count(i) > 1})}"


# --------------------------------------------------------------------------- finding 2


def test_unkeyed_records_of_one_row_are_not_reordered_across_lanes(kafka_bootstrap, pg_dsn, new_topic,
                                                                   group_id, tmp_path):
    """Two records of order 1 without a Kafka key, one batch each, lanes 4. A trigger delays the
    first one's write by 2 s: were they in two lanes, the second would commit first and the first
    would then overwrite it."""
    topic = new_topic(partitions=1)
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=4,
        batch={"max_rows": 1, "max_latency_ms": 50}))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("""
            CREATE FUNCTION slow_first() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN IF NEW.status = 'slow' THEN PERFORM pg_sleep(2); END IF; RETURN NEW; END $$;
            CREATE TRIGGER slow_first BEFORE INSERT OR UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION slow_first();
        """)
    records = [(None, _order(1, 1, status="slow")), (None, _order(1, 2, status="fast"))]
    records += [(None, _order(100 + i, 10 + i)) for i in range(6)]
    produce(kafka_bootstrap, topic, records, partition=0)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "4"], timeout_s=120, log_dir=tmp_path))
    rows = table_rows(pg_dsn)
    assert rows[1][:2] == ("fast", 2), f"order 1 must hold its last record (seq 2), has {rows[1]}"
    assert len(rows) == 7


def test_migrate_keys_old_exactly_once_lane_offsets_by_routing(kafka_bootstrap, pg_dsn, new_topic, tmp_path):
    """Lane offsets made before the routing scheme existed keep their rows (scheme kafka-key) and get a
    primary key that includes the scheme, so a table that now routes by its conflict key starts fresh
    lane offsets instead of trusting ones written under another lane mapping."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("""CREATE TABLE ingest_lane_offsets (pipeline text NOT NULL, topic text NOT NULL,
            "partition" integer NOT NULL, lanes integer NOT NULL, lane integer NOT NULL, next_offset bigint NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (pipeline, topic, "partition", lanes, lane))""")
        conn.execute("INSERT INTO ingest_lane_offsets VALUES ('orders', 't', 0, 2, 1, 42)")
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=new_topic(partitions=1), group="g", dsn=pg_dsn, lanes=2)
    cfg["pipelines"][0]["sink"]["delivery"] = "exactly_once"
    write_and_migrate(tmp_path, cfg)
    write_and_migrate(tmp_path, cfg)  # idempotent
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT routing, next_offset FROM ingest_lane_offsets").fetchall() == [("kafka-key", 42)]
        pk = conn.execute("""SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_constraint con
            JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = ANY(con.conkey)
            WHERE con.contype = 'p' AND con.conrelid = 'ingest_lane_offsets'::regclass""").fetchone()[0]
    assert pk == sorted(["pipeline", "topic", "partition", "lanes", "routing", "lane"])


# --------------------------------------------------------------------------- finding 3


def _version_records() -> list[tuple[bytes, bytes]]:
    """Order 1: version 5 consumed before version 3 (out-of-order event times); order 2: one record
    without a version; order 3: versions 1, 2 in order."""
    return [
        (b"1", orjson.dumps({"id": 1, "v": 5, "note": "five"})),
        (b"1", orjson.dumps({"id": 1, "v": 3, "note": "three"})),
        (b"2", orjson.dumps({"id": 2, "note": "no version"})),
        (b"3", orjson.dumps({"id": 3, "v": 1, "note": "one"})),
        (b"3", orjson.dumps({"id": 3, "v": 2, "note": "two"})),
    ]


def test_version_column_decides_the_in_batch_collapse_postgres(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                               tmp_path):
    topic = new_topic(partitions=1)
    config = write_and_migrate(tmp_path, {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "versions", "topics": [topic], "group_id": group_id, "commit_interval_ms": 200,
            "batch": {"max_rows": 1000, "max_latency_ms": 500},
            "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "versions", "conflict_key": ["id"],
                     "version_column": "v",
                     "columns": {"id": {"type": "bigint", "required": True}, "v": {"type": "bigint"},
                                 "note": {"type": "text"}}},
        }],
    })
    produce(kafka_bootstrap, topic, _version_records(), partition=0)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    with psycopg.connect(pg_dsn) as conn:
        rows = {r[0]: r[1:] for r in conn.execute("SELECT id, v, note FROM versions")}
        dead = conn.execute("SELECT key, stage, error_class FROM ingest_dlq").fetchall()
    assert rows[1] == (5, "five"), "the higher version wins inside a batch"
    assert rows[3] == (2, "two")
    assert 2 not in rows, "a record without a version is not written (and not counted as written)"
    assert [(bytes(k), s, e) for k, s, e in dead] == [(b"2", "map", "missing_field")]


def test_version_column_decides_the_in_batch_collapse_clickhouse(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                 chdb, tmp_path):
    topic = new_topic(partitions=1)
    config = write_config(tmp_path, {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "versions", "topics": [topic], "group_id": group_id, "commit_interval_ms": 200,
            "batch": {"max_rows": 1000, "max_latency_ms": 500},
            "sink": {"kind": "clickhouse", "url": chdb.url, "database": "ingest_test", "table": "versions",
                     "order_by": ["id"], "version_column": "v",
                     "columns": {"id": {"type": "UInt64"}, "v": {"type": "UInt64"},
                                 "note": {"type": "String", "default": ""}}},
            "dlq": {"kind": "postgres", "dsn": pg_dsn},
        }],
    })
    _ok(run_ingest(["migrate", "-c", config], timeout_s=60, log_dir=tmp_path))
    produce(kafka_bootstrap, topic, _version_records(), partition=0)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    client = chdb.client()
    rows = {r[0]: r[1:] for r in client.query("SELECT id, v, note FROM ingest_test.versions FINAL").result_rows}
    chdb.close()
    assert rows[1] == (5, "five"), "the higher version wins inside a batch"
    assert rows[3] == (2, "two")
    assert 2 not in rows


# --------------------------------------------------------------------------- finding 4


def _replay_config(tmp_path: Path, bootstrap: str, topic: str, group: str, dsn: str,
                   version: str | None) -> Path:
    cfg = pipeline_config(bootstrap=bootstrap, topic=topic, group=group, dsn=dsn,
                          batch={"max_rows": 1000, "max_latency_ms": 200}, version_column=version is not None)
    if version is not None:
        cfg["pipelines"][0]["sink"]["columns"]["version"]["source"] = version
    return write_and_migrate(tmp_path, cfg)


@pytest.mark.parametrize("to,version", [("sink", None), ("topic", None), ("topic", "@offset")],
                         ids=["to-sink", "to-topic", "to-topic-offset-version"])
def test_replay_never_makes_a_row_older(to, version, kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """Order 1: its poison record A is dead-lettered, a later good record B is written; replaying A
    must leave B. Order 2: good C, then its latest record D is poison; replaying D must apply D."""
    topic = new_topic(partitions=1)
    config = _replay_config(tmp_path, kafka_bootstrap, topic, group_id, pg_dsn, version)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE orders ADD CONSTRAINT amount_not_negative CHECK (amount >= 0)")
    produce(kafka_bootstrap, topic, [(b"2", _order(2, 1)), (b"1", _order(1, 2, amount=-1)),
                                     (b"2", _order(2, 3, amount=-1))], partition=0)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    produce(kafka_bootstrap, topic, [(b"1", _order(1, 4))], partition=0)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    before = table_rows(pg_dsn)
    assert (before[1][1], before[2][1]) == (4, 1), before
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE orders DROP CONSTRAINT amount_not_negative")
    replay = run_ingest(["replay-dlq", "-c", config, "-p", "orders", "--to", to], timeout_s=120, log_dir=tmp_path)
    _ok(replay)
    if to == "topic":
        _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    after = table_rows(pg_dsn)
    assert after[1][1] == 4, f"replaying order 1's older record made its row older: {after[1]}"
    assert after[2][1] == 3, f"order 2's fixed latest record was not applied: {after[2]}"
    with psycopg.connect(pg_dsn) as conn:
        pending = conn.execute("SELECT count(*) FROM ingest_dlq WHERE status = 'pending'").fetchone()[0]
    assert pending == 0, "both entries are resolved (one applied, one superseded by a newer row)"


def test_an_older_record_of_the_rows_own_partition_never_overwrites_it(pg_dsn):
    """The upsert guard on the hidden source columns, on a real table: a late writer's older record of
    the row's partition is skipped; a record of another partition applies (arrival order); a row
    written before ingest kept sources (NULL) is updated."""
    from ingest.core.routing import stream_id
    from ingest.drivers.postgres import execute_ddl
    from ingest.sinks.postgres.schema import sink_table_sql
    from ingest.sinks.postgres.settings import PostgresSinkSettings
    from ingest.sinks.postgres.sink import PostgresSink

    cfg = PostgresSinkSettings(dsn=pg_dsn, table="guarded", conflict_key=["id"],
                               columns={"id": {"type": "bigint"}, "v": {"type": "text"}})
    assert list(cfg.columns) == ["id", "v", "_ingest_stream", "_ingest_offset"]
    execute_ddl(pg_dsn, "test", sink_table_sql(cfg))
    sink = PostgresSink(cfg, pool_size=1)
    p0, p1 = stream_id("t", 0), stream_id("t", 1)
    try:
        sink.write([(1, "p0@10", p0, 10), (2, "p0@10", p0, 10)])
        sink.write([(1, "p0@5 (late)", p0, 5)])  # older, same partition: skipped
        sink.write([(2, "p1@3", p1, 3)])  # another partition: applies
        sink.write([(1, "p0@11", p0, 11)])  # newer: applies
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO guarded VALUES (3, 'before sources', NULL, NULL)")
        sink.write([(3, "p0@1", p0, 1)])
        with psycopg.connect(pg_dsn) as conn:
            rows = dict(conn.execute("SELECT id, v FROM guarded").fetchall())
    finally:
        sink.close()
    assert rows == {1: "p0@11", 2: "p1@3", 3: "p0@1"}
