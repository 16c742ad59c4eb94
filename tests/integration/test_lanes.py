"""Lanes, backpressure, hot keys and unkeyed routing: ``python -m ingest run`` against the real
broker and PostgreSQL (issue 5).

- per-key order with ``lanes: 8``: every record carries its key's sequence number; a BEFORE
  UPDATE trigger logs any stale/out-of-order apply and an AFTER trigger keeps the history of
  applied seqs, checked to be strictly increasing per key;
- backpressure: a sink slowed by a statement-level ``pg_sleep`` and a 30k backlog against
  ``max_buffered_records: 2000``: consumption pauses (``paused_s > 0``), ``/metrics``
  ``ingest_buffered_records`` never exceeds the bound plus one consume batch, and the consumer
  keeps its group (one assignment, no revoke before shutdown);
- hot key: one key with 80 % of the records produces a "hot key" warning naming it; a uniform
  stream produces none;
- records without a key land with ``unkeyed: lane0`` and ``unkeyed: round_robin``.

Every test runs ingest as a subprocess with a fresh topic, group and database.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from harness import run_ingest, write_config
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    log_end_offsets,
    produce,
)
from harness.services import free_port

pytestmark = pytest.mark.timeout(120)

PIPELINE = "lanes"
TABLE = "kv"


def _seed(name: str) -> int:
    seed = int(os.environ.get("INGEST_TEST_SEED") or time.time_ns() % 2**31)
    print(f"{name}: seed {seed}")
    return seed


# --------------------------------------------------------------------------- helpers


def _config(bootstrap: str, topic: str, group: str, dsn: str, *, columns: dict[str, Any], conflict_key: list[str],
            lanes: int, batch: dict[str, Any] | None = None, consume_batch_size: int | None = None,
            **pipeline_extra: Any) -> dict[str, Any]:
    pipeline: dict[str, Any] = {
        "name": PIPELINE,
        "topics": [topic],
        "group_id": group,
        "lanes": lanes,
        "commit_interval_ms": 200,
        "shutdown_timeout_s": 20,
        "sink": {"kind": "postgres", "dsn": dsn, "table": TABLE, "conflict_key": conflict_key, "columns": columns},
        **pipeline_extra,
    }
    if batch:
        pipeline["batch"] = batch
    kafka: dict[str, Any] = {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)}
    if consume_batch_size is not None:
        kafka["consume_batch_size"] = consume_batch_size
    return {"kafka": kafka, "pipelines": [pipeline]}


#: Keyed records: the Kafka key is the table key, the value carries the key's sequence number.
SEQ_COLUMNS = {
    "k": {"type": "text", "source": "@key", "required": True},
    "seq": {"type": "bigint", "source": "$.seq", "required": True},
    "pad": {"type": "text", "source": "$.pad"},
}
#: Unkeyed records: the table key comes from the value.
ID_COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "pad": {"type": "text", "source": "$.pad"},
}


def _migrate(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = write_config(tmp_path, config)
    res = run_ingest(["migrate", "--config", path], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, f"ingest migrate failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return path


def _run_args(config: Path, summary: Path, *, until_idle: float = 3, metrics_port: int = 0) -> list[Any]:
    return ["run", "--config", config, "--until-idle", str(until_idle), "--summary-json", summary,
            "--metrics-port", str(metrics_port)]


def _ok(res) -> None:
    assert res.returncode == 0, (f"ingest exited {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n"
                                 f"--- stderr ---\n{res.stderr[-6000:]}")


def _events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _stats(summary: Path) -> dict[str, Any]:
    doc = json.loads(summary.read_text())
    assert doc["errors"] == {}, doc["errors"]
    return doc["pipelines"][PIPELINE]


def _assert_committed_at_log_end(bootstrap: str, group: str, topic: str, total: int) -> None:
    ends = log_end_offsets(bootstrap, topic)
    committed = committed_offsets(bootstrap, group, topic)
    want = {p: e for p, e in ends.items() if e > 0}
    assert committed == want, f"committed {committed} != true log end {want}"
    assert sum(want.values()) == total


def _install_slow_sink(dsn: str, seconds: float) -> None:
    """Every INSERT statement into the sink table (one per batch) sleeps ``seconds``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""
            CREATE FUNCTION slow_sink_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$;
            CREATE TRIGGER slow_sink_trg AFTER INSERT ON {TABLE}
                FOR EACH STATEMENT EXECUTE FUNCTION slow_sink_fn();
        """)


def _count(dsn: str, sql: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchone()[0]


# --------------------------------------------------------------------------- 1. per-key order, lanes = 8


def _install_order_audit(dsn: str) -> None:
    """``kv_stale``: every update whose seq is not newer than the stored one (BEFORE UPDATE, per row).
    ``kv_history``: every applied (k, seq), in apply order (AFTER INSERT OR UPDATE, per row)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""
            CREATE TABLE kv_stale (id bigserial PRIMARY KEY, k text, old_seq bigint, new_seq bigint);
            CREATE TABLE kv_history (id bigserial PRIMARY KEY, k text, seq bigint);
            CREATE FUNCTION kv_stale_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.seq <= OLD.seq THEN
                    INSERT INTO kv_stale (k, old_seq, new_seq) VALUES (NEW.k, OLD.seq, NEW.seq);
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER kv_stale_trg BEFORE UPDATE ON {TABLE} FOR EACH ROW EXECUTE FUNCTION kv_stale_fn();
            CREATE FUNCTION kv_history_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO kv_history (k, seq) VALUES (NEW.k, NEW.seq); RETURN NULL; END $$;
            CREATE TRIGGER kv_history_trg AFTER INSERT OR UPDATE ON {TABLE}
                FOR EACH ROW EXECUTE FUNCTION kv_history_fn();
        """)


def test_lanes_keep_per_key_order(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """50k records over 200 keys, each key's records numbered 1..n in produce order, lanes = 8:
    no stale or out-of-order apply, every key ends at its last seq, committed == log end."""
    n, n_keys, lanes = 50_000, 200, 8
    rng = random.Random(_seed("order"))
    topic = new_topic(8)
    keys = [f"key-{i:03d}" for i in range(n_keys)]
    seq: Counter[str] = Counter()
    records = []
    for _ in range(n):
        k = keys[rng.randrange(n_keys)]
        seq[k] += 1
        records.append((k.encode(), orjson.dumps({"seq": seq[k], "pad": "x" * 40})))
    for i in range(0, n, 10_000):  # many producer batches per partition
        produce(kafka_bootstrap, topic, records[i:i + 10_000])

    # Small batches: in-batch dedupe keeps the last record per key, so small batches mean many
    # applies per key (and many batches of one lane in flight behind each other).
    config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=SEQ_COLUMNS,
                                        conflict_key=["k"], lanes=lanes,
                                        batch={"max_rows": 50, "max_latency_ms": 100}))
    _install_order_audit(pg_dsn)
    summary = tmp_path / "summary.json"
    started = time.monotonic()
    res = run_ingest(_run_args(config, summary), timeout_s=100, log_dir=tmp_path)
    elapsed = time.monotonic() - started
    _ok(res)

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        stale = conn.execute("SELECT k, old_seq, new_seq FROM kv_stale ORDER BY id LIMIT 10").fetchall()
        backwards = conn.execute("""
            SELECT k, seq, prev FROM (
                SELECT k, seq, lag(seq) OVER (PARTITION BY k ORDER BY id) AS prev FROM kv_history
            ) t WHERE prev >= seq LIMIT 10""").fetchall()
        applies = conn.execute("SELECT count(*) FROM kv_history").fetchone()[0]
        final = dict(conn.execute(f"SELECT k, seq FROM {TABLE}").fetchall())
    assert stale == [], f"stale / out-of-order applies (key, stored seq, incoming seq): {stale}"
    assert backwards == [], f"applied seqs not strictly increasing (key, seq, previous seq): {backwards}"
    assert final == dict(seq), (f"final seq per key differs for "
                                f"{[(k, final.get(k), v) for k, v in seq.items() if final.get(k) != v][:10]}")
    # The check is not vacuous: many applies per key, not one per key.
    assert applies >= 20 * n_keys, f"only {applies} applies for {n_keys} keys"
    _assert_committed_at_log_end(kafka_bootstrap, group_id, topic, n)
    stats = _stats(summary)
    assert stats["records_consumed"] == n
    assert stats["dead_lettered"] == 0
    # the lanes' writing time and the planning time, which the summary reports beside the busy window
    assert 0 < stats["lane_write_s"] <= lanes * stats["busy_s"] + 1 and stats["prepare_s"] > 0
    print(f"order: {n} records, {n_keys} keys, lanes {lanes}: {applies} applies, {stats['batches']} batches, "
          f"run {elapsed:.1f}s, rate {stats['rate_per_s']}/s")


# --------------------------------------------------------------------------- 2. backpressure


class MetricsScraper(threading.Thread):
    """Reads ``ingest_buffered_records`` from ``/metrics`` every ``interval_s`` until stopped."""

    _LINE = re.compile(r'^ingest_buffered_records\{pipeline="' + PIPELINE + r'"\}\s+(\S+)$', re.M)

    def __init__(self, port: int, interval_s: float = 0.05) -> None:
        super().__init__(name="metrics-scraper", daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=1) as resp:
                    m = self._LINE.search(resp.read().decode())
                if m:
                    self.samples.append(float(m.group(1)))
            except OSError:
                pass  # not up yet / already gone
            self._stop_event.wait(self.interval_s)

    def finish(self) -> list[float]:
        self._stop_event.set()
        self.join(5)
        return self.samples


def test_backpressure_pauses_without_rebalance(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """A 30k backlog into a sink that sleeps 50 ms per batch, max_buffered_records 2000: the run
    completes correctly, pauses (paused_s > 0), stays within max_buffered_records + one consume
    batch in flight, and is never rebalanced while paused."""
    n, max_buffered, consume_batch = 30_000, 2000, 500
    topic = new_topic(6)
    records = [(f"k{i % 3000}".encode(), orjson.dumps({"seq": i // 3000 + 1, "pad": "y" * 60})) for i in range(n)]
    produce(kafka_bootstrap, topic, records)
    config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=SEQ_COLUMNS,
                                        conflict_key=["k"], lanes=4, consume_batch_size=consume_batch,
                                        batch={"max_rows": 250, "max_latency_ms": 100},
                                        max_buffered_records=max_buffered))
    _install_slow_sink(pg_dsn, 0.05)
    port = free_port()
    scraper = MetricsScraper(port)
    summary = tmp_path / "summary.json"
    scraper.start()
    try:
        res = run_ingest(_run_args(config, summary, metrics_port=port), timeout_s=100, log_dir=tmp_path)
    finally:
        samples = scraper.finish()
    _ok(res)

    assert _count(pg_dsn, f"SELECT count(*) FROM {TABLE}") == 3000
    assert _count(pg_dsn, f"SELECT count(*) FROM {TABLE} WHERE seq = 10") == 3000  # every key at its last seq
    _assert_committed_at_log_end(kafka_bootstrap, group_id, topic, n)
    stats = _stats(summary)
    assert stats["records_consumed"] == n
    assert stats["paused_s"] > 0, f"never paused: {stats}"

    events = _events(res.stderr)
    names = [e.get("event") for e in events]
    assert "backpressure: pausing" in names
    stop_at = names.index("idle, stopping") if "idle, stopping" in names else len(names)
    before_stop = names[:stop_at]
    assert before_stop.count("partitions assigned") == 1, f"assignments: {before_stop.count('partitions assigned')}"
    assert "partitions revoked" not in before_stop and "partitions lost" not in before_stop, \
        "rebalanced during the run"
    assigned = next(e for e in events if e.get("event") == "partitions assigned")
    assert len(assigned.get("partitions") or []) == 6

    assert samples, "no /metrics sample of ingest_buffered_records"
    bound = max_buffered + consume_batch
    assert max(samples) <= bound, f"in flight {max(samples)} > {bound}"
    print(f"backpressure: paused {stats['paused_s']}s, {names.count('backpressure: pausing')} pauses, "
          f"rate {stats['rate_per_s']}/s; /metrics in flight max {max(samples):.0f} over {len(samples)} "
          f"samples (bound {bound})")


def test_long_pause_keeps_group_membership(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """Each batch takes 8 s to write and one batch fills the buffer, so consumption stays paused for
    ~8 s at a time -- longer than session.timeout.ms (6 s) and max.poll.interval.ms (7 s here). The
    consumer keeps polling while paused, so it is never kicked out: one assignment, no revoke."""
    n, max_buffered = 1000, 500
    topic = new_topic(2)
    produce(kafka_bootstrap, topic, [(f"k{i}".encode(), orjson.dumps({"seq": 1, "pad": "p"})) for i in range(n)])
    cfg = _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=SEQ_COLUMNS, conflict_key=["k"], lanes=1,
                  consume_batch_size=max_buffered, batch={"max_rows": max_buffered, "max_latency_ms": 1000},
                  max_buffered_records=max_buffered, shutdown_timeout_s=60)
    cfg["kafka"]["client"]["max.poll.interval.ms"] = 7000
    config = _migrate(tmp_path, cfg)
    _install_slow_sink(pg_dsn, 8.0)
    summary = tmp_path / "summary.json"
    res = run_ingest(_run_args(config, summary), timeout_s=100, log_dir=tmp_path)
    _ok(res)
    stats = _stats(summary)
    names = [e.get("event") for e in _events(res.stderr)]
    assert stats["records_consumed"] == n, (
        f"--until-idle stopped after {stats['records_consumed']} of {n} records (exit 0): the time spent paused "
        f"by backpressure was counted as idle; events: {names}")
    assert _count(pg_dsn, f"SELECT count(*) FROM {TABLE}") == n
    _assert_committed_at_log_end(kafka_bootstrap, group_id, topic, n)
    pauses = names.count("backpressure: pausing")
    assert pauses >= 1
    # On average (so at least once) a pause outlasted the session timeout and the poll interval.
    assert stats["paused_s"] / pauses > 7.0, f"paused {stats['paused_s']}s in {pauses} pauses"
    before_stop = names[:names.index("idle, stopping")] if "idle, stopping" in names else names
    assert before_stop.count("partitions assigned") == 1
    assert "partitions revoked" not in before_stop and "partitions lost" not in before_stop
    errors = [e for e in names if "kafka consumer error" in str(e)]  # e.g. max.poll.interval.ms exceeded
    assert errors == [], errors[:5]
    print(f"long pause: paused {stats['paused_s']}s in {pauses} pauses, one assignment, no revoke")


# --------------------------------------------------------------------------- 3. hot keys


@pytest.mark.parametrize("hot", [True, False], ids=["one-hot-key", "uniform"])
def test_hot_key_warning(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path, hot):
    """80 % of the records on one key (lanes 4, 1 s intervals) → a "hot key" warning naming it;
    a uniform stream over 1000 keys → none."""
    n = 30_000
    rng = random.Random(_seed("hot"))
    topic = new_topic(6)
    records = []
    for i in range(n):
        k = "the-hot-key" if hot and rng.random() < 0.8 else f"cold-{rng.randrange(1000)}"
        records.append((k.encode(), orjson.dumps({"seq": i, "pad": "z" * 40})))
    produce(kafka_bootstrap, topic, records)
    config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=SEQ_COLUMNS,
                                        conflict_key=["k"], lanes=4,
                                        batch={"max_rows": 1000, "max_latency_ms": 100},
                                        hot_key_interval_s=1))
    summary = tmp_path / "summary.json"
    res = run_ingest(_run_args(config, summary), timeout_s=100, log_dir=tmp_path)
    _ok(res)
    assert _stats(summary)["records_consumed"] == n
    _assert_committed_at_log_end(kafka_bootstrap, group_id, topic, n)

    warnings = [e for e in _events(res.stderr) if str(e.get("event", "")).startswith("hot key")]
    if hot:
        assert warnings, "no hot key warning for a key with 80 % of the records"
        assert {e.get("key") for e in warnings} == {"the-hot-key"}, warnings[:5]
        assert all(e.get("share", 0) > 0.5 for e in warnings), warnings[:5]
        print(f"hot key: {len(warnings)} warnings, e.g. {warnings[0]}")
    else:
        assert warnings == [], f"hot key warning for a uniform stream: {warnings[:5]}"


def test_cyclic_keys_are_not_reported_hot(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """16 keys produced in strict rotation into one partition, lanes 4 with exactly 4 keys per lane:
    every key is 1/16 of the traffic and 1/4 of its lane's, so none is hot. (A sampler that takes
    every 16th record sees one key only and reports it hot.)"""
    from ingest.core.routing import stable_hash

    keys = [f"sensor-{i:02d}" for i in range(16)]
    assert Counter(stable_hash(k.encode()) % 4 for k in keys) == {0: 4, 1: 4, 2: 4, 3: 4}  # premise
    n = 32_000
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(keys[i % 16].encode(), orjson.dumps({"seq": i, "pad": "c" * 40}))
                                     for i in range(n)])
    config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=SEQ_COLUMNS,
                                        conflict_key=["k"], lanes=4,
                                        batch={"max_rows": 1000, "max_latency_ms": 100},
                                        hot_key_interval_s=1))
    summary = tmp_path / "summary.json"
    res = run_ingest(_run_args(config, summary), timeout_s=100, log_dir=tmp_path)
    _ok(res)
    assert _stats(summary)["records_consumed"] == n
    warnings = [e for e in _events(res.stderr) if str(e.get("event", "")).startswith("hot key")]
    assert warnings == [], (f"{len(warnings)} hot key warnings for keys that each hold 1/4 of their lane: "
                            f"{[(e.get('lane'), e.get('key'), e.get('share')) for e in warnings[:5]]}")


# --------------------------------------------------------------------------- 4. unkeyed records


@pytest.mark.parametrize("unkeyed", ["lane0", "round_robin"])
def test_unkeyed_records_all_land(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path, unkeyed):
    """Records without a Kafka key, lanes 4: every record lands with either unkeyed policy."""
    n = 20_000
    topic = new_topic(6)
    produce(kafka_bootstrap, topic, [(None, orjson.dumps({"id": i, "pad": "u" * 40})) for i in range(n)])
    config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=ID_COLUMNS,
                                        conflict_key=["id"], lanes=4, unkeyed=unkeyed, hot_key_interval_s=1,
                                        batch={"max_rows": 500, "max_latency_ms": 100}))
    summary = tmp_path / "summary.json"
    res = run_ingest(_run_args(config, summary), timeout_s=100, log_dir=tmp_path)
    _ok(res)
    assert _count(pg_dsn, f"SELECT count(*) FROM {TABLE}") == n
    assert _count(pg_dsn, f"SELECT count(DISTINCT id) FROM {TABLE} WHERE id BETWEEN 0 AND {n - 1}") == n
    _assert_committed_at_log_end(kafka_bootstrap, group_id, topic, n)
    stats = _stats(summary)
    assert stats["records_consumed"] == n and stats["dead_lettered"] == 0
    warnings = [e for e in _events(res.stderr) if str(e.get("event", "")).startswith(("hot key", "hot lane"))]
    if unkeyed == "lane0":
        # Everything is queued on lane 0: any hot-key / hot-lane warning can only name lane 0.
        assert all(e.get("lane") == 0 for e in warnings), warnings[:5]
    else:
        # Spread evenly: no lane holds most of the backlog.
        assert [e for e in warnings if e["event"].startswith("hot lane")] == [], warnings[:5]


def test_unkeyed_round_robin_is_not_a_hot_key(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """With ``unkeyed: round_robin`` records without a key are spread over every lane, so they are not
    "one key [whose] records cannot be parallelised": no hot key warning for them. (With
    ``unkeyed: lane0`` such a warning is accurate: they do pin lane 0.)"""
    n = 40_000
    topic = new_topic(6)
    produce(kafka_bootstrap, topic, [(None, orjson.dumps({"id": i, "pad": "r" * 40})) for i in range(n)])
    config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, pg_dsn, columns=ID_COLUMNS,
                                        conflict_key=["id"], lanes=4, unkeyed="round_robin", hot_key_interval_s=1,
                                        batch={"max_rows": 500, "max_latency_ms": 100}))
    summary = tmp_path / "summary.json"
    res = run_ingest(_run_args(config, summary), timeout_s=100, log_dir=tmp_path)
    _ok(res)
    assert _count(pg_dsn, f"SELECT count(*) FROM {TABLE}") == n
    warnings = [e for e in _events(res.stderr) if str(e.get("event", "")).startswith("hot key")]
    assert warnings == [], (f"round-robin unkeyed records reported as a hot key: "
                            f"{[(e.get('lane'), e.get('key'), e.get('share')) for e in warnings[:5]]}")
