"""Operations endpoints of a running ``ingest run``: /metrics moves and agrees with the table; /healthz, /readyz.

Also the container entrypoint contract: the image runs ``ingest run --config
/etc/ingest/config.yaml`` with ``INGEST_CONFIG`` set, which works from a plain
virtualenv too (no Docker engine on these machines), and the Dockerfile and
compose file parse.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import psycopg
import pytest
import yaml
from harness import run_ingest, start_ingest, write_config
from harness.kafka import produce

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _metric(text: str, name: str, **labels: str) -> float | None:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if not all(w in line for w in want):
                continue
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def _config(tmp_path, bootstrap, dsn, topic, group) -> Path:
    return write_config(tmp_path, {
        "kafka": {"bootstrap_servers": bootstrap,
                  "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": "ops", "topics": [topic], "group_id": group, "lanes": 2, "commit_interval_ms": 200,
            "batch": {"max_rows": 200, "max_latency_ms": 100},
            "sink": {"kind": "postgres", "dsn": dsn, "table": "ops", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "v": {"type": "text"}}},
        }],
    })


def test_metrics_health_and_readiness(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    topic = new_topic(partitions=3)
    path = _config(tmp_path, kafka_bootstrap, pg_dsn, topic, group_id)
    assert run_ingest(["migrate", "-c", path], timeout_s=60).returncode == 0
    good = [(str(i).encode(), orjson.dumps({"id": i, "v": f"v{i}"})) for i in range(3000)]
    bad = [(b"bad", b"{not json") for _ in range(7)]
    produce(kafka_bootstrap, topic, good[:1500] + bad + good[1500:])
    port = _free_port()
    proc = start_ingest(["run", "-c", path, "--metrics-port", str(port)], log_dir=tmp_path)
    try:
        # Not ready before assignment, healthy as soon as the loop turns.
        deadline = time.monotonic() + 60
        ready_codes = set()
        while time.monotonic() < deadline:
            try:
                code, _ = _get(port, "/readyz")
            except OSError:
                time.sleep(0.1)
                continue
            ready_codes.add(code)
            if code == 200:
                break
            time.sleep(0.1)
        assert 200 in ready_codes, proc.describe()
        status, body = _get(port, "/healthz")
        assert status == 200 and orjson.loads(body)["ok"] is True

        def rows() -> int:
            with psycopg.connect(pg_dsn) as conn:
                return conn.execute("SELECT count(*) FROM ops").fetchone()[0]

        deadline = time.monotonic() + 60
        while rows() < 3000 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rows() == 3000
        time.sleep(1.0)  # one more commit tick so gauges refresh
        _, raw = _get(port, "/metrics")
        text = raw.decode()
        assert _metric(text, "ingest_records_consumed_total", pipeline="ops") == 3007
        assert _metric(text, "ingest_records_handled_total", pipeline="ops") == 3007
        assert _metric(text, "ingest_rows_written_total", pipeline="ops") == 3000
        assert _metric(text, "ingest_dead_lettered_total", pipeline="ops", stage="decode",
                       error_class="invalid_json") == 7
        assert _metric(text, "ingest_assigned_partitions", pipeline="ops") == 3
        assert _metric(text, "ingest_buffered_records", pipeline="ops") == 0
        assert _metric(text, "ingest_offset_gaps", pipeline="ops") == 0
        assert _metric(text, "ingest_batch_rows_count", pipeline="ops") >= 3
        assert _metric(text, "ingest_flush_duration_seconds_count", pipeline="ops") >= 3
        assert _metric(text, "ingest_commits_total", pipeline="ops") >= 1
        assert _metric(text, "ingest_end_to_end_latency_seconds_count", pipeline="ops") >= 1
        lag = _metric(text, "ingest_consumer_lag_records", pipeline="ops")
        assert lag is not None and lag >= 0
        with psycopg.connect(pg_dsn) as conn:
            assert conn.execute("SELECT count(*) FROM ingest_dlq").fetchone()[0] == 7
        assert _get(port, "/nope")[0] == 404
    finally:
        proc.stop()
    assert proc.returncode == 0, proc.describe()


def test_container_entrypoint_runs_from_a_virtualenv(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    """What the image does (ENTRYPOINT ingest, CMD run --config ...), with INGEST_CONFIG and env overrides."""
    topic = new_topic(partitions=1)
    path = _config(tmp_path, "127.0.0.1:1", pg_dsn, topic, group_id)  # wrong broker, fixed by env below
    env = {"INGEST_CONFIG": str(path), "INGEST_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap}
    assert run_ingest(["migrate"], timeout_s=60, env=env).returncode == 0
    produce(kafka_bootstrap, topic, [(b"1", b'{"id": 1, "v": "x"}')])
    res = run_ingest(["run", "--until-idle", "2", "--metrics-port", "0"], timeout_s=90, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT v FROM ops WHERE id = 1").fetchone()[0] == "x"


def test_dockerfile_and_compose_parse():
    dockerfile = (ROOT / "Dockerfile").read_text()
    instructions = [line.split()[0] for line in dockerfile.splitlines() if line.strip() and not line.startswith("#")
                    and not line.startswith(" ")]
    assert instructions.count("FROM") == 2  # multi-stage
    assert 'ENTRYPOINT ["ingest"]' in dockerfile
    assert 'CMD ["run", "--config", "/etc/ingest/config.yaml"]' in dockerfile
    assert "USER ingest" in dockerfile and "HEALTHCHECK" in dockerfile and "/healthz" in dockerfile
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert {"kafka", "postgres", "clickhouse", "ingest"} <= set(compose["services"])
    mount = compose["services"]["ingest"]["volumes"][0].split(":")[0]
    assert (ROOT / mount).exists()
    assert (ROOT / ".dockerignore").exists()


@pytest.mark.parametrize("cmd", [["--help"], ["run", "--help"], ["demo", "--help"], ["dlq", "list", "--help"]])
def test_help_pages(cmd):
    res = run_ingest(cmd, timeout_s=30)
    assert res.returncode == 0 and "Usage" in res.stdout
