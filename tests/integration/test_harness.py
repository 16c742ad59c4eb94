"""Smoke tests of the test harness itself, against the real services."""

from __future__ import annotations

import subprocess
from collections import Counter

import psycopg
import pytest
from harness import run_ingest, write_config
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    consume_n,
    end_offsets,
    log_end_offsets,
    make_consumer,
    produce,
    unique_name,
)
from harness.services import dsn_with_dbname, temp_database

N = 3000


def test_produce_consume_commit_roundtrip(kafka_bootstrap, new_topic, group_id):
    topic = new_topic(3)
    records = [(f"k{i % 500}".encode(), f"v{i}".encode()) for i in range(N)]
    assert produce(kafka_bootstrap, topic, records) == N
    # The last record of each partition on its own, so the broker's reported
    # high watermark is the true log end (Tansu reports last batch base + 1).
    for p in range(3):
        assert produce(kafka_bootstrap, topic, [(b"tail", f"tail{p}".encode())], partition=p) == 1
    total = N + 3

    ends = end_offsets(kafka_bootstrap, topic)
    assert sorted(ends) == [0, 1, 2]
    assert sum(ends.values()) == total
    assert log_end_offsets(kafka_bootstrap, topic) == ends
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {}

    consumer = make_consumer(kafka_bootstrap, group_id)
    assert all(consumer_setting in TEST_CONSUMER_SETTINGS for consumer_setting in
               ("session.timeout.ms", "heartbeat.interval.ms"))
    try:
        consumer.subscribe([topic])
        msgs = consume_n(consumer, total, timeout_s=60)
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()

    values = Counter(m.value() for m in msgs)
    assert values == Counter([v for _, v in records] + [f"tail{p}".encode() for p in range(3)])
    last = {}
    for m in msgs:
        last[m.partition()] = max(last.get(m.partition(), -1), m.offset())
    assert {p: o + 1 for p, o in last.items()} == ends

    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    assert committed == ends

    # committed_offsets() must not have joined or wedged the group: a new member
    # is assigned and resumes exactly at the committed offsets.
    more = [(None, f"more{p}".encode(), p) for p in range(3)]
    assert produce(kafka_bootstrap, topic, more) == 3
    consumer = make_consumer(kafka_bootstrap, group_id)
    try:
        consumer.subscribe([topic])
        resumed = consume_n(consumer, 3, timeout_s=60)
    finally:
        consumer.close()
    assert sorted((m.partition(), m.offset(), m.value()) for m in resumed) == [
        (p, committed[p], f"more{p}".encode()) for p in range(3)
    ]


def test_log_end_offsets_is_exact_when_watermark_lags(kafka_bootstrap, new_topic):
    topic = new_topic(3)
    per_partition = {0: 700, 1: 5, 2: 0}
    records = [(None, b"x" * 50, p) for p, n in per_partition.items() for _ in range(n)]
    assert produce(kafka_bootstrap, topic, records) == 705
    assert log_end_offsets(kafka_bootstrap, topic) == per_partition
    reported = end_offsets(kafka_bootstrap, topic)
    # A lower bound on Tansu (base offset of the last batch + 1), exact on Kafka.
    assert all(0 <= reported[p] <= n for p, n in per_partition.items())
    assert reported[2] == 0


def test_new_topic_has_requested_partitions(kafka_bootstrap, new_topic):
    topic = new_topic()
    assert sorted(end_offsets(kafka_bootstrap, topic)) == list(range(6))
    named = new_topic(2, name=topic + "-named")
    assert named == topic + "-named"
    assert end_offsets(kafka_bootstrap, named) == {0: 0, 1: 0}


def test_produce_raises_when_delivery_fails(kafka_bootstrap, new_topic):
    topic = new_topic(1)
    for _ in range(2):  # before and after the cached producer knows the topic's metadata
        with pytest.raises(RuntimeError, match=f"produce to {topic}: .*deliver"):
            produce(kafka_bootstrap, topic, [(b"k", b"v")], partition=7, timeout_s=20)
    assert produce(kafka_bootstrap, topic, [(b"k", b"v")]) == 1


def test_group_id_is_fresh(group_id, kafka_bootstrap, new_topic):
    assert group_id.startswith("g-test_group_id_is_fresh-")
    assert unique_name("g", "x") != unique_name("g", "x")
    assert committed_offsets(kafka_bootstrap, group_id, new_topic(1)) == {}


def test_pg_dsn_is_fresh_database(pg_dsn, pg_admin_dsn):
    assert pg_dsn.startswith("postgresql://")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        db = conn.execute("SELECT current_database()").fetchone()[0]
        assert db.startswith("ingest_t_")
        n_tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()[0]
        assert n_tables == 0
        conn.execute("CREATE TABLE t (id bigint PRIMARY KEY)")
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT current_database()").fetchone()[0] == "postgres"


def test_temp_databases_are_isolated_and_dropped(pg_admin_dsn):
    with temp_database(pg_admin_dsn) as a, temp_database(pg_admin_dsn) as b:
        assert a != b
        with psycopg.connect(a, autocommit=True) as conn:
            conn.execute("CREATE TABLE only_in_a (id int)")
        with psycopg.connect(b, autocommit=True) as conn:
            assert conn.execute("SELECT to_regclass('only_in_a')").fetchone()[0] is None
        held = psycopg.connect(a, autocommit=True)  # left open: the drop must still succeed
        names = [conninfo_dbname(a), conninfo_dbname(b)]
    try:
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            left = conn.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                                (names,)).fetchall()
        assert left == []
        with pytest.raises(psycopg.OperationalError):
            held.execute("SELECT 1")
    finally:
        held.close()


def conninfo_dbname(dsn: str) -> str:
    return psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://postgres@127.0.0.1:5432/postgres", "postgresql://postgres@127.0.0.1:5432/x"),
        ("host=127.0.0.1 port=5433 user=u password='p w' dbname=postgres sslmode=disable",
         "postgresql://u:p%20w@127.0.0.1:5433/x?sslmode=disable"),
        ("postgresql:///postgres?host=/var/run/postgresql", "postgresql:///x?host=%2Fvar%2Frun%2Fpostgresql"),
    ],
)
def test_dsn_with_dbname(dsn, expected):
    out = dsn_with_dbname(dsn, "x")
    assert out == expected
    assert conninfo_dbname(out) == "x"


def test_write_config_roundtrip(tmp_path):
    import yaml

    data = {"kafka": {"bootstrap_servers": "127.0.0.1:1"}, "pipelines": [{"name": "p", "topics": ("a",)}],
            "path": tmp_path / "x"}
    path = write_config(tmp_path, data)
    assert path.parent == tmp_path
    assert yaml.safe_load(path.read_text()) == {
        "kafka": {"bootstrap_servers": "127.0.0.1:1"}, "pipelines": [{"name": "p", "topics": ["a"]}],
        "path": str(tmp_path / "x"),
    }


def test_run_ingest_captures_output(tmp_path):
    res = run_ingest(["--help"], timeout_s=60, log_dir=tmp_path)
    assert isinstance(res, subprocess.CompletedProcess)
    assert isinstance(res.returncode, int)
    assert (res.stdout + res.stderr).strip()
    assert res.args[1:3] == ["-m", "ingest"]
