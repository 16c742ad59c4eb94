"""PostgreSQL behind a fault proxy: silent connections, resets mid-COPY, latency, refused connects.

Every case runs a real ``ingest run`` from a real broker into a real PostgreSQL
whose only way in is a :class:`~harness.faultproxy.FaultProxy`, breaks the
network mid-run, and then checks the one outcome that matters: the table equals
the model computed from the topic, nothing was dead-lettered, and the committed
offsets are at the log end.

The silent connection is the case the server cannot help with: a blackholed
connection neither answers nor resets, so ``statement_timeout`` never fires;
only the client-side bound (``sink.network.client_timeout_ms``) gets the
pipeline moving again. Without it the run below waits for ever (the test's
``timeout`` then fails it).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from harness import start_ingest
from harness.faultproxy import FaultProxy
from harness.kafka import produce
from psycopg import conninfo

from pipeline_helpers import (
    OrderGen,
    SteadyProducer,
    assert_committed_at_log_end,
    assert_table_equals,
    count_rows,
    dlq_rows,
    expected_from_log,
    log_events,
    pipeline_config,
    read_topic,
    seed_for,
    wait_assigned,
    wait_until,
    write_and_migrate,
)

pytestmark = pytest.mark.timeout(240)

#: The client-side bound the tests configure (ms): short, so a stall is caught quickly.
CLIENT_TIMEOUT_MS = 2_000
#: How long a write waits for a pooled connection before it counts as a (retried) failure.
POOL_WAIT_S = 5.0
#: What a loaded 2-core machine (4 test workers sharing it) may add to a detection time.
BUSY_SLACK_S = 6.0


def _through(proxy: FaultProxy, dsn: str) -> str:
    """``dsn`` (a URL to the local server) pointed at the proxy instead."""
    params = conninfo.conninfo_to_dict(dsn)
    return (f"postgresql://{params.get('user', 'postgres')}@127.0.0.1:{proxy.port}/{params['dbname']}"
            "?application_name=ingest-under-test")


def _config(kafka_bootstrap: str, topic: str, group: str, sink_dsn: str, **network: Any) -> dict[str, Any]:
    cfg = pipeline_config(bootstrap=kafka_bootstrap, topic=topic, group=group, dsn=sink_dsn, lanes=2,
                          batch={"max_rows": 500, "max_latency_ms": 100},
                          retry={"max_attempts": 40, "initial_backoff_ms": 100, "max_backoff_ms": 1000})
    cfg["pipelines"][0]["sink"]["network"] = {"client_timeout_ms": CLIENT_TIMEOUT_MS, "connect_timeout_s": 2,
                                              **network}
    cfg["pipelines"][0]["dlq"] = {"network": {"client_timeout_ms": CLIENT_TIMEOUT_MS, "connect_timeout_s": 2}}
    # The row path's writes, whose statements are in flight when the connection goes silent: the stall
    # these tests look for. (Since lanes > 1 take the columnar tier, its quicker writes mostly meet the
    # blackhole at the pool instead -- a pool timeout -- and the stall is not reported.)
    cfg["pipelines"][0]["columnar"] = False
    return cfg


def _migrate(tmp_path: Path, cfg: dict[str, Any], direct_dsn: str) -> Path:
    """Migrate through the direct DSN (the proxy is for the run), then write the run's config."""
    from harness import write_config

    direct = {**cfg, "pipelines": [{**cfg["pipelines"][0], "sink": {**cfg["pipelines"][0]["sink"], "dsn": direct_dsn}}]}
    write_and_migrate(tmp_path / "migrate", direct)
    return write_config(tmp_path, cfg)


def _finish_and_check(proc, kafka_bootstrap: str, topic: str, group: str, dsn: str, timeout_s: float = 150) -> None:
    try:
        proc.wait(timeout_s)
    except Exception:  # noqa: BLE001 - show where it hung
        proc.kill9()
        raise AssertionError(f"ingest did not finish within {timeout_s}s\n{proc.describe()}") from None
    assert proc.returncode == 0, proc.describe()
    assert_table_equals(dsn, expected_from_log(read_topic(kafka_bootstrap, topic)))
    assert dlq_rows(dsn) == [], "a network fault dead-lettered good rows"
    assert_committed_at_log_end(kafka_bootstrap, group, topic)


def _retries(proc) -> list[dict[str, Any]]:
    return [e for e in log_events(proc) if e.get("event") == "transient failure, retrying"]


def test_a_silent_connection_mid_run_is_dropped_and_the_batch_retried(kafka_bootstrap, pg_dsn, new_topic,
                                                                     group_id, tmp_path):
    topic = new_topic(partitions=3)
    gen = OrderGen(seed_for("pg-blackhole"))
    with FaultProxy("127.0.0.1", int(conninfo.conninfo_to_dict(pg_dsn).get("port", 5432))) as proxy:
        config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _through(proxy, pg_dsn)), pg_dsn)
        proc = start_ingest(["run", "-c", config, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
        wait_assigned(proc)
        producer = SteadyProducer(kafka_bootstrap, topic, gen, chunk=100, interval_s=0.05, limit=6000)
        producer.start()
        wait_until(lambda: count_rows(pg_dsn) >= 500, 60, what="rows before the blackhole", proc=proc)
        proxy.blackhole()  # every open connection goes silent; new ones too
        silenced_at = time.time()
        time.sleep(3 * CLIENT_TIMEOUT_MS / 1000)
        rows_in_blackhole = count_rows(pg_dsn)
        proxy.heal()  # new connections work again; the silenced ones stay dead
        producer.finish()
        _finish_and_check(proc, kafka_bootstrap, topic, group_id, pg_dsn)
    # Detected within the bound: the first failure is reported while the outage lasts, within the
    # client bound of a wait in flight or the pool's 5 s wait for a healthy connection (whose health
    # check is bounded the same way), plus the slack of a busy machine.
    stalls = [e for e in _retries(proc) if _epoch(e["ts"]) >= silenced_at]
    assert stalls, f"no stalled write was reported\n{proc.describe()}"
    first = min(_epoch(e["ts"]) for e in stalls)
    assert first - silenced_at < CLIENT_TIMEOUT_MS / 1000 + POOL_WAIT_S + BUSY_SLACK_S, (first - silenced_at, stalls[:3])
    assert rows_in_blackhole < count_rows(pg_dsn)


def _epoch(ts: str) -> float:
    """A log line's ``ts`` (``2026-12-04T21:03:04.123Z``) as seconds since the epoch."""
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def test_a_reset_in_the_middle_of_a_copy_is_retried(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path):
    topic = new_topic(partitions=3)
    gen = OrderGen(seed_for("pg-reset-mid-copy"))
    with FaultProxy("127.0.0.1", int(conninfo.conninfo_to_dict(pg_dsn).get("port", 5432))) as proxy:
        config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _through(proxy, pg_dsn)), pg_dsn)
        proc = start_ingest(["run", "-c", config, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
        wait_assigned(proc)
        # The next 20 kB towards the server on every connection, then an RST: inside a batch's COPY
        # (a 500-row batch stages ~40 kB).
        proxy.reset_after(20_000)
        produce(kafka_bootstrap, topic, gen.next(4000))
        wait_until(lambda: proxy.stats()["resets_after"] >= 1, 60, what="a reset mid-write", proc=proc)
        proxy.heal()
        _finish_and_check(proc, kafka_bootstrap, topic, group_id, pg_dsn)
    assert _retries(proc), f"the reset was not retried as a transient failure\n{proc.describe()}"


def test_latency_and_a_bandwidth_limit_slow_the_pipeline_without_errors(kafka_bootstrap, pg_dsn, new_topic,
                                                                         group_id, tmp_path):
    topic = new_topic(partitions=3)
    gen = OrderGen(seed_for("pg-latency"))
    with FaultProxy("127.0.0.1", int(conninfo.conninfo_to_dict(pg_dsn).get("port", 5432))) as proxy:
        proxy.latency(30)  # per chunk and direction: every round trip +60 ms
        proxy.bandwidth(256_000)
        config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _through(proxy, pg_dsn)), pg_dsn)
        produce(kafka_bootstrap, topic, gen.next(3000))
        proc = start_ingest(["run", "-c", config, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
        _finish_and_check(proc, kafka_bootstrap, topic, group_id, pg_dsn)
        assert proxy.stats()["up"] > 100_000, proxy.stats()
    assert _retries(proc) == [], f"a slow network was treated as a failure\n{proc.describe()}"


def test_refused_connections_at_start_are_retried_until_the_database_is_back(kafka_bootstrap, pg_dsn, new_topic,
                                                                              group_id, tmp_path):
    topic = new_topic(partitions=2)
    gen = OrderGen(seed_for("pg-refuse"))
    with FaultProxy("127.0.0.1", int(conninfo.conninfo_to_dict(pg_dsn).get("port", 5432))) as proxy:
        config = _migrate(tmp_path, _config(kafka_bootstrap, topic, group_id, _through(proxy, pg_dsn)), pg_dsn)
        produce(kafka_bootstrap, topic, gen.next(1500))
        proxy.refuse()
        proc = start_ingest(["run", "-c", config, "--until-idle", "3", "--metrics-port", "0"], log_dir=tmp_path)
        wait_until(lambda: _retries(proc), 60, what="a retried write while connections are refused", proc=proc)
        assert count_rows(pg_dsn) == 0
        proxy.heal()
        _finish_and_check(proc, kafka_bootstrap, topic, group_id, pg_dsn)


def test_a_session_left_idle_in_a_transaction_releases_its_locks(pg_dsn):
    """A connection that goes silent mid-transaction leaves its server session holding the transaction's
    row locks (the server hears nothing of the client's close). Ingest's sessions carry
    idle_in_transaction_session_timeout = the client bound, so the server ends such a session and a
    retry on a new connection can write the row (without it the retry waited on the lock for ever).
    The left-behind session is played by a sink connection whose client stops talking mid-transaction."""
    import contextlib

    import psycopg

    from ingest.config import PipelineSettings
    from ingest.sinks.registry import backend

    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE locked (id bigint PRIMARY KEY, v text)")
        admin.execute("INSERT INTO locked VALUES (1, 'before')")
    p = PipelineSettings.model_validate({"name": "n", "topics": ["t"], "sink": {
        "dsn": pg_dsn, "table": "locked", "conflict_key": ["id"], "columns": {"id": {"type": "bigint"},
                                                                              "v": {"type": "text"}},
        "network": {"client_timeout_ms": CLIENT_TIMEOUT_MS}}})
    sink = backend("postgres").build(p, lanes=1)
    try:
        held = sink.connection()  # a pooled connection, configured as every sink connection is
        left = held.__enter__()
        assert left.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] in (
            f"{CLIENT_TIMEOUT_MS}ms", f"{CLIENT_TIMEOUT_MS // 1000}s")
        left.execute("BEGIN")
        left.execute("UPDATE locked SET v = 'zombie' WHERE id = 1")
        pid = left.info.backend_pid
        # the client says nothing more; another session waits for the row until the server ends this
        # one (its lock_timeout would raise instead if the lock were held for ever)
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("SET lock_timeout = '20s'")
            other.execute("UPDATE locked SET v = 'after' WHERE id = 1")
            # the ended session releases its locks as it aborts, and leaves pg_stat_activity a moment
            # later (a loaded machine: seen still listed right after the UPDATE)
            deadline = time.monotonic() + 5
            while (gone := other.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                         [pid]).fetchone()[0]) and time.monotonic() < deadline:
                time.sleep(0.1)
        assert gone == 0
        with contextlib.suppress(psycopg.Error):  # handing it back fails: the server ended its session
            held.__exit__(None, None, None)
    finally:
        sink.close()
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT v FROM locked").fetchone()[0] == "after"
