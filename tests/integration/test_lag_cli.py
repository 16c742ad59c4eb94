"""``ingest lag`` against the real broker: exact per-partition numbers, totals, hot flag, exit codes.

Backlogs are produced so that the broker's reported high watermark is the true
log end (the last record of each partition on its own, flushed: Tansu reports
the base offset of the last batch + 1), and offsets are committed for a fresh
group by a plain consumer that assigns and commits without subscribing.
"""

from __future__ import annotations

import signal
import time

import orjson
import pytest
from confluent_kafka import TopicPartition
from harness import run_ingest, write_config
from harness.kafka import (
    committed_offsets,
    consume_n,
    end_offsets,
    log_end_offsets,
    make_consumer,
    produce,
)
from harness.services import free_port

TIMEOUT_S = 120


def produce_backlog(bootstrap: str, topic: str, per_partition: dict[int, int]) -> None:
    """``n`` records into each partition; the last one alone so the reported watermark is exact."""
    bulk = [(f"k{p}".encode(), f'{{"p": {p}, "i": {i}}}'.encode(), p)
            for p, n in per_partition.items() for i in range(n - 1)]
    produce(bootstrap, topic, bulk)
    for p, n in per_partition.items():
        if n:
            produce(bootstrap, topic, [(f"k{p}".encode(), f'{{"p": {p}, "i": {n - 1}}}'.encode())], partition=p)
    assert end_offsets(bootstrap, topic) == per_partition == log_end_offsets(bootstrap, topic)


def commit(bootstrap: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    """Commit ``offsets`` for ``group`` with assign + commit: the consumer never joins the group."""
    consumer = make_consumer(bootstrap, group)
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in offsets.items()])
        consumer.commit(offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        consumer.close()
    assert committed_offsets(bootstrap, group, topic) == offsets


def config(tmp_path, bootstrap: str, pipelines: list[dict], client: dict | None = None):
    sink = {"kind": "postgres", "table": "events", "columns": {"p": {"type": "integer"}}, "conflict_key": ["p"]}
    return write_config(tmp_path, {
        "kafka": {"bootstrap_servers": bootstrap, **({"client": client} if client else {})},
        "pipelines": [{"sink": sink, **p} for p in pipelines],
    })


def lag_json(cfg, tmp_path, *extra: str) -> tuple[int, dict, str]:
    res = run_ingest(["lag", "--config", cfg, "--format", "json", *extra], timeout_s=TIMEOUT_S, log_dir=tmp_path)
    doc = orjson.loads(res.stdout) if res.stdout.strip() else {}
    return res.returncode, doc, res.stderr


def rows_by_partition(doc: dict, pipeline: str) -> dict[int, dict]:
    return {r["partition"]: r for r in doc["pipelines"][pipeline]["partitions"]}


def test_lag_exact_numbers_and_partition_without_commit(kafka_bootstrap, new_topic, group_id, tmp_path):
    topic = new_topic(3)
    t0 = int(time.time() * 1000)
    produce_backlog(kafka_bootstrap, topic, {0: 1000, 1: 500, 2: 200})
    t1 = int(time.time() * 1000)
    commit(kafka_bootstrap, group_id, topic, {0: 700, 1: 250})  # partition 2: never committed
    cfg = config(tmp_path, kafka_bootstrap, [{"name": "orders", "topics": [topic], "group_id": group_id}])

    code, doc, err = lag_json(cfg, tmp_path)
    assert code == 0, err
    pl = doc["pipelines"]["orders"]
    assert pl["group_id"] == group_id and pl["topics"] == [topic] and pl["errors"] == []
    rows = rows_by_partition(doc, "orders")
    assert {p: (r["topic"], r["committed"], r["low"], r["end"], r["lag"]) for p, r in rows.items()} == {
        0: (topic, 700, 0, 1000, 300),
        1: (topic, 250, 0, 500, 250),
        2: (topic, None, 0, 200, 200),  # no commit: lag from the low watermark
    }
    # Time lag: the age of the record at the committed offset (or the low watermark).
    for r in rows.values():
        assert t0 - 1000 <= r["oldest_ts_ms"] <= t1 + 1000
        assert 0 <= r["lag_s"] < 120
    assert not any(r["hot"] for r in rows.values())  # 300 of 750 does not dominate
    assert pl["totals"] == {"partitions": 3, "lag": 750, "end": 1700, "max_lag_s": pl["totals"]["max_lag_s"],
                            "uncommitted_partitions": 1, "hot_partitions": []}
    assert pl["totals"]["max_lag_s"] == max(r["lag_s"] for r in rows.values())
    assert doc["totals"]["pipelines"] == 1 and doc["totals"]["partitions"] == 3
    assert doc["totals"]["lag"] == 750 and doc["totals"]["hot_partitions"] == 0 and doc["totals"]["errors"] == 0

    # Caught up everywhere: lag 0, no time lag, nothing hot.
    commit(kafka_bootstrap, group_id, topic, {0: 1000, 1: 500, 2: 200})
    code, doc, err = lag_json(cfg, tmp_path)
    assert code == 0, err
    rows = rows_by_partition(doc, "orders")
    assert {p: (r["committed"], r["end"], r["lag"], r["lag_s"]) for p, r in rows.items()} == {
        0: (1000, 1000, 0, None), 1: (500, 500, 0, None), 2: (200, 200, 0, None)}
    assert doc["pipelines"]["orders"]["totals"]["lag"] == 0
    assert doc["pipelines"]["orders"]["totals"]["max_lag_s"] is None


def test_lag_flags_hot_partition_and_does_not_join_the_group(kafka_bootstrap, new_topic, group_id, tmp_path):
    topic = new_topic(3)
    produce_backlog(kafka_bootstrap, topic, {0: 1200, 1: 100, 2: 30})
    commit(kafka_bootstrap, group_id, topic, {0: 300, 1: 50, 2: 30})
    other_topic = new_topic(2)
    produce_backlog(kafka_bootstrap, other_topic, {0: 40, 1: 40})
    cfg = config(tmp_path, kafka_bootstrap, [
        {"name": "orders", "topics": [topic], "group_id": group_id},
        {"name": "small", "topics": [other_topic]},  # default group ingest-small: never committed
    ])

    code, doc, err = lag_json(cfg, tmp_path)
    assert code == 0, err
    rows = rows_by_partition(doc, "orders")
    assert {p: (r["committed"], r["end"], r["lag"], r["hot"]) for p, r in rows.items()} == {
        0: (300, 1200, 900, True), 1: (50, 100, 50, False), 2: (30, 30, 0, False)}
    totals = doc["pipelines"]["orders"]["totals"]
    assert totals["lag"] == 950
    assert totals["hot_partitions"] == [{"topic": topic, "partition": 0, "lag": 900, "share": round(900 / 950, 4)}]
    small = doc["pipelines"]["small"]
    assert small["group_id"] == "ingest-small"
    assert [(r["committed"], r["lag"], r["hot"]) for r in small["partitions"]] == [(None, 40, False)] * 2
    assert small["totals"]["hot_partitions"] == []  # balanced: 40 of 80 is not more than half
    assert doc["totals"]["lag"] == 1030 and doc["totals"]["hot_partitions"] == 1

    # --pipeline selects.
    code, doc, err = lag_json(cfg, tmp_path, "--pipeline", "small")
    assert code == 0, err
    assert list(doc["pipelines"]) == ["small"] and doc["totals"]["lag"] == 80

    # `ingest lag` neither moved the commits nor joined (or wedged) the group:
    # a new member is assigned and resumes exactly at the committed offsets.
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {0: 300, 1: 50, 2: 30}
    consumer = make_consumer(kafka_bootstrap, group_id)
    try:
        consumer.subscribe([topic])
        msgs = consume_n(consumer, 950, timeout_s=60)
    finally:
        consumer.close()
    first = {}
    for m in msgs:
        first.setdefault(m.partition(), m.offset())
    assert first == {0: 300, 1: 50}


def test_lag_table_format(kafka_bootstrap, new_topic, group_id, tmp_path):
    topic = new_topic(3)
    produce_backlog(kafka_bootstrap, topic, {0: 500, 1: 20, 2: 10})
    commit(kafka_bootstrap, group_id, topic, {0: 100, 1: 20})
    cfg = config(tmp_path, kafka_bootstrap, [{"name": "orders", "topics": [topic], "group_id": group_id}])

    res = run_ingest(["lag", "--config", cfg, "--format", "table"], timeout_s=TIMEOUT_S, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"pipeline orders  group {group_id}  lag 410 records" in out
    lines = [line for line in out.splitlines() if topic in line]
    assert len(lines) == 3, out
    cells = [[c.strip() for c in line.split("│") if c.strip()] for line in lines]
    assert [c[:5] for c in cells] == [
        [topic, "0", "100", "500", "400"],
        [topic, "1", "20", "20", "0"],
        [topic, "2", "-", "10", "10"],
    ]
    assert "HOT" in lines[0] and "no commit" in lines[2]
    assert "total lag 410 records over 1 pipeline(s)" in out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_lag_watch_repeats_json_lines(kafka_bootstrap, new_topic, group_id, tmp_path, signum):
    """``lag --watch`` prints a JSON line per measurement and exits 0 on SIGINT or SIGTERM, after the
    measurement under way (its clients closed)."""
    from harness import start_ingest

    topic = new_topic(1)
    produce_backlog(kafka_bootstrap, topic, {0: 5})
    cfg = config(tmp_path, kafka_bootstrap, [{"name": "orders", "topics": [topic], "group_id": group_id}])
    proc = start_ingest(["lag", "--config", cfg, "--format", "json", "--watch", "0.3"], log_dir=tmp_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(proc.output()[0].splitlines()) < 3:
        time.sleep(0.1)
    assert proc.stop(signum, timeout_s=30) == 0
    docs = [orjson.loads(line) for line in proc.output()[0].splitlines()]
    assert len(docs) >= 3
    assert all(d["pipelines"]["orders"]["totals"]["lag"] == 5 for d in docs)


def test_lag_missing_topic_is_reported_exit_1(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(1)
    produce_backlog(kafka_bootstrap, topic, {0: 3})
    missing = topic + "-missing"
    cfg = config(tmp_path, kafka_bootstrap, [{"name": "orders", "topics": [topic, missing]}])
    code, doc, err = lag_json(cfg, tmp_path)
    assert code == 1
    assert doc["pipelines"]["orders"]["totals"]["lag"] == 3
    assert doc["pipelines"]["orders"]["errors"] == [f"topic {missing}: Broker: Unknown topic or partition"]
    assert f"error: pipeline orders: topic {missing}" in err


def test_lag_broker_unreachable_exit_3_without_secrets(tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"
    cfg = config(tmp_path, bootstrap, [{"name": "orders", "topics": ["t"]}],
                 client={"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                         "sasl.username": "u", "sasl.password": "hunter2-secret"})
    started = time.monotonic()
    res = run_ingest(["lag", "--config", cfg, "--format", "json", "--timeout", "2"], timeout_s=TIMEOUT_S,
                     log_dir=tmp_path)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert f"unreachable: kafka {bootstrap}" in res.stderr
    assert "hunter2" not in res.stdout + res.stderr
    assert res.stdout == ""
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipeline", "nope"], "no pipeline named 'nope'"),
        (["--format", "xml"], "--format must be table or json"),
        (["--watch", "0"], "--watch must be a positive"),
    ],
)
def test_lag_usage_and_config_errors_exit_2(tmp_path, args, message):
    cfg = config(tmp_path, "127.0.0.1:1", [{"name": "orders", "topics": ["t"]}])
    res = run_ingest(["lag", "--config", cfg, *args], timeout_s=TIMEOUT_S, log_dir=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr


def test_lag_invalid_config_file_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: {}\npipelines: []\n")
    res = run_ingest(["lag", "--config", bad], timeout_s=TIMEOUT_S, log_dir=tmp_path)
    assert res.returncode == 2
    assert "pipelines" in res.stderr
