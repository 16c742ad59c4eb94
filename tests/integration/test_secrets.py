"""Secrets never leak: logs, errors, DLQ rows, summaries and `check` output are grepped for the passwords.

The local PostgreSQL trusts 127.0.0.1, so a DSN carrying a password still
connects; the password is only there to be looked for. The librdkafka SASL
password is configured but unused by the PLAINTEXT broker (librdkafka ignores
SASL settings unless security.protocol asks for SASL), and passes through to
the client config untouched.
"""

from __future__ import annotations

import threading
import time

import orjson
import psycopg
from harness import run_ingest, start_ingest, write_config
from harness.kafka import produce

from ingest.config import KafkaSettings
from ingest.sources.kafka import consumer_config

DB_PASSWORD = "Pg-S3cr3t-9f2c"
SASL_PASSWORD = "Sasl-S3cr3t-71ab"


def _with_password(dsn: str) -> str:
    return dsn.replace("postgresql://postgres@", f"postgresql://postgres:{DB_PASSWORD}@", 1)


def test_sasl_and_tls_settings_pass_through_to_librdkafka():
    kafka = KafkaSettings(bootstrap_servers="b:9093", client={
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "svc",
        "sasl.password": SASL_PASSWORD, "ssl.ca.location": "/etc/ca.pem"})
    conf = consumer_config(kafka, "g")
    assert conf["sasl.password"] == SASL_PASSWORD and conf["security.protocol"] == "SASL_SSL"
    assert conf["ssl.ca.location"] == "/etc/ca.pem" and conf["enable.auto.commit"] is False
    assert SASL_PASSWORD not in repr(kafka) and SASL_PASSWORD not in kafka.model_dump_json()


def test_passwords_never_appear_in_output_logs_or_dlq(tmp_path, kafka_bootstrap, pg_dsn, new_topic, group_id):
    assert "postgresql://postgres@" in pg_dsn
    dsn = _with_password(pg_dsn)
    topic = new_topic(partitions=2)
    cfg = {
        "kafka": {"bootstrap_servers": kafka_bootstrap,
                  "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500,
                             "sasl.username": "svc", "sasl.password": SASL_PASSWORD}},
        "pipelines": [{
            "name": "secret", "topics": [topic], "group_id": group_id, "commit_interval_ms": 200,
            "batch": {"max_rows": 100, "max_latency_ms": 100},
            "retry": {"max_attempts": 0, "initial_backoff_ms": 50, "max_backoff_ms": 500},
            "sink": {"kind": "postgres", "dsn": dsn, "table": "t", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "v": {"type": "varchar(4)"}}},
        }],
    }
    path = write_config(tmp_path, cfg)
    outputs = []
    for args in (["check", "-c", path], ["migrate", "-c", path]):
        res = run_ingest(args, timeout_s=60)
        assert res.returncode == 0, res.stderr
        outputs += [res.stdout, res.stderr]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # slow writes, so the connection kills hit them
        conn.execute("CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$")
        conn.execute("CREATE TRIGGER slow BEFORE INSERT ON t FOR EACH STATEMENT EXECUTE FUNCTION slow()")
    records = [(str(i).encode(), orjson.dumps({"id": i, "v": "ok"})) for i in range(2000)]
    records += [(b"x", b"{broken"), (b"y", orjson.dumps({"id": 99999, "v": "far too long"}))]
    produce(kafka_bootstrap, topic, records)

    proc = start_ingest(["run", "-c", path, "--metrics-port", "0", "--log-level", "debug",
                         "--summary-json", tmp_path / "summary.json"], log_dir=tmp_path)
    stop_killing = threading.Event()

    def kill_connections() -> None:  # make the sink fail and retry, so error paths log
        while not stop_killing.wait(0.3):
            try:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            except psycopg.Error:
                pass

    killer = threading.Thread(target=kill_connections, daemon=True)
    killer.start()
    deadline = time.monotonic() + 60
    while "transient failure, retrying" not in proc.output()[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    stop_killing.set()
    killer.join()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with psycopg.connect(pg_dsn) as conn:
            if conn.execute("SELECT count(*) FROM t").fetchone()[0] >= 2000:
                break
        time.sleep(0.3)
    proc.stop()
    out, err = proc.output()
    outputs += [out, err, (tmp_path / "summary.json").read_text()]

    # An unreachable database: the error names the sink, never the password.
    bad = write_config(tmp_path, {**cfg, "pipelines": [{**cfg["pipelines"][0], "sink": {
        **cfg["pipelines"][0]["sink"], "dsn": f"postgresql://postgres:{DB_PASSWORD}@127.0.0.1:1/x"}}]},
        name="bad.yaml")
    res = run_ingest(["check", "-c", bad], timeout_s=60)
    assert res.returncode == 3
    outputs += [res.stdout, res.stderr]

    with psycopg.connect(pg_dsn) as conn:
        dlq = conn.execute("SELECT row_to_json(d)::text FROM ingest_dlq d").fetchall()
    assert len(dlq) == 2  # the broken JSON and the too-long value, found while connections were being killed
    outputs += [row[0] for row in dlq]
    text = "\n".join(outputs)
    assert "transient failure, retrying" in text  # the error paths were exercised
    assert DB_PASSWORD not in text
    assert SASL_PASSWORD not in text
