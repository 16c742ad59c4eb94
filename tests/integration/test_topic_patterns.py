"""A pattern subscription: one pipeline reads every topic a ``^`` pattern matches, new ones included.

Real broker, real PostgreSQL. The topics are named like a Debezium capture (``<prefix>.<schema>.<table>``
plus the ``<prefix>.transaction`` metadata topic, which the default ``exclude_topics`` leaves out).
Offsets stay per source topic-partition: every matched topic ends committed at its log end, the
excluded one has nothing committed, and the table equals the model of the matched topics.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import run_ingest, start_ingest
from harness.kafka import committed_offsets, create_topic, produce, unique_name

from pipeline_helpers import (
    OrderGen,
    assert_committed_at_log_end,
    assert_table_equals,
    count_rows,
    dlq_rows,
    expected_from_log,
    pipeline_config,
    read_topic,
    seed_for,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(240)


def test_a_pattern_takes_every_matching_topic_and_one_that_appears_mid_run(kafka_bootstrap, pg_dsn, group_id,
                                                                          tmp_path: Path):
    prefix = unique_name("shop")  # no dots: the prefix of a Debezium capture
    orders, returns, late = (f"{prefix}.public.orders", f"{prefix}.sales.returns", f"{prefix}.public.late")
    metadata = f"{prefix}.transaction"
    for topic in (orders, returns, metadata):
        create_topic(kafka_bootstrap, topic, 2)
    seed = seed_for("topic-patterns")
    gens = {orders: OrderGen(seed, first_id=1), returns: OrderGen(seed + 1, first_id=1_000_000),
            late: OrderGen(seed + 2, first_id=2_000_000)}
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=f"^{re.escape(prefix)}\\.", group=group_id, dsn=pg_dsn,
                          lanes=2, topic_refresh_s=1)
    config = write_and_migrate(tmp_path, cfg)

    res = run_ingest(["check", "--config", config], timeout_s=60, log_dir=tmp_path / "check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"topics matching ^{re.escape(prefix)}\\.: {orders}, {returns}" in res.stdout, res.stdout
    assert "write tier: columnar" in res.stdout, res.stdout  # lanes: 2 have the tier (issue #38)

    assert produce(kafka_bootstrap, orders, gens[orders].next(1500)) == 1500
    assert produce(kafka_bootstrap, returns, gens[returns].next(1000)) == 1000
    assert produce(kafka_bootstrap, metadata, OrderGen(seed + 3, first_id=3_000_000).next(50)) == 50
    proc = start_ingest(["run", "-c", config, "--until-idle", "8", "--metrics-port", "0"], log_dir=tmp_path)
    before = len(expected_from_log(read_topic(kafka_bootstrap, orders))) + len(
        expected_from_log(read_topic(kafka_bootstrap, returns)))
    wait_until(lambda: count_rows(pg_dsn) >= before, 90, what="the rows of the first two topics", proc=proc)

    create_topic(kafka_bootstrap, late, 2)  # a table captured after the run started
    assert produce(kafka_bootstrap, late, gens[late].next(800)) == 800
    try:
        proc.wait(150)
    except Exception:  # noqa: BLE001 - say where it hung
        proc.kill9()
        raise AssertionError(f"ingest did not finish\n{proc.describe()}") from None
    assert proc.returncode == 0, proc.describe()

    expected: dict[int, tuple] = {}
    for topic in (orders, returns, late):
        expected.update(expected_from_log(read_topic(kafka_bootstrap, topic)))
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert_table_equals(pg_dsn, expected)
    assert dlq_rows(pg_dsn) == []
    assert committed_offsets(kafka_bootstrap, group_id, metadata) == {}, "the excluded topic was read"
    assert "the topic patterns match a new set of topics" in proc.output()[1], proc.describe()


def test_lag_follows_the_pattern(kafka_bootstrap, group_id, tmp_path: Path):
    prefix = unique_name("lagpat")
    first, second = f"{prefix}.a", f"{prefix}.b"
    create_topic(kafka_bootstrap, first, 1)
    create_topic(kafka_bootstrap, second, 1)
    create_topic(kafka_bootstrap, f"{prefix}.transaction", 1)
    gen = OrderGen(seed_for("lag-pattern"))
    produce(kafka_bootstrap, first, gen.next(5))
    produce(kafka_bootstrap, second, gen.next(7))
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=f"^{re.escape(prefix)}\\.", group=group_id,
                          dsn="postgresql://postgres@127.0.0.1:1/unused")
    from harness import write_config

    config = write_config(tmp_path, cfg)
    res = run_ingest(["lag", "--config", config, "--format", "json"], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert first in res.stdout and second in res.stdout, res.stdout
    assert f"{prefix}.transaction" not in res.stdout, res.stdout


@pytest.mark.parametrize("topics", [["orders"], ["^orders"]], ids=["names", "pattern"])
def test_a_broker_that_never_answers_stops_the_run_within_its_bound(topics, tmp_path: Path):
    """No broker at the bootstrap address: the run exits 1 naming kafka.outage_timeout_s, with topic
    names and with a pattern alike (a pattern pipeline has nothing subscribed while it cannot list
    the topics, so librdkafka reports no outage of its own)."""
    from socket import socket

    with socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = pipeline_config(bootstrap=f"127.0.0.1:{port}", topic="x", group="g-never", dsn="postgresql://u@127.0.0.1:1/x")
    cfg["pipelines"][0]["topics"] = topics
    cfg["kafka"]["outage_timeout_s"] = 4
    from harness import write_config

    res = run_ingest(["run", "-c", write_config(tmp_path, cfg), "--metrics-port", "0"], timeout_s=90, log_dir=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert "kafka.outage_timeout_s" in res.stderr, res.stderr[-3000:]
