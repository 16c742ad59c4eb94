"""Review findings 5-9 (issue 15): failures that must neither stall, nor dead-letter good data, nor
leak a secret -- real broker, real PostgreSQL, chDB, ``python -m ingest`` as a subprocess.

5. ``write_method: values`` with more than 65,535 parameters in a batch; an error without
   SQLSTATE on a healthy connection stops the pipeline (neither retried forever nor bisected);
6. a Kafka DLQ and a poison record larger than the producer's size limit;
7. DSN passwords with ``%``, spaces and quotes, in URL and key=value form, for every command;
8. a read-only transaction and a revoked privilege are outages (retry, stop, commit nothing,
   dead-letter nothing); a row-level-security violation is the row's own (poison);
9. ``replay-dlq --to sink`` (and ``--to topic``, ``dlq count|list``) for a ClickHouse sink.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from harness import run_ingest, write_config
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    produce,
    unique_name,
)
from harness.services import temp_database
from pipeline_helpers import count_rows, pipeline_config, write_and_migrate
from psycopg import conninfo, sql

pytestmark = pytest.mark.timeout(240)


def _ok(res: Any) -> None:
    assert res.returncode == 0, (f"{' '.join(map(str, res.args[2:]))} exited {res.returncode}\n"
                                 f"--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-6000:]}")


def _orders(n: int, first: int = 0, amount: float = 2.5) -> list[tuple[bytes, bytes]]:
    return [(str(i).encode(), orjson.dumps({"order_id": i, "status": "new", "seq": i, "amount": amount,
                                            "updated_at": "2024-01-01T00:00:00+00:00"}))
            for i in range(first, first + n)]


def _dlq_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM ingest_dlq").fetchone()[0]


# --------------------------------------------------------------------------- finding 5


def test_values_write_method_takes_a_batch_over_the_parameter_limit(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                    tmp_path):
    topic = new_topic(partitions=1)
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                          batch={"max_rows": 20_000, "max_latency_ms": 3000},
                          retry={"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 200})
    cfg["pipelines"][0]["sink"]["write_method"] = "values"
    config = write_and_migrate(tmp_path, cfg)
    produce(kafka_bootstrap, topic, _orders(20_000), partition=0)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=180, log_dir=tmp_path))
    assert count_rows(pg_dsn) == 20_000
    assert _dlq_count(pg_dsn) == 0


def test_error_without_sqlstate_on_a_healthy_connection_stops_the_pipeline(pg_dsn):
    """psycopg reports "number of parameters must be between 0 and 65535" without SQLSTATE on a
    connection that is fine: not a connection error (retrying cannot help), not the data's fault
    (bisecting would dead-letter good rows): the third outcome, stop without committing."""
    from ingest.drivers.postgres import translate
    from ingest.errors import PermanentError, TransientError, UnclassifiedError

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(UnclassifiedError) as info:
            with translate(conn):
                conn.execute("SELECT " + ", ".join(["%s"] * 70_000), [1] * 70_000)
        assert not isinstance(info.value, (TransientError, PermanentError))
        assert "65535" in str(info.value)
        conn.execute("SELECT 1")  # the connection is healthy: that is what made it not transient
        # A real connection loss stays transient.
        with psycopg.connect(pg_dsn, autocommit=True) as victim:
            pid = victim.info.backend_pid
            conn.execute("SELECT pg_terminate_backend(%s)", [pid])
            time.sleep(0.2)
            with pytest.raises(TransientError):
                with translate(victim):
                    victim.execute("SELECT 1")


# --------------------------------------------------------------------------- finding 6


def _kafka_dlq_config(tmp_path: Path, bootstrap: str, topic: str, group: str, sink_dsn: str, dlq_topic: str,
                      **dlq: Any) -> Path:
    cfg = pipeline_config(bootstrap=bootstrap, topic=topic, group=group, dsn=sink_dsn,
                          batch={"max_rows": 500, "max_latency_ms": 200},
                          retry={"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 200})
    cfg["pipelines"][0]["dlq"] = {"kind": "kafka", "topic": dlq_topic, **dlq}
    return write_and_migrate(tmp_path, cfg)


def _read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 30) -> list[Any]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": unique_name("dlq-read"),
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(1)])
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expect and time.monotonic() < deadline:
            out += [m for m in consumer.consume(10, 0.5) if m.error() is None]
    finally:
        consumer.close()
    return out


BIG_PRODUCER = {"message.max.bytes": 20_000_000, "client.id": "big-producer"}


def test_kafka_dlq_takes_a_large_poison_record_whole(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    """A 1.5 MB poison record (compressible, as most JSON is) fits the source topic; the DLQ
    producer compresses it and sizes its limit to match, so it is dead-lettered whole."""
    topic, dlq_topic = new_topic(partitions=1), new_topic(partitions=1)
    config = _kafka_dlq_config(tmp_path, kafka_bootstrap, topic, group_id, pg_dsn, dlq_topic)
    big = orjson.dumps({"order_id": "not-a-number", "note": "x" * 1_500_000})
    produce(kafka_bootstrap, topic, _orders(5) + [(b"big", big)] + _orders(5, first=5), partition=0,
            config=BIG_PRODUCER)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    assert count_rows(pg_dsn) == 10
    dead = _read_all(kafka_bootstrap, dlq_topic, 1)
    assert len(dead) == 1 and dead[0].value() == big and dead[0].key() == b"big"
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {0: 11}


def test_kafka_dlq_record_that_can_never_fit_stops_or_falls_back(kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                                 tmp_path):
    """An incompressible 300 kB poison record against a 100 kB DLQ limit: by default the pipeline
    stops without committing it, naming the record, the limit and the fix; with
    ``dlq.oversized: postgres`` it is stored whole in the PostgreSQL DLQ table and the DLQ topic
    gets a reference to it."""
    topic, dlq_topic = new_topic(partitions=1), new_topic(partitions=1)
    noise = os.urandom(300_000)
    produce(kafka_bootstrap, topic, _orders(3) + [(b"noise", noise)] + _orders(3, first=3), partition=0,
            config=BIG_PRODUCER)
    stop_dir = tmp_path / "stop"
    config = _kafka_dlq_config(stop_dir, kafka_bootstrap, topic, group_id, pg_dsn, dlq_topic,
                               max_message_bytes=100_000)
    res = run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=stop_dir)
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"{topic}[0]@3" in res.stderr and "100000" in res.stderr and "dlq.oversized" in res.stderr, \
        res.stderr[-3000:]
    assert committed_offsets(kafka_bootstrap, group_id, topic).get(0, 0) <= 3, "the oversized record is not committed"

    fallback_dir = tmp_path / "fallback"
    config = _kafka_dlq_config(fallback_dir, kafka_bootstrap, topic, group_id, pg_dsn, dlq_topic,
                               max_message_bytes=100_000, oversized="postgres", dsn=pg_dsn)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=fallback_dir))
    assert count_rows(pg_dsn) == 6
    with psycopg.connect(pg_dsn) as conn:
        stored = conn.execute('SELECT "offset", value, stage FROM ingest_dlq').fetchall()
    assert [(o, bytes(v), s) for o, v, s in stored] == [(3, noise, "decode")]
    refs = _read_all(kafka_bootstrap, dlq_topic, 1)
    assert len(refs) == 1 and refs[0].value() is None
    headers = dict(refs[0].headers())
    assert headers["ingest.offset"] == b"3" and b"ingest_dlq" in headers["ingest.stored_in"]
    assert committed_offsets(kafka_bootstrap, group_id, topic) == {0: 7}


# --------------------------------------------------------------------------- finding 7

#: Malformed DSNs: libpq quotes the bad token (a piece of the password) in its parse error.
MALFORMED = {
    "url-bad-percent": ("postgresql://postgres:Se%zzcret-7a1@127.0.0.1:5432/postgres", ["Se%zzcret-7a1", "zzcret"]),
    "kv-unquoted-space": ("host=127.0.0.1 port=5432 dbname=postgres user=postgres password=Sp4ce s3cret-7b2",
                          ["Sp4ce", "s3cret-7b2"]),
}


def _secret_config(tmp_path: Path, bootstrap: str, topic: str, group: str, dsn: str) -> Path:
    return write_config(tmp_path, {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "secret", "topics": [topic], "group_id": group, "commit_interval_ms": 200,
            "retry": {"max_attempts": 2, "initial_backoff_ms": 50, "max_backoff_ms": 100},
            "sink": {"kind": "postgres", "dsn": dsn, "table": "t", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "v": {"type": "text"}}},
        }],
    })


COMMANDS = [["check"], ["migrate"], ["run", "--until-idle", "1", "--metrics-port", "0"], ["lag"],
            ["dlq", "count", "-p", "secret"], ["dlq", "list", "-p", "secret"], ["dlq", "show", "1", "-p", "secret"],
            ["replay-dlq", "-p", "secret", "--dry-run"], ["replay-dlq", "-p", "secret"]]


@pytest.mark.parametrize("form", sorted(MALFORMED))
def test_malformed_dsn_is_a_config_error_naming_the_field_for_every_command(form, kafka_bootstrap, new_topic,
                                                                            group_id, tmp_path):
    dsn, pieces = MALFORMED[form]
    config = _secret_config(tmp_path, kafka_bootstrap, new_topic(partitions=1), group_id, dsn)
    for command in COMMANDS:
        res = run_ingest([*command, "-c", config], timeout_s=60, log_dir=tmp_path)
        out = res.stdout + res.stderr
        where = f"ingest {' '.join(command)}"
        assert res.returncode == 2, f"{where}: exit {res.returncode}\n{out[-2000:]}"
        assert "sink.dsn" in out, f"{where} must name the field:\n{out[-2000:]}"
        assert "Traceback" not in out, f"{where} printed a traceback:\n{out[-3000:]}"
        for piece in pieces:
            assert piece not in out, f"{where} printed {piece!r}:\n{out[-2000:]}"


def _with_password(dsn: str, password: str) -> str:
    params = conninfo.conninfo_to_dict(dsn)
    params["password"] = password
    return conninfo.make_conninfo(**params)


@pytest.mark.parametrize("password", ["pQ%wZ9 dQ'qZ\\xQ-7c3", "100%-sureQZ 7d4QZxy", "%41%zzQZ-7e5"],
                         ids=["space-quote-backslash", "percent-space", "percent-escapes"])
def test_odd_passwords_never_appear_in_output_or_logs(password, kafka_bootstrap, pg_dsn, new_topic, group_id,
                                                      tmp_path):
    """Valid DSNs (key=value, quoted by libpq's own rules) with passwords holding %, spaces, quotes and
    backslashes: the trusted local server ignores them, and nothing ingest prints may hold them,
    including the lines the connection pool logs while the database is unreachable."""
    topic = new_topic(partitions=1)
    good = _secret_config(tmp_path / "good", kafka_bootstrap, topic, group_id, _with_password(pg_dsn, password))
    params = conninfo.conninfo_to_dict(pg_dsn)
    params.update(password=password, port="1")  # nothing listens on port 1: connection errors, retried
    down = _secret_config(tmp_path / "down", kafka_bootstrap, topic, group_id, conninfo.make_conninfo(**params))
    produce(kafka_bootstrap, topic, [(b"1", b'{"id": 1, "v": "a"}'), (b"2", b"not json")], partition=0)
    outputs = []
    for path in (good, down):
        for command in (["check"], ["migrate"], ["run", "--until-idle", "1", "--metrics-port", "0",
                                                 "--log-level", "debug"],
                        ["dlq", "count", "-p", "secret"], ["replay-dlq", "-p", "secret"]):
            res = run_ingest([*command, "-c", path], timeout_s=90, log_dir=tmp_path)
            assert "No such option" not in res.stderr, res.stderr
            outputs.append((path.parent.name, command, res.returncode, res.stdout + res.stderr))
    for where, command, code, out in outputs:
        assert password not in out, f"{where} {command} ({code}) printed the password:\n{out[-2000:]}"
        for piece in password.split():
            assert piece not in out, f"{where} {command} ({code}) printed {piece!r}:\n{out[-2000:]}"
    with psycopg.connect(pg_dsn) as conn:
        dead = conn.execute("SELECT error_message, value FROM ingest_dlq").fetchall()
    assert [bytes(v) for _, v in dead] == [b"not json"], "the DLQ row keeps the record's own bytes"
    assert all(password not in m for m, _ in dead)


# --------------------------------------------------------------------------- finding 8


@contextlib.contextmanager
def _role(admin_dsn: str, db_dsn: str) -> Iterator[str]:
    """A login role (no superuser) with rights on ``db_dsn``'s public schema; dropped afterwards."""
    name = f"ingest_w_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM {}").format(
                sql.Identifier(conninfo.conninfo_to_dict(db_dsn)["dbname"]), sql.Identifier(name)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _as_user(dsn: str, user: str) -> str:
    params = conninfo.conninfo_to_dict(dsn)
    params["user"] = user
    return conninfo.make_conninfo(**params)


@pytest.mark.parametrize("write_method", [
    "values",
    "copy",  # the pool's CREATE TEMP TABLE fails first: already retried as an outage
])
def test_read_only_database_is_an_outage_not_poison(write_method, kafka_bootstrap, pg_dsn, pg_admin_dsn,
                                                     new_topic, group_id, tmp_path):
    topic = new_topic(partitions=1)
    with temp_database(pg_admin_dsn) as dlq_dsn:
        cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                              batch={"max_rows": 100, "max_latency_ms": 100},
                              retry={"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 200})
        cfg["pipelines"][0]["sink"]["write_method"] = write_method
        cfg["pipelines"][0]["dlq"] = {"dsn": dlq_dsn}
        config = write_and_migrate(tmp_path, cfg)
        produce(kafka_bootstrap, topic, _orders(200), partition=0)
        db = conninfo.conninfo_to_dict(pg_dsn)["dbname"]
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(sql.Identifier(db)))
        res = run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path)
        assert res.returncode == 1, res.stderr[-3000:]
        assert _dlq_count(dlq_dsn) == 0, "a read-only database dead-lettered good rows"
        assert set(committed_offsets(kafka_bootstrap, group_id, topic).values()) <= {0}, "nothing is committed"
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(sql.Identifier(db)))
        _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
        assert count_rows(pg_dsn) == 200 and _dlq_count(dlq_dsn) == 0


def _within_attempts(n: int, fn: Any) -> None:
    """Call ``fn`` until it succeeds, at most ``n`` times (TransientError between attempts)."""
    from ingest.errors import TransientError

    for attempt in range(1, n + 1):
        try:
            fn()
            return
        except TransientError:
            if attempt == n:
                raise


def test_read_only_sessions_are_replaced_not_reused(pg_dsn, pg_admin_dsn):
    """A failover leaves pooled sessions read-only (the old primary, now a replica, answers them) while
    new sessions reach a writable primary. The sink and the DLQ table must drop a connection that
    met 25006, so the retry after the failover writes instead of failing until retries run out."""
    from ingest.core.routing import stream_id
    from ingest.dlq.base import DlqEntry
    from ingest.dlq.postgres import PostgresDlq, migrate_dlq_table
    from ingest.drivers.postgres import execute_ddl
    from ingest.errors import TransientError
    from ingest.sinks.postgres.schema import sink_table_sql
    from ingest.sinks.postgres.settings import PostgresSinkSettings
    from ingest.sinks.postgres.sink import PostgresSink
    from ingest.types import Failure, Record

    # values: with copy, a read-only session cannot even be configured (its temp stage table), so the
    # pool never hands one out -- the case this test is about needs a session that connects and then fails.
    cfg = PostgresSinkSettings(dsn=pg_dsn, table="ro", conflict_key=["id"], columns={"id": {"type": "bigint"}},
                               write_method="values")
    execute_ddl(pg_dsn, "test", sink_table_sql(cfg))
    migrate_dlq_table(pg_dsn, "public", "ingest_dlq", "test")
    info = conninfo.conninfo_to_dict(pg_dsn)
    role_in_db = sql.SQL("ALTER ROLE {} IN DATABASE {} ").format(
        sql.Identifier(info.get("user") or "postgres"), sql.Identifier(info["dbname"]))

    def read_only(on: bool) -> None:
        change = "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(role_in_db + sql.SQL(change))
            if on:  # the pooled sessions reconnect into read-only ones
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                             "AND pid <> pg_backend_pid()", (info["dbname"],))

    sink = PostgresSink(cfg, pool_size=1)
    dlq = PostgresDlq(pg_dsn, "public", "ingest_dlq", pool_size=1)
    entry = DlqEntry("p", Record("t", 0, 7, b"k", b"v", None), Failure("write", "x", "y"))
    try:
        sink.write([(1, stream_id("t", 0), 0)])
        dlq.put([entry])
        read_only(True)
        for _ in range(3):  # the first may meet the killed connection; then read-only ones
            with contextlib.suppress(TransientError):
                sink.write([(2, stream_id("t", 0), 1)])
            with contextlib.suppress(TransientError):
                dlq.put([entry])
        with pytest.raises(TransientError, match="read-only transaction"):
            sink.write([(2, stream_id("t", 0), 1)])
        with pytest.raises(TransientError, match="read-only transaction"):
            dlq.put([entry])
        read_only(False)  # new sessions are writable; nothing touches the pooled ones
        # The pool replaced each condemned connection at once, maybe still during the outage: one
        # more failed attempt per pooled connection (pool_size 1) is the price; then it writes.
        # Reusing a read-only session would fail every attempt.
        _within_attempts(2, lambda: sink.write([(3, stream_id("t", 0), 2)]))
        _within_attempts(2, lambda: dlq.put([entry]))
    finally:
        sink.close()
        dlq.close()
    with psycopg.connect(pg_dsn) as conn:
        assert [r[0] for r in conn.execute("SELECT id FROM ro ORDER BY id")] == [1, 3]


def test_revoked_privilege_stops_and_row_level_security_is_poison(kafka_bootstrap, pg_dsn, pg_admin_dsn,
                                                                  new_topic, group_id, tmp_path):
    topic = new_topic(partitions=1)
    with temp_database(pg_admin_dsn) as dlq_dsn, _role(pg_admin_dsn, pg_dsn) as user:
        cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=topic, group=group_id, dsn=pg_dsn,
                              batch={"max_rows": 100, "max_latency_ms": 100},
                              retry={"max_attempts": 3, "initial_backoff_ms": 50, "max_backoff_ms": 200})
        cfg["pipelines"][0]["dlq"] = {"dsn": dlq_dsn}
        write_and_migrate(tmp_path / "admin", cfg)
        cfg["pipelines"][0]["sink"]["dsn"] = _as_user(pg_dsn, user)
        config = write_config(tmp_path, cfg)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {u}; GRANT SELECT ON orders TO {u}").format(
                u=sql.Identifier(user)))
        produce(kafka_bootstrap, topic, _orders(50), partition=0)
        res = run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path)
        assert res.returncode == 1, res.stderr[-3000:]
        assert "permission denied" in res.stderr
        assert _dlq_count(dlq_dsn) == 0 and count_rows(pg_dsn) == 0
        assert set(committed_offsets(kafka_bootstrap, group_id, topic).values()) <= {0}, "nothing is committed"

        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL(
                "GRANT INSERT, UPDATE ON orders TO {u}; ALTER TABLE orders ENABLE ROW LEVEL SECURITY; "
                "CREATE POLICY only_positive ON orders FOR ALL TO {u} USING (true) WITH CHECK (amount >= 0)"
            ).format(u=sql.Identifier(user)))
        produce(kafka_bootstrap, topic, _orders(5, first=1000, amount=-1), partition=0)
        _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
        assert count_rows(pg_dsn) == 50
        with psycopg.connect(dlq_dsn) as conn:
            dead = conn.execute("SELECT key, stage, sqlstate FROM ingest_dlq ORDER BY \"offset\"").fetchall()
        assert [(bytes(k), s, q) for k, s, q in dead] == [(str(i).encode(), "write", "42501")
                                                          for i in range(1000, 1005)]


# --------------------------------------------------------------------------- finding 9


def _ch_config(tmp_path: Path, bootstrap: str, topic: str, group: str, chdb_url: str, pg_dsn: str,
               status_default: str | None) -> Path:
    status: dict[str, Any] = {"type": "String"}
    if status_default is not None:
        status["default"] = status_default
    return write_config(tmp_path, {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "ev", "topics": [topic], "group_id": group, "commit_interval_ms": 200,
            "batch": {"max_rows": 100, "max_latency_ms": 100},
            "sink": {"kind": "clickhouse", "url": chdb_url, "database": "ingest_test", "table": "events",
                     "order_by": ["id"], "columns": {"id": {"type": "UInt64"}, "status": status}},
            "dlq": {"kind": "postgres", "dsn": pg_dsn},
        }],
    })


@pytest.mark.parametrize("to", [
    "sink",
    "topic",
])
def test_replay_dlq_into_clickhouse(to, kafka_bootstrap, pg_dsn, new_topic, group_id, chdb, tmp_path):
    topic = new_topic(partitions=1)
    strict = _ch_config(tmp_path / "strict", kafka_bootstrap, topic, group_id, chdb.url, pg_dsn, None)
    _ok(run_ingest(["migrate", "-c", strict], timeout_s=60, log_dir=tmp_path))
    produce(kafka_bootstrap, topic, [(b"1", b'{"id": 1, "status": "a"}'), (b"2", b'{"id": 2}'),
                                     (b"3", b'{"id": 3, "status": "c"}')], partition=0)
    _ok(run_ingest(["run", "-c", strict, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    count = run_ingest(["dlq", "count", "-c", strict, "-p", "ev", "--format", "json"], timeout_s=60)
    _ok(count)
    assert orjson.loads(count.stdout) == [{"stage": "map", "error_class": "missing_field", "status": "pending",
                                           "count": 1}]
    listed = run_ingest(["dlq", "list", "-c", strict, "-p", "ev", "--format", "json"], timeout_s=60)
    _ok(listed)
    assert [e["offset"] for e in orjson.loads(listed.stdout)] == [1]
    fixed = _ch_config(tmp_path / "fixed", kafka_bootstrap, topic, group_id, chdb.url, pg_dsn, "unknown")
    _ok(run_ingest(["replay-dlq", "-c", fixed, "-p", "ev", "--to", to], timeout_s=120, log_dir=tmp_path))
    if to == "topic":
        _ok(run_ingest(["run", "-c", fixed, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    client = chdb.client()
    rows = dict(client.query("SELECT id, status FROM ingest_test.events FINAL").result_rows)
    chdb.close()
    assert rows == {1: "a", 2: "unknown", 3: "c"}
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status FROM ingest_dlq").fetchall() == [("replayed",)]
