"""GET /status of a real ``ingest run`` (real broker, real PostgreSQL) through its states.

- running → paused by backpressure (the sink table locked, so writes wait and records pile up in
  flight) → draining (SIGTERM while the table is still locked) → exit 0 once it is released;
- held by a schema registry outage (the stand-in stopped) → running once it answers again;
- failed by the DLQ guard, read back while the process lingers (``--linger``), with the error
  class, the dead letters by class, the partition table and no secret of the config in the body.

Every wait is on a condition, never a fixed sleep.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from formats_helpers import format_config
from harness import run_ingest, start_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, committed_offsets, produce
from harness.metrics import get, metric
from harness.serde import avro_values
from pipeline_helpers import wait_until

pytestmark = pytest.mark.timeout(120)

SECRET = "st4tus-s3cret-pw"  # PostgreSQL here trusts loopback; the password is only there to be hidden


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with_password(dsn: str) -> str:
    assert dsn.startswith("postgresql://postgres@"), dsn
    return dsn.replace("postgresql://postgres@", f"postgresql://postgres:{SECRET}@", 1)


def _status(port: int) -> dict[str, Any] | None:
    try:
        code, body = get(port, "/status")
    except OSError:
        return None
    assert code == 200, body
    assert SECRET not in body.decode()
    return orjson.loads(body)


def _pipeline(port: int, name: str) -> dict[str, Any] | None:
    s = _status(port)
    return None if s is None else s["pipelines"].get(name)


def _in_state(port: int, name: str, state: str, **extra: Any):
    def check() -> dict[str, Any] | None:
        p = _pipeline(port, name)
        if p is None or p["state"] != state:
            return None
        return p if all(p.get(k) == v for k, v in extra.items()) else None
    return check


def _migrate(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = write_config(tmp_path, cfg)
    res = run_ingest(["migrate", "-c", path], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return path


def _json_config(bootstrap: str, dsn: str, topic: str, group: str, **pipeline: Any) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "st", "topics": [topic], "group_id": group, "lanes": 1, "commit_interval_ms": 200,
            "batch": {"max_rows": 20, "max_latency_ms": 50},
            "sink": {"kind": "postgres", "dsn": _with_password(dsn), "table": "st", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "v": {"type": "text"}}},
            **pipeline,
        }],
    }


def _good(start: int, n: int) -> list[tuple[bytes, bytes]]:
    return [(str(i).encode(), orjson.dumps({"id": i, "v": f"v{i}"})) for i in range(start, start + n)]


def test_running_paused_by_backpressure_then_draining(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=1)
    path = _migrate(tmp_path, _json_config(kafka_bootstrap, pg_dsn, topic, group_id, max_buffered_records=60))
    produce(kafka_bootstrap, topic, _good(0, 100))
    port = _free_port()
    proc = start_ingest(["run", "-c", path, "--metrics-port", str(port)], log_dir=tmp_path)
    running = wait_until(_in_state(port, "st", "running", lag=0), 60, what="running and caught up", proc=proc)
    wait_until(lambda: (p := _pipeline(port, "st")) and p["partitions"]
               and p["partitions"][0]["committed"] == 100, 30, what="offset 100 committed", proc=proc)
    assert running["partitions"][0]["topic"] == topic and running["error"] is None
    assert _status(port)["ok"] is True

    locker = psycopg.connect(pg_dsn, autocommit=False)
    try:
        locker.execute("LOCK TABLE st IN ACCESS EXCLUSIVE MODE")  # every write now waits
        produce(kafka_bootstrap, topic, _good(100, 300))
        paused = wait_until(_in_state(port, "st", "paused"), 60, what="paused by backpressure", proc=proc)
        assert paused["partitions"][0]["committed"] == 100
        _, raw = get(port, "/metrics")
        assert metric(raw.decode(), "ingest_pipeline_state", pipeline="st", state="paused") == 1
        assert _status(port)["ok"] is False
        proc.send_signal(15)  # SIGTERM while writes still wait: the drain waits for them
        wait_until(_in_state(port, "st", "draining"), 30, what="draining", proc=proc)
    finally:
        locker.rollback()
        locker.close()
    assert proc.wait(60) == 0, proc.describe()
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM st").fetchone()[0] >= 160  # at least what was in flight
    assert committed_offsets(kafka_bootstrap, group_id, topic)[0] >= 160


def test_held_by_a_registry_outage_then_running(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                schema_registry):
    topic = new_topic(partitions=1)
    schema = json.dumps({"type": "record", "name": "Order", "namespace": "shop", "fields": [
        {"name": "order_id", "type": "int"}, {"name": "status", "type": "string"}]})
    values = avro_values(schema_registry.url, topic, schema, [{"order_id": i, "status": "s"} for i in range(50)])
    produce(kafka_bootstrap, topic, [(str(i).encode(), v) for i, v in enumerate(values)])
    schema_registry.stop()
    sink = {"kind": "postgres", "dsn": _with_password(pg_dsn), "table": "orders", "conflict_key": ["order_id"],
            "columns": {"order_id": {"type": "bigint", "required": True}, "status": {"type": "text"}}}
    cfg = format_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, fmt="avro", sink=sink,
                        registry=schema_registry.url, name="held",
                        retry={"max_attempts": 0, "initial_backoff_ms": 100, "max_backoff_ms": 400})
    path = _migrate(tmp_path, cfg)
    port = _free_port()
    proc = start_ingest(["run", "-c", path, "--metrics-port", str(port)], log_dir=tmp_path)
    try:
        held = wait_until(_in_state(port, "held", "held"), 60, what="held", proc=proc)
        assert held["last_error"]["error_class"] == "schema_registry_unavailable", held
        assert held["dead_lettered"]["total"] == 0
        _, raw = get(port, "/metrics")
        assert metric(raw.decode(), "ingest_pipeline_state", pipeline="held", state="held") == 1
        schema_registry.start()
        wait_until(_in_state(port, "held", "running"), 60, what="running again", proc=proc)

        def rows() -> int:
            with psycopg.connect(pg_dsn) as conn:
                return conn.execute("SELECT count(*) FROM orders").fetchone()[0]

        wait_until(lambda: rows() == 50, 60, what="the 50 held records written", proc=proc)
        wait_until(lambda: (p := _pipeline(port, "held")) and p["partitions"]
                   and p["partitions"][0]["committed"] == 50, 30, what="offset 50 committed", proc=proc)
        assert _pipeline(port, "held")["dead_lettered"]["total"] == 0
    finally:
        proc.stop()
    assert proc.returncode == 0, proc.describe()


def test_failed_by_the_dlq_guard_is_served_while_lingering(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=1)
    path = _migrate(tmp_path, _json_config(kafka_bootstrap, pg_dsn, topic, group_id,
                                           dlq={"max_consecutive": 5, "max_ratio": None}))
    produce(kafka_bootstrap, topic, _good(0, 40))
    port = _free_port()
    proc = start_ingest(["run", "-c", path, "--metrics-port", str(port), "--linger", "60"], log_dir=tmp_path)
    wait_until(_in_state(port, "st", "running", lag=0), 60, what="running and caught up", proc=proc)
    produce(kafka_bootstrap, topic, [(b"bad", b"{not json") for _ in range(30)])
    failed = wait_until(_in_state(port, "st", "failed"), 60, what="failed", proc=proc)
    assert proc.poll() is None  # lingering: still serving
    assert failed["error_class"] == "dlq_guard"
    assert "DLQ guard tripped" in failed["error"] and "dlq.max_consecutive=5" in failed["error"]
    assert failed["last_error"]["error_class"] == "dlq_guard"
    dead = failed["dead_lettered"]
    assert dead["total"] >= 6 and dead["by_class"] == {"invalid_json": dead["total"]}
    assert dead["by_stage_and_class"] == {"decode/invalid_json": dead["total"]}
    (part,) = failed["partitions"]
    assert part["topic"] == topic and part["partition"] == 0 and 40 <= part["committed"] <= 70
    _, raw = get(port, "/metrics")
    text = raw.decode()
    assert metric(text, "ingest_dlq_guard_tripped", pipeline="st") == 1
    assert metric(text, "ingest_pipeline_state", pipeline="st", state="failed") == 1
    assert metric(text, "ingest_pipeline_ready", pipeline="st") == 0
    assert get(port, "/readyz")[0] == 503
    assert proc.stop() == 1, proc.describe()  # SIGTERM ends the linger; the run had failed
