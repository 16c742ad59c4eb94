"""End-to-end pipeline tests: ``python -m ingest`` against the real broker and PostgreSQL.

Every test runs ingest as a subprocess with a config from ``write_config``
(fresh database, topic and consumer group per test) and checks end states
against ground truth: the table holds exactly one row per key with the value
of the key's last record, committed offsets equal the true log end (or exactly
what was written), and the ``--summary-json`` counters agree.

Random choices (kill moments, record mix) come from one seed per test, printed
at the start; set ``INGEST_TEST_SEED`` to replay one.
"""

from __future__ import annotations

import os
import random
import signal
import time

import orjson
import psycopg
import pytest
from harness import run_ingest, start_ingest
from harness.kafka import committed_offsets, end_offsets, produce
from pipeline_helpers import (
    PIPELINE,
    OrderGen,
    SteadyProducer,
    assert_committed_at_log_end,
    assert_table_equals,
    assignments,
    count_rows,
    dlq_rows,
    expected_from_log,
    last_values,
    log_events,
    max_seq,
    order_key,
    order_value,
    pipeline_config,
    read_summary,
    read_topic,
    row_of,
    run_args,
    wait_assigned,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(240)


def _seed(name: str) -> int:
    seed = int(os.environ.get("INGEST_TEST_SEED") or time.time_ns() % 2**31)
    print(f"{name}: seed {seed}")
    return seed


def _ok(res) -> None:
    assert res.returncode == 0, f"ingest exited {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n" \
                                f"--- stderr ---\n{res.stderr[-6000:]}"


# --------------------------------------------------------------------------- 1. bulk, clean run


def test_bulk_upserts_last_value_per_key(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """100k records over 6 partitions with ~20 % updates and ~2 % exact duplicates, one clean run."""
    n = 100_000
    topic = new_topic(6)
    gen = OrderGen(_seed("bulk"), update_frac=0.2, dup_frac=0.02)
    records = gen.next(n)
    # Produce in chunks so the log holds many producer batches per partition.
    for i in range(0, n, 20_000):
        assert produce(kafka_bootstrap, topic, records[i:i + 20_000]) == len(records[i:i + 20_000])
    expected = last_values(records)  # a key maps to one partition: produce order == log order per key
    assert len(expected) < n * 0.8  # the mix really has updates and duplicates

    # Lanes by the JSON ordering key (same bytes as the Kafka key, str(order_id)).
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=4, key="$.order_id",
    ))
    summary_path = tmp_path / "summary.json"
    started = time.monotonic()
    res = run_ingest(run_args(config, until_idle=3, summary=summary_path), timeout_s=150, log_dir=tmp_path)
    elapsed = time.monotonic() - started
    _ok(res)

    assert_table_equals(pg_dsn, expected)
    committed = assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert sum(committed.values()) == n
    assert len(committed) == 6

    summary = read_summary(summary_path)
    stats = summary["pipelines"][PIPELINE]
    assert summary["errors"] == {}
    assert stats["records_consumed"] == n
    assert stats["dead_lettered"] == 0
    assert stats["skipped"] == 0
    # Rows are collapsed by key inside each batch: between one per key and one per record.
    assert len(expected) <= stats["rows_written"] <= n
    assert stats["batches"] >= 1 and stats["commits"] >= 1
    assert dlq_rows(pg_dsn) == []
    print(f"bulk: {n} records, {len(expected)} keys, run {elapsed:.1f}s, rate {stats['rate_per_s']}/s")


# --------------------------------------------------------------------------- 2. SIGKILL and restart


@pytest.mark.slow
def test_sigkill_restarts_lose_and_duplicate_nothing(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """SIGKILL ingest at random moments while it ingests (3 times), restart each time, then
    drain with --until-idle: every key has its last value and committed == log end."""
    total = 60_000
    kills = 3
    seed = _seed("sigkill")
    rng = random.Random(seed)
    topic = new_topic(6)
    gen = OrderGen(seed, update_frac=0.25, dup_frac=0.02)
    produced = produce(kafka_bootstrap, topic, gen.next(12_000))
    # Small batches over 4 lanes: many transactions and commits in flight at any moment.
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=4,
        batch={"max_rows": 300, "max_latency_ms": 200},
    ))
    # A live stream throughout, plus a backlog that piles up while ingest is down.
    producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=100, interval_s=0.1)
    producer.start()
    seen_at_kill = []
    try:
        for i in range(kills):
            if i:
                produced += produce(kafka_bootstrap, topic, gen.next(6_000))
            proc = start_ingest(run_args(config), log_dir=tmp_path)
            # A member killed before its assignment would not wedge the group, but the point
            # is to kill while records are being written: wait for the assignment and for
            # newer records than before the start to reach the table.
            newest = max_seq(pg_dsn)
            wait_assigned(proc, timeout_s=90)
            wait_until(lambda: max_seq(pg_dsn) > newest, 60, what="new rows being written", proc=proc)
            time.sleep(rng.uniform(1.0, 4.0))
            seen_at_kill.append(count_rows(pg_dsn))
            assert proc.poll() is None, f"ingest exited on its own before kill {i + 1}\n{proc.describe()}"
            proc.kill9()
            assert proc.returncode == -signal.SIGKILL
    finally:
        produced += producer.finish()
    if produced < total:
        produced += produce(kafka_bootstrap, topic, gen.next(total - produced))

    summary_path = tmp_path / "summary.json"
    res = run_ingest(run_args(config, until_idle=3, summary=summary_path), timeout_s=150, log_dir=tmp_path)
    _ok(res)

    log = read_topic(kafka_bootstrap, topic)
    assert sum(len(m) for m in log.values()) == produced
    expected = expected_from_log(log)
    assert_table_equals(pg_dsn, expected)  # count == distinct keys, each with its last value
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert dlq_rows(pg_dsn) == []
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["dead_lettered"] == 0
    print(f"sigkill: {produced} records, {len(expected)} keys; rows at each kill {seen_at_kill}; "
          f"final run read {stats['records_consumed']} records")


# --------------------------------------------------------------------------- 3. SIGTERM with a partial batch


def test_sigterm_flushes_partial_batch_and_commits_exactly_what_was_written(
        kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """Batches that only a shutdown can flush (huge max_rows / max_latency_ms); SIGTERM mid-stream:
    exit 0 within shutdown_timeout_s, the partial batches are written, and the committed
    offsets cover exactly the records written."""
    shutdown_timeout_s = 15.0
    topic = new_topic(6)
    gen = OrderGen(_seed("sigterm"), update_frac=0.2, dup_frac=0.02)
    produce(kafka_bootstrap, topic, gen.next(20_000))
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 500_000, "max_bytes": 512 * 1024 * 1024, "max_latency_ms": 600_000},
        shutdown_timeout_s=shutdown_timeout_s,
    ))
    summary_path = tmp_path / "summary.json"
    proc = start_ingest(run_args(config, summary=summary_path), log_dir=tmp_path)
    producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=100, interval_s=0.05)
    producer.start()
    try:
        wait_assigned(proc, timeout_s=60)
        time.sleep(3)  # consume the backlog and some of the live stream
        # The partial batches sit in the buffer: nothing written, nothing committed yet.
        assert count_rows(pg_dsn) == 0
        # (Committing offset 0 -- "nothing handled yet" -- is allowed; anything higher is not.)
        early = committed_offsets(kafka_bootstrap, group_id, topic)
        assert all(off == 0 for off in early.values()), f"committed {early} before anything was written"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(shutdown_timeout_s + 30)
        finally:
            took = time.monotonic() - sent
    finally:
        produced = 20_000 + producer.finish()
    assert code == 0, proc.describe()
    assert took < shutdown_timeout_s, f"SIGTERM to exit took {took:.1f}s (shutdown_timeout_s={shutdown_timeout_s})"

    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    consumed = stats["records_consumed"]
    assert consumed > 0
    assert set(stats["flushes"]) == {"shutdown"}, stats["flushes"]  # only the shutdown flushed
    assert stats["dead_lettered"] == 0

    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    # A fresh group reads from offset 0, so the committed offset of a partition is the number
    # of its records consumed, and together they are all the records consumed.
    assert sum(committed.values()) == consumed, f"committed {committed} vs {consumed} consumed"
    log = read_topic(kafka_bootstrap, topic)
    assert sum(len(m) for m in log.values()) == produced
    # The table holds exactly the records below the committed offsets: nothing committed that
    # is not written, nothing written that is not committed (seq is unique per record).
    assert_table_equals(pg_dsn, expected_from_log(log, upto=committed))
    print(f"sigterm: consumed {consumed} of {produced} produced, exit after {took:.2f}s, "
          f"flushes {stats['flushes']}")


# --------------------------------------------------------------------------- 4. a member joins and leaves


@pytest.mark.slow
def test_second_consumer_joins_and_leaves(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """A second process joins the group mid-run and later leaves (SIGTERM) while a producer keeps
    writing; with an @offset version column the end state is complete and correct."""
    topic = new_topic(6)
    gen = OrderGen(_seed("rebalance"), update_frac=0.3, dup_frac=0.02)
    produce(kafka_bootstrap, topic, gen.next(40_000))
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 1000, "max_latency_ms": 300}, version_column=True,
    ))
    producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=200, interval_s=0.05)
    summary_a = tmp_path / "summary-a.json"
    summary_b = tmp_path / "summary-b.json"
    # A drains until idle; 10 s is far longer than any rebalance gap with these settings.
    a = start_ingest(run_args(config, until_idle=10, summary=summary_a), log_dir=tmp_path)
    producer.start()
    try:
        wait_assigned(a, timeout_s=60)
        time.sleep(2)
        b = start_ingest(run_args(config, summary=summary_b), log_dir=tmp_path)
        b_parts = wait_assigned(b, timeout_s=90)  # B holds partitions: safe to SIGTERM
        # A gave partitions up to B.
        wait_until(lambda: any(e.get("event") == "partitions revoked" for e in log_events(a)), 30,
                   what="A's revoke", proc=a)
        time.sleep(3)
        n_before = len(assignments(a))
        assert b.stop(signal.SIGTERM, timeout_s=30) == 0, b.describe()
        # A takes everything back.
        wait_until(lambda: len(assignments(a)) > n_before and len(assignments(a)[-1]) == 6, 60,
                   what="A re-assigned all 6 partitions", proc=a)
        time.sleep(2)
        assert a.poll() is None, f"A stopped while records were still arriving\n{a.describe()}"
    finally:
        produced = 40_000 + producer.finish()
    assert a.wait(90) == 0, a.describe()

    log = read_topic(kafka_bootstrap, topic)
    assert sum(len(m) for m in log.values()) == produced
    assert_table_equals(pg_dsn, expected_from_log(log, with_version=True), with_version=True)
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert dlq_rows(pg_dsn) == []
    sa = read_summary(summary_a)["pipelines"][PIPELINE]
    sb = read_summary(summary_b)["pipelines"][PIPELINE]
    assert sb["records_consumed"] > 0, "B was assigned partitions but consumed nothing"
    # Together they consumed everything at least once (re-delivery after a rebalance is allowed).
    assert sa["records_consumed"] + sb["records_consumed"] >= produced
    print(f"rebalance: produced {produced}; A consumed {sa['records_consumed']}, B {sb['records_consumed']} "
          f"(B held {b_parts})")


# --------------------------------------------------------------------------- 5. database connections killed


def test_postgres_connections_terminated_mid_run(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """pg_terminate_backend on every ingest connection, repeatedly, while it writes: the run
    retries, completes, and nothing is dead-lettered because of the outage."""
    topic = new_topic(6)
    gen = OrderGen(_seed("pgkill"), update_frac=0.2, dup_frac=0.02)
    produce(kafka_bootstrap, topic, gen.next(30_000))
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 100, "max_latency_ms": 200},
        retry={"max_attempts": 30, "initial_backoff_ms": 50, "max_backoff_ms": 1000},
    ))
    summary_path = tmp_path / "summary.json"
    proc = start_ingest(run_args(config, until_idle=3, summary=summary_path), log_dir=tmp_path)
    producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=100, interval_s=0.05)
    producer.start()
    terminated = []
    try:
        wait_assigned(proc, timeout_s=60)
        wait_until(lambda: count_rows(pg_dsn) > 0, 60, what="rows being written", proc=proc)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            # At least 3 rounds, 0.5 s apart; more (up to 20) until ingest has logged a retry,
            # so the outage is known to have hit a write in progress.
            for i in range(20):
                n = admin.execute(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()) t"
                ).fetchone()[0]
                terminated.append(n)
                time.sleep(0.5)
                retried = any(e.get("event") == "transient failure, retrying" for e in log_events(proc))
                if i >= 2 and retried:
                    break
        assert proc.poll() is None, f"ingest stopped during the outage\n{proc.describe()}"
    finally:
        produced = 30_000 + producer.finish()
    assert proc.wait(120) == 0, proc.describe()

    log = read_topic(kafka_bootstrap, topic)
    assert sum(len(m) for m in log.values()) == produced
    assert_table_equals(pg_dsn, expected_from_log(log))
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert dlq_rows(pg_dsn) == []
    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["dead_lettered"] == 0
    assert stats["retries"] > 0, stats
    print(f"pgkill: backends terminated per round {terminated}; retries {stats['retries']}; "
          f"consumed {stats['records_consumed']} of {produced}")


# --------------------------------------------------------------------------- 6. trickle: the time trigger


def test_trickle_records_flushed_by_latency(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """With max_latency_ms 300 and a big max_rows, single records still reach the table fast."""
    topic = new_topic(3)
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 10_000, "max_latency_ms": 300},
    ))
    summary_path = tmp_path / "summary.json"
    proc = start_ingest(run_args(config, summary=summary_path), log_dir=tmp_path)
    rng = random.Random(_seed("trickle"))
    wait_assigned(proc, timeout_s=60)

    def present(conn, order_id: int) -> bool:
        return conn.execute("SELECT 1 FROM orders WHERE order_id = %s", (order_id,)).fetchone() is not None

    latencies = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # Warm-up (untimed): the first fetch after an assignment also looks up start offsets.
        produce(kafka_bootstrap, topic, [(order_key(1), order_value(1, 1, rng))])
        wait_until(lambda: present(conn, 1), 30, interval_s=0.02, what="the warm-up record", proc=proc)
        for i in range(5):
            order_id = 100 + i
            t0 = time.monotonic()
            produce(kafka_bootstrap, topic, [(order_key(order_id), order_value(order_id, 100 + i, rng))])
            wait_until(lambda: present(conn, order_id), 30, interval_s=0.02,
                       what=f"record {order_id} in the table", proc=proc)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.3)
    assert proc.stop(signal.SIGTERM, timeout_s=30) == 0, proc.describe()
    print(f"trickle: produce-to-row latencies {[round(x, 3) for x in latencies]} s")
    assert all(lat < 2.0 for lat in latencies), latencies

    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["records_consumed"] == 6
    assert stats["flushes"].get("time", 0) >= 6, stats["flushes"]  # the time trigger did it
    assert "size" not in stats["flushes"] and "bytes" not in stats["flushes"]
    # Each record was produced alone, so the reported watermark is exact too.
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {
        p: e for p, e in end_offsets(kafka_bootstrap, topic).items() if e > 0}


# --------------------------------------------------------------------------- 7. poison records


POISON = [
    # (value, expected stage, expected error_class)
    (b'{"order_id": 900001, "status": "paid"', "decode", "invalid_json"),
    (b"not json at all", "decode", "invalid_json"),
    (orjson.dumps({"status": "paid", "seq": 1}), "map", "missing_field"),
    (orjson.dumps({"order_id": None, "status": "paid"}), "map", "missing_field"),
    (orjson.dumps({"order_id": [900002], "status": "paid"}), "map", "wrong_type"),
    (orjson.dumps({"order_id": 900003, "status": {"nested": True}}), "map", "wrong_type"),
    (orjson.dumps({"order_id": True, "status": "paid"}), "map", "wrong_type"),
]


def test_poison_records_go_to_dlq(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """Bad JSON, missing required fields and wrong types mixed into 1000 good records: the good
    ones land, each bad one is a DLQ row with the right stage/class and its bytes unchanged."""
    topic = new_topic(3)
    rng = random.Random(_seed("poison"))
    good = [(order_key(i), order_value(i, i, rng)) for i in range(1, 1001)]
    records = list(good)
    for j, (value, _, _) in enumerate(POISON):
        records.insert(rng.randrange(len(records) + 1), (f"poison-{j}".encode(), value))
    assert produce(kafka_bootstrap, topic, records) == len(records)

    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2, key="$.order_id",
        batch={"max_rows": 200, "max_latency_ms": 200},
    ))
    summary_path = tmp_path / "summary.json"
    res = run_ingest(run_args(config, until_idle=3, summary=summary_path), timeout_s=120, log_dir=tmp_path)
    _ok(res)

    assert_table_equals(pg_dsn, dict(row_of(v) for _, v in good))
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)

    where = {m.value: m for msgs in read_topic(kafka_bootstrap, topic).values() for m in msgs}
    dlq = dlq_rows(pg_dsn)
    by_value = {bytes(r["value"]): r for r in dlq}
    assert len(dlq) == len(POISON) == len(by_value), dlq
    for j, (value, stage, error_class) in enumerate(POISON):
        row = by_value.get(value)
        assert row is not None, f"poison record {value!r} not in the DLQ"
        m = where[value]
        assert (row["stage"], row["error_class"]) == (stage, error_class), (value, row)
        assert (row["pipeline"], row["topic"], row["partition"], row["offset"]) == (PIPELINE, topic, m.partition,
                                                                                    m.offset)
        assert bytes(row["key"]) == f"poison-{j}".encode()
        assert row["error_message"]
        assert row["attempts"] == 1 and row["status"] == "pending"

    stats = read_summary(summary_path)["pipelines"][PIPELINE]
    assert stats["records_consumed"] == len(records)
    assert stats["dead_lettered"] == len(POISON)
    assert stats["dead_lettered_by_class"] == {"decode/invalid_json": 2, "map/missing_field": 2,
                                               "map/wrong_type": 3}
    assert stats["rows_written"] == len(good)
