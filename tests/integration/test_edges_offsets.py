"""Review findings 10-11 (issue 15): offsets at the end of the log, against the real broker.

10. a partition that ends with a transaction commit marker: committed offsets reach the log end
    past the marker, ``ingest lag`` and the lag metric show 0 (Tansu serves aborted records to
    ``read_committed`` consumers, see INFRA.md, so only committed transactions are tested here);
11. ``--until-idle`` exits 0 only once the *group* has drained the topic: a member killed a moment
    earlier still holds partitions; and it gives up (exit 1, naming the partitions left and how
    far behind) after ``--drain-timeout``.
"""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from harness import run_ingest, start_ingest
from harness.kafka import committed_offsets, log_end_offsets
from harness.metrics import samples, scrape
from pipeline_helpers import (
    OrderGen,
    SteadyProducer,
    assignments,
    count_rows,
    pipeline_config,
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


# --------------------------------------------------------------------------- finding 10


def _produce_transactionally(bootstrap: str, topic: str, per_partition: int, partitions: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}"})
    producer.init_transactions(30)
    for txn in range(2):  # two transactions: markers in the middle and at the end of each partition
        producer.begin_transaction()
        for p in range(partitions):
            for i in range(per_partition // 2):
                oid = txn * 100_000 + p * 1000 + i
                producer.produce(topic, key=str(oid).encode(), partition=p, value=orjson.dumps(
                    {"order_id": oid, "status": "tx", "seq": oid, "amount": 1, "updated_at": "2024-01-01T00:00:00Z"}))
        producer.commit_transaction(30)


def test_lag_reaches_zero_past_a_transaction_marker(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    topic = new_topic(partitions=3)
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                          batch={"max_rows": 500, "max_latency_ms": 100})
    cfg["kafka"]["client"]["isolation.level"] = "read_committed"
    config = write_and_migrate(tmp_path, cfg)
    _produce_transactionally(kafka_bootstrap, topic, per_partition=40, partitions=3)
    ends = log_end_offsets(kafka_bootstrap, topic)
    assert ends == {0: 42, 1: 42, 2: 42}, f"40 records and two commit markers per partition: {ends}"
    port = _free_port()
    proc = start_ingest(["run", "-c", config, "--metrics-port", str(port)], log_dir=tmp_path)
    try:
        wait_until(lambda: count_rows(pg_dsn) == 120, 60, what="every record written", proc=proc)
        wait_until(lambda: committed_offsets(kafka_bootstrap, group_id, topic) == ends, 20,
                   what=f"committed offsets at the log end {ends} (past the marker)", proc=proc)

        def lag_metric_zero() -> bool:
            lag = samples(scrape(port) or "", "ingest_consumer_lag_records")
            return len(lag) == 3 and set(lag.values()) == {0.0}

        wait_until(lag_metric_zero, 20, what="the lag metric at 0 on every partition", proc=proc)
    finally:
        assert proc.stop(signal.SIGTERM, 60) == 0, proc.describe()
    res = run_ingest(["lag", "-c", config, "--format", "json"], timeout_s=60, log_dir=tmp_path)
    _ok(res)
    parts = orjson.loads(res.stdout)["pipelines"]["orders"]["partitions"]
    assert [(p["committed"], p["end"], p["lag"]) for p in parts] == [(42, 42, 0)] * 3


def test_aborted_transactions_never_land(kafka_service, pg_dsn, new_topic, group_id, tmp_path):
    """``read_committed`` is the broker's part: Tansu serves aborted records anyway (INFRA.md), so
    this half runs only against a real Kafka (Docker engine, or INGEST_TEST_KAFKA)."""
    if kafka_service.kind == "local":
        pytest.skip("the local Tansu broker serves aborted records to read_committed consumers; "
                    "needs a real Kafka (a Docker engine or INGEST_TEST_KAFKA)")
    bootstrap = kafka_service.endpoint
    topic = new_topic(partitions=1)
    config = write_and_migrate(tmp_path, pipeline_config(bootstrap=bootstrap, topic=topic, group=group_id,
                                                         dsn=pg_dsn, batch={"max_rows": 100, "max_latency_ms": 100}))
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}"})
    producer.init_transactions(30)
    for txn, commit in enumerate((True, False, True)):
        producer.begin_transaction()
        for i in range(10):
            oid = txn * 100 + i
            producer.produce(topic, key=str(oid).encode(), partition=0, value=orjson.dumps(
                {"order_id": oid, "status": "tx", "seq": oid, "amount": 1, "updated_at": "2024-01-01T00:00:00Z"}))
        (producer.commit_transaction if commit else producer.abort_transaction)(30)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    assert count_rows(pg_dsn) == 20
    assert committed_offsets(bootstrap, group_id, topic) == log_end_offsets(bootstrap, topic)


# --------------------------------------------------------------------------- finding 11


def _two_members(kafka_bootstrap: str, pg_dsn: str, topic: str, group: str, tmp_path, client: dict,
                 until_idle: list[str]) -> tuple[Any, Any, SteadyProducer, Any]:
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=topic, group=group, dsn=pg_dsn,
                          batch={"max_rows": 200, "max_latency_ms": 100})
    cfg["kafka"]["client"].update(client)
    config = write_and_migrate(tmp_path, cfg)
    feed = SteadyProducer(kafka_bootstrap, topic, OrderGen(seed=11), chunk=60, interval_s=0.1)
    feed.start()  # the stream keeps B busy (so its own idle timer cannot fire) until A is gone
    try:
        a = start_ingest(["run", "-c", config, "--metrics-port", "0"], log_dir=tmp_path / "a")
        wait_until(lambda: any(assignments(a)), 60, what="member A assigned", proc=a)
        b = start_ingest(["run", "-c", config, "--metrics-port", "0", *until_idle], log_dir=tmp_path / "b")

        def split() -> bool:  # both members hold partitions after the rebalance
            got_a, got_b = assignments(a), assignments(b)
            return bool(got_a and got_b and got_a[-1] and got_b[-1] and len(got_a[-1]) + len(got_b[-1]) == 6)

        wait_until(split, 90, what="the partitions split between A and B", proc=b)
    except BaseException:
        feed.finish()
        raise
    return a, b, feed, config


@pytest.mark.slow
def test_until_idle_waits_for_the_whole_group_to_drain(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """A and B share the group; A is SIGKILLed while records keep arriving on its partitions, and
    then the stream stops. B (``--until-idle 3``) finishes its own partitions long before the broker
    expires A: it must wait until A's partitions come to it and are drained."""
    topic = new_topic(partitions=6)
    a, b, feed, _ = _two_members(kafka_bootstrap, pg_dsn, topic, group_id, tmp_path, {}, ["--until-idle", "3"])
    try:
        time.sleep(1)
        a.kill9()
        time.sleep(0.5)
    finally:
        feed.finish()
    code = b.wait(120)
    assert code == 0, b.describe()
    ends = log_end_offsets(kafka_bootstrap, topic)
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {p: e for p, e in ends.items() if e > 0}, \
        "B exited while partitions of the group were not drained"


@pytest.mark.slow
def test_until_idle_gives_up_after_the_drain_timeout_naming_the_partitions(kafka_bootstrap, pg_dsn, new_topic,
                                                                          group_id, tmp_path):
    """A is paused (SIGSTOP) holding partitions with a backlog, for longer than B's drain timeout
    and shorter than the session timeout: B gives up, exit 1, and says which partitions were left."""
    topic = new_topic(partitions=6)
    client = {"session.timeout.ms": 30_000, "heartbeat.interval.ms": 500}
    a, b, feed, _ = _two_members(kafka_bootstrap, pg_dsn, topic, group_id, tmp_path, client,
                                 ["--until-idle", "1", "--drain-timeout", "4", "--summary-json",
                                  str(tmp_path / "b.json")])
    try:
        try:
            time.sleep(1)
            a.send_signal(signal.SIGSTOP)
            time.sleep(0.5)
        finally:
            feed.finish()
        code = b.wait(60)
        out = b.output()[1]
        assert code == 1, b.describe()
        held = [p for p in assignments(a)[-1]]
        for p in held:
            assert p in out, f"the summary must name {p} (held by the paused member):\n{out[-3000:]}"
        assert "behind" in out
        summary = orjson.loads((tmp_path / "b.json").read_bytes())
        left = summary["pipelines"]["orders"]["undrained"]
        assert {f"{e['topic']}[{e['partition']}]" for e in left} == set(held)
        assert all(e["behind"] > 0 for e in left)
    finally:
        a.send_signal(signal.SIGCONT)
        a.kill9()
