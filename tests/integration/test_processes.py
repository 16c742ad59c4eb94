"""``ingest run --processes 2`` against the real broker and PostgreSQL.

Two worker processes share the partitions of one 6-partition topic through
the consumer group protocol. Child output is the parent's output: every JSON
log line of a child carries ``"process": <index>``, which is how these tests
tell the children apart (and the per-child ``--summary-json PATH.<index>``).

Broker quirk (Tansu): a member that leaves before its first assignment wedges
the group, so the SIGTERM test signals only once both children hold partitions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import IngestProcess, run_ingest, start_ingest
from harness.kafka import committed_offsets, produce
from pipeline_helpers import (
    PIPELINE,
    TABLE,
    OrderGen,
    SteadyProducer,
    assert_committed_at_log_end,
    assert_table_equals,
    dlq_rows,
    expected_from_log,
    last_values,
    pipeline_config,
    read_summary,
    read_topic,
    run_args,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(180)


def _seed(name: str) -> int:
    seed = int(os.environ.get("INGEST_TEST_SEED") or time.time_ns() % 2**31)
    print(f"{name}: seed {seed}")
    return seed


def _events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _assignments(events: Iterable[dict[str, Any]]) -> dict[int, list[list[str]]]:
    """Per child process index, its ``partitions assigned`` events in order."""
    out: dict[int, list[list[str]]] = {}
    for e in events:
        if e.get("event") == "partitions assigned" and "process" in e:
            out.setdefault(e["process"], []).append(list(e.get("partitions") or []))
    return out


def _numbers(partitions: list[str]) -> list[int]:
    """``["topic[3]", ...]`` -> ``[3, ...]`` (for short test output)."""
    return [int(p.rsplit("[", 1)[-1].rstrip("]")) for p in partitions]


def _install_audit(dsn: str) -> None:
    """Record every row version the sink writes: (order_id, seq) per INSERT or UPDATE."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders_audit (id bigserial PRIMARY KEY, order_id bigint, seq bigint)")
        conn.execute(f"""
            CREATE FUNCTION orders_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO orders_audit (order_id, seq) VALUES (NEW.order_id, NEW.seq); RETURN NEW; END $$;
            CREATE TRIGGER orders_audit_trg AFTER INSERT OR UPDATE ON {TABLE}
                FOR EACH ROW EXECUTE FUNCTION orders_audit_fn();
        """)


def _assert_each_record_written_at_most_once(dsn: str) -> int:
    """No record (unique seq) was applied twice, and each key's versions were applied in seq order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        twice = conn.execute(
            "SELECT seq, count(*) FROM orders_audit GROUP BY seq HAVING count(*) > 1 LIMIT 5").fetchall()
        backwards = conn.execute("""
            SELECT order_id, seq, prev FROM (
                SELECT order_id, seq, lag(seq) OVER (PARTITION BY order_id ORDER BY id) AS prev FROM orders_audit
            ) t WHERE prev >= seq LIMIT 5""").fetchall()
        n = conn.execute("SELECT count(*) FROM orders_audit").fetchone()[0]
    assert twice == [], f"records written more than once (seq, times): {twice}"
    assert backwards == [], f"a key's versions applied out of order (order_id, seq, previous seq): {backwards}"
    return n


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are free (children bind base + index)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            base = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("0.0.0.0", base))
                b.bind(("0.0.0.0", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports")


def _readyz(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 carries the same document
        return json.loads(exc.read())
    except OSError:
        return None


def _both_hold_partitions(proc: IngestProcess, partitions: int) -> dict[int, list[str]] | None:
    """The latest assignment of each child once both hold partitions and together hold all, disjointly."""
    latest = {i: a[-1] for i, a in _assignments(_events(proc.output()[1])).items()}
    if sorted(latest) != [0, 1] or not all(latest.values()):
        return None
    held = latest[0] + latest[1]
    if len(held) != partitions or len(set(held)) != partitions:
        return None
    return latest


# --------------------------------------------------------------------------- 1. backlog, until idle


def test_two_processes_share_the_partitions_and_write_each_record_once(
        kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    n = 30_000
    topic = new_topic(6)
    # No exact duplicates: every record has its own seq, so the audit can tell a second write.
    gen = OrderGen(_seed("processes-backlog"), update_frac=0.3, dup_frac=0.0)
    records = gen.next(n)
    for i in range(0, n, 10_000):
        produce(kafka_bootstrap, topic, records[i:i + 10_000])
    expected = last_values(records)
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 1000, "max_latency_ms": 200},
    ))
    _install_audit(pg_dsn)
    summary_path = tmp_path / "summary.json"
    started = time.monotonic()
    res = run_ingest([*run_args(config, until_idle=3, summary=summary_path), "--processes", "2",
                      "--metrics-port", "0"], timeout_s=120, log_dir=tmp_path)
    elapsed = time.monotonic() - started
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-6000:]}"

    events = _events(res.stderr)
    assigned = _assignments(events)
    assert sorted(assigned) == [0, 1], f"assignments per child: {assigned}"
    for index, history in assigned.items():
        assert any(history), f"child {index} never held a partition: {history}"
    print(f"assignments per child: { {i: [_numbers(a) for a in h] for i, h in assigned.items()} }")

    # Each record is written once: the table holds every key's last value, the audit shows no
    # record applied twice (two members never held one partition at once), nothing dead-lettered.
    assert_table_equals(pg_dsn, expected)
    applied = _assert_each_record_written_at_most_once(pg_dsn)
    committed = assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    assert sum(committed.values()) == n
    assert dlq_rows(pg_dsn) == []

    summary = read_summary(summary_path)
    assert [p["exit_code"] for p in summary["processes"]] == [0, 0]
    assert [p["restarts"] for p in summary["processes"]] == [0, 0]
    children = [read_summary(Path(f"{summary_path}.{i}"))["pipelines"][PIPELINE] for i in range(2)]
    consumed = [c["records_consumed"] for c in children]
    # Revokes commit what was handled before the partitions move, so nothing is read twice.
    assert sum(consumed) == n, f"consumed per child {consumed}, produced {n}"
    assert summary["pipelines"][PIPELINE]["records_consumed"] == n
    assert summary["pipelines"][PIPELINE]["dead_lettered"] == 0
    assert summary["errors"] == {}
    print(f"processes backlog: {n} records, {len(expected)} keys, {applied} row versions applied, "
          f"consumed per child {consumed}, run {elapsed:.1f}s")


# --------------------------------------------------------------------------- 2. SIGTERM to the parent


def test_sigterm_to_the_parent_stops_both_children_with_a_final_commit(
        kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    topic = new_topic(6)
    gen = OrderGen(_seed("processes-sigterm"), update_frac=0.3, dup_frac=0.0)
    backlog = produce(kafka_bootstrap, topic, gen.next(20_000))
    config = write_and_migrate(tmp_path, pipeline_config(
        bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn, lanes=2,
        batch={"max_rows": 500, "max_latency_ms": 300}, shutdown_timeout_s=15,
    ))
    _install_audit(pg_dsn)
    summary_path = tmp_path / "summary.json"
    base_port = _free_port_pair()
    proc = start_ingest([*run_args(config, summary=summary_path), "--processes", "2",
                         "--metrics-port", str(base_port)], log_dir=tmp_path)
    producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=100, interval_s=0.05)
    producer.start()
    try:
        # Signal only once both children hold partitions (see the module docstring).
        held = wait_until(lambda: _both_hold_partitions(proc, 6), 60, what="both children assigned", proc=proc)
        # Each child serves its own endpoint on base + index and reports its share.
        ready = {i: wait_until(lambda i=i: _readyz(base_port + i), 10, what=f"/readyz of child {i}", proc=proc)
                 for i in range(2)}
        for i in range(2):
            assert ready[i]["pipelines"][PIPELINE]["assigned_partitions"] == len(held[i]), (i, ready[i], held)
        time.sleep(2)  # writing the backlog and the live stream
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(45)
        took = time.monotonic() - sent
    finally:
        produced = backlog + producer.finish()
    assert code == 0, proc.describe()

    events = _events(proc.output()[1])
    stops = sorted(e["process"] for e in events if e.get("event") == "signal received: stopping" and "process" in e)
    assert stops == [0, 1], f"each child must get the signal exactly once: {stops}"

    summary = read_summary(summary_path)
    assert [p["exit_code"] for p in summary["processes"]] == [0, 0]
    children = [p["summary"]["pipelines"][PIPELINE] for p in summary["processes"]]
    assert all(c["records_consumed"] > 0 for c in children), children
    assert all(c["commits"] >= 1 for c in children), children
    assert all(c["dead_lettered"] == 0 for c in children), children
    consumed = sum(c["records_consumed"] for c in children)

    # The final commits cover exactly what was written, per partition: the table equals the log
    # below the committed offsets, and (fresh group, read from 0) they sum to what was consumed.
    committed = committed_offsets(kafka_bootstrap, group_id, topic)
    assert sum(committed.values()) == consumed, f"committed {committed} vs consumed {consumed}"
    log = read_topic(kafka_bootstrap, topic)
    assert sum(len(m) for m in log.values()) == produced
    assert_table_equals(pg_dsn, expected_from_log(log, upto=committed))
    _assert_each_record_written_at_most_once(pg_dsn)
    assert dlq_rows(pg_dsn) == []
    print(f"processes sigterm: held { {i: _numbers(a) for i, a in held.items()} }; consumed "
          f"{[c['records_consumed'] for c in children]} of {produced} produced; exit after {took:.2f}s")
