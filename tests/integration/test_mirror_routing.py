"""One pipeline, many tables (issue #36 items 1, 2, 6): a pattern subscription routed by a table template.

Real broker, real PostgreSQL, ``python -m ingest`` subprocesses. Ground truth is the simulated
source tables (:mod:`harness.cdc_source`): every sink table must end equal to its source table
(deletes included), committed offsets at each topic's log end, nothing in the DLQ but the records
that cannot be routed (class ``unroutable``, each with its reason).
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest, start_ingest, write_config
from harness.cdc_source import SourceTable, produce_stream
from harness.kafka import TEST_CONSUMER_SETTINGS, create_topic, produce
from pipeline_helpers import assert_committed_at_log_end, dlq_rows, read_summary, wait_assigned, wait_until

pytestmark = pytest.mark.timeout(420)

PIPELINE = "mirror"
#: source tables: plain names, one with a dot (becomes ``_``), one needing quotes
TABLES = ["customers", "orders", "items.v2", 'Order "Lines"', "payments", "shipments"]


def columns() -> dict[str, Any]:
    return {"id": {"type": "bigint", "required": True}, "name": {"type": "text"}, "price": {"type": "numeric(12,2)"},
            "qty": {"type": "integer"}, "updated_at": {"type": "timestamptz"},
            "lsn": {"type": "bigint", "source": "@source.lsn"}}


def sink_rows(dsn: str, table: str) -> dict[int, tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(psycopg.sql.SQL("SELECT id, name, price, qty, updated_at, lsn FROM {}").format(
            psycopg.sql.Identifier("public", table))).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def source_rows(source: SourceTable) -> dict[int, tuple]:
    return {i: (r.name, r.price, r.qty, r.updated_at, r.lsn) for i, r in source.rows.items()}


def topic_of(prefix: str, i: int) -> str:
    return f"{prefix}.public.t{i}"


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_a_pattern_mirrors_every_table_with_one_appearing_mid_run_and_a_kill(
        kafka_bootstrap, pg_dsn, group_id, tmp_path: Path, delivery: str) -> None:
    rng = random.Random(f"mirror-{delivery}")
    prefix = f"db{rng.randrange(10**6)}"
    sources = [SourceTable(rng.randrange(2**32), keys=120, partitions=2, table=name, delete_frac=0.15,
                           snapshot_keys=40) for name in TABLES]
    late = SourceTable(rng.randrange(2**32), keys=60, partitions=2, table="late arrival", delete_frac=0.1)
    for i in range(len(TABLES) + 1):
        create_topic(kafka_bootstrap, topic_of(prefix, i), 2)
    pipeline = {
        "name": PIPELINE, "topics": [f"^{prefix}\\.public\\.t[0-9]+$"], "topic_refresh_s": 2,
        "group_id": group_id, "envelope": "debezium", "deletes": {"mode": "hard"}, "lanes": 2,
        "commit_interval_ms": 200, "shutdown_timeout_s": 10, "batch": {"max_rows": 300, "max_latency_ms": 100},
        "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "{source.table}", "conflict_key": ["id"],
                 "version_column": "lsn", "delivery": delivery, "columns": columns()},
        "dlq": {"kind": "postgres", "dsn": pg_dsn},
    }
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)}, "pipelines": [pipeline]})
    res = run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0 and "each created when its first record arrives" in res.stdout, res.stdout + res.stderr
    for i, source in enumerate(sources):
        produce_stream(kafka_bootstrap, topic_of(prefix, i), source.events(500))

    proc = start_ingest(["run", "--config", config, "--metrics-port", "0"], log_dir=tmp_path)
    wait_assigned(proc, timeout_s=90)
    wait_until(lambda: _has_table(pg_dsn, "customers") and len(sink_rows(pg_dsn, "customers")) > 0, 60,
               what="first table written", proc=proc)
    # a table whose topic had no record yet gets its first ones while running; more of the others too
    produce_stream(kafka_bootstrap, topic_of(prefix, len(TABLES)), late.events(300))
    for i, source in enumerate(sources):
        produce_stream(kafka_bootstrap, topic_of(prefix, i), source.events(300))
    wait_until(lambda: _has_table(pg_dsn, "late arrival"), 60, what="the late table created", proc=proc)
    time.sleep(rng.uniform(0.2, 1.0))
    proc.kill9()
    assert proc.returncode == -signal.SIGKILL
    for i, source in enumerate(sources):
        produce_stream(kafka_bootstrap, topic_of(prefix, i), source.events(200))

    summary = tmp_path / "summary.json"
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0", "--summary-json",
                      summary], timeout_s=240, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    for source in [*sources, late]:
        name = source.table.replace(".", "_")
        assert sink_rows(pg_dsn, name) == source_rows(source), name
    assert dlq_rows(pg_dsn) == []
    for i in range(len(TABLES) + 1):
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic_of(prefix, i))
    stats = read_summary(summary)["pipelines"][PIPELINE]
    by_table = stats["rows_written_by_table"]  # the final run's rows, per table
    assert by_table and set(by_table) <= {s.table.replace(".", "_") for s in [*sources, late]}
    assert sum(by_table.values()) == stats["rows_written"]


def _has_table(dsn: str, table: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [psycopg.sql.Identifier("public", table).as_string(conn)]
                            ).fetchone()[0]


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_records_that_cannot_be_routed_are_dead_lettered_with_their_reason(kafka_bootstrap, pg_dsn, new_topic,
                                                                          group_id, tmp_path: Path, delivery: str) -> None:
    """``{header.tenant}``: a missing header, a reserved name, a name over 63 bytes and a second
    spelling of a name (case) are ``unroutable``; a name with quotes and spaces is a table."""
    topic = new_topic(1)  # one partition: "acme" comes before "ACME", so it owns the name
    tenants: list[str | None] = ["acme", "beta", None, "ingest_offsets", "x" * 200, "ACME", "o'k \"t\" 1", "acme"]
    messages = []
    for i, tenant in enumerate(tenants):
        headers = [("tenant", tenant.encode())] if tenant is not None else None
        messages.append((str(i).encode(), json.dumps({"id": i, "name": f"n{i}"}).encode(), None, headers))
    assert produce(kafka_bootstrap, topic, messages) == len(messages)
    config = run_by_tenant(kafka_bootstrap, pg_dsn, topic, group_id, tmp_path, delivery=delivery)
    # "acme" and "ACME" arrive in one batch here; which spelling comes first decides which one owns it
    dead = {json.loads(d["value"])["id"]: d for d in dlq_rows(pg_dsn)}
    assert set(dead) == {2, 3, 4, 5}, {k: v["error_message"] for k, v in dead.items()}
    for d in dead.values():
        assert (d["stage"], d["error_class"]) == ("route", "unroutable"), d
    assert "no header" in dead[2]["error_message"] or "header" in dead[2]["error_message"]
    assert "offsets tables" in dead[3]["error_message"]
    assert "63" in dead[4]["error_message"]
    assert "only in case" in dead[5]["error_message"]
    assert sink_names(pg_dsn) == {"acme": {0, 7}, "beta": {1}, "o'k \"t\" 1": {6}}
    assert sum(assert_committed_at_log_end(kafka_bootstrap, group_id, topic).values()) == len(messages)


def run_by_tenant(bootstrap: str, dsn: str, topic: str, group: str, tmp_path: Path,
                  delivery: str = "at_least_once") -> Path:
    """Migrate and run (until idle, exit 0) a pipeline routing ``topic`` by ``{header.tenant}``; its config."""
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "pipelines": [{"name": PIPELINE, "topics": [topic], "group_id": group,
                                                    "sink": {"dsn": dsn, "table": "{header.tenant}",
                                                             "conflict_key": ["id"], "delivery": delivery,
                                                             "columns": {"id": {"type": "bigint"},
                                                                         "name": {"type": "text"}}}}]})
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0", "--summary-json",
                      tmp_path / "summary.json"], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return config


def sink_names(dsn: str) -> dict[str, set[int]]:
    out = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' AND table_name NOT LIKE "
            "'ingest%'").fetchall()]
        for name in names:
            out[name] = {r[0] for r in conn.execute(psycopg.sql.SQL("SELECT id FROM {}").format(
                psycopg.sql.Identifier("public", name))).fetchall()}
    return out


def test_a_table_already_there_owns_its_spelling(kafka_bootstrap, pg_dsn, new_topic, group_id, tmp_path: Path) -> None:
    """A table made before the run (``Acme``) owns the name: records for ``acme`` are unroutable
    (case collision), not written into a second table beside it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('CREATE TABLE "Acme" (id bigint PRIMARY KEY, name text, _ingest_stream bigint, '
                     '_ingest_offset bigint)')
    topic = new_topic(1)
    produce(kafka_bootstrap, topic, [(b"1", b'{"id": 1, "name": "a"}', None, [("tenant", b"acme")]),
                                     (b"2", b'{"id": 2, "name": "b"}', None, [("tenant", b"Acme")])])
    config = run_by_tenant(kafka_bootstrap, pg_dsn, topic, group_id, tmp_path)
    assert sink_names(pg_dsn) == {"Acme": {2}}
    dead = dlq_rows(pg_dsn)
    assert [(json.loads(d["value"])["id"], d["error_class"]) for d in dead] == [(1, "unroutable")]
    assert "only in case" in dead[0]["error_message"]


def test_check_lists_the_table_each_topic_routes_to(kafka_bootstrap, pg_dsn, group_id, tmp_path: Path) -> None:
    prefix = f"chk{random.randrange(10**6)}"
    for name in ("orders", "order.lines", "ingest_offsets"):
        create_topic(kafka_bootstrap, f"{prefix}.public.{name}", 1)
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "pipelines": [{"name": PIPELINE, "topics": [f"^{prefix}\\.public\\.(?P<t>.+)$"],
                                                    "group_id": group_id,
                                                    "sink": {"dsn": pg_dsn, "table": "{t}", "conflict_key": ["id"],
                                                             "columns": {"id": {"type": "bigint"}}}}]})
    res = run_ingest(["check", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"topic {prefix}.public.orders -> table orders" in res.stdout
    assert f"topic {prefix}.public.order.lines -> table order_lines" in res.stdout
    assert f"topic {prefix}.public.ingest_offsets cannot be routed: table name 'ingest_offsets' is one of" in res.stdout
    assert "write tier: columnar" in res.stdout  # plain JSON routed by the topic: the tier splits batches by table
    # migrate creates the tables of the topics that exist (the run creates the others on their first record)
    res = run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"table orders (topic {prefix}.public.orders)" in res.stdout
    assert _has_table(pg_dsn, "orders") and _has_table(pg_dsn, "order_lines")
    assert "cannot be routed" in res.stdout


def test_a_pattern_mirrors_every_table_into_clickhouse(kafka_bootstrap, pg_dsn, group_id, chdb, tmp_path: Path) -> None:
    """The same routing into chDB: each table created on its first record (ReplacingMergeTree by the
    version, deletes hidden by FINAL), each equal to its source table."""
    rng = random.Random("mirror-ch")
    prefix = f"ch{rng.randrange(10**6)}"
    sources = [SourceTable(rng.randrange(2**32), keys=80, partitions=2, table=name, delete_frac=0.15,
                           replica_identity="full") for name in TABLES[1:4]]
    for i in range(len(sources)):
        create_topic(kafka_bootstrap, topic_of(prefix, i), 2)
        produce_stream(kafka_bootstrap, topic_of(prefix, i), sources[i].events(400))
    url = chdb.url
    chdb.close()  # the ingest subprocess owns the chDB path while it runs
    pipeline = {
        "name": PIPELINE, "topics": [f"^{prefix}\\.public\\.t[0-9]+$"], "group_id": group_id,
        "envelope": "debezium", "deletes": {"mode": "hard"}, "lanes": 2, "commit_interval_ms": 200,
        "sink": {"kind": "clickhouse", "url": url, "database": "mirror", "table": "{source.table}",
                 "order_by": ["id"], "version_column": "lsn",
                 "columns": {"id": {"type": "Int64"}, "name": {"type": "Nullable(String)"},
                             "price": {"type": "Nullable(Decimal(12, 2))"}, "qty": {"type": "Nullable(Int32)"},
                             "updated_at": {"type": "Nullable(DateTime64(6, 'UTC'))"},
                             "lsn": {"type": "UInt64", "source": "@source.lsn"}}},
        "dlq": {"kind": "postgres", "dsn": pg_dsn},
    }
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)}, "pipelines": [pipeline]})
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0"], timeout_s=180,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    client = chdb.client()
    try:
        for source in sources:
            name = source.table.replace(".", "_")
            got = client.query(f"SELECT id, name, price, qty, updated_at, lsn FROM mirror.`{name.replace('`', '')}` "
                               "FINAL WHERE _ingest_deleted = 0").result_rows
            want = source_rows(source)
            assert {r[0]: (r[1], r[2], r[3], r[4].replace(tzinfo=None) if r[4] else None, r[5]) for r in got} == {
                k: (v[0], v[1], v[2], v[3].replace(tzinfo=None) if v[3] else None, v[4]) for k, v in want.items()}, name
    finally:
        chdb.close()
    assert dlq_rows(pg_dsn) == []


def test_a_row_one_table_refuses_is_isolated_and_the_other_tables_are_written(kafka_bootstrap, pg_dsn, new_topic,
                                                                             group_id, tmp_path: Path) -> None:
    """Every table's upsert of a batch is one statement round; a row one table refuses (a CHECK) fails
    the batch, which is split until that record alone is dead-lettered (stage ``write``)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('CREATE TABLE acme (id bigint PRIMARY KEY, name text, _ingest_stream bigint, '
                     '_ingest_offset bigint, CHECK (id < 100))')
    topic = new_topic(1)
    rows = [(1, "acme"), (200, "acme"), (3, "acme"), (4, "beta"), (5, "beta"), (6, "gamma")]
    produce(kafka_bootstrap, topic, [(str(i).encode(), json.dumps({"id": i, "name": f"n{i}"}).encode(), None,
                                      [("tenant", t.encode())]) for i, t in rows])
    config = run_by_tenant(kafka_bootstrap, pg_dsn, topic, group_id, tmp_path)
    stats = read_summary(tmp_path / "summary.json")["pipelines"][PIPELINE]
    assert stats["dead_lettered_by_table"] == {"acme": 1}
    assert stats["rows_written_by_table"] == {"acme": 2, "beta": 2, "gamma": 1}
    assert sink_names(pg_dsn) == {"acme": {1, 3}, "beta": {4, 5}, "gamma": {6}}
    dead = dlq_rows(pg_dsn)
    assert [(json.loads(d["value"])["id"], d["stage"]) for d in dead] == [(200, "write")], dead
    # the table is fixed; replay-dlq routes the record again and writes it into its own table, once
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE acme DROP CONSTRAINT acme_id_check")
    for replayed in (1, 0):
        res = run_ingest(["replay-dlq", "--config", config, "--pipeline", PIPELINE], timeout_s=120, log_dir=tmp_path)
        assert res.returncode == 0 and f"replayed {replayed}," in res.stdout, res.stdout + res.stderr
    assert sink_names(pg_dsn) == {"acme": {1, 3, 200}, "beta": {4, 5}, "gamma": {6}}


def test_a_role_that_may_only_write_its_tables_writes_them(pg_dsn: str) -> None:
    """Tables made beforehand, and a role with DML (and TEMP) rights only: routing runs no DDL for a
    table that is there with its columns, so it needs no CREATE or ownership (it failed before)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from ingest.cdc.mapper import mapper_for
    from ingest.config import PipelineSettings
    from ingest.sinks.registry import backend
    from ingest.types import Record

    role = f"writer_{random.randrange(10**9)}"
    db = conninfo_to_dict(pg_dsn)["dbname"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for t in ("acme", "beta"):
            conn.execute(f'CREATE TABLE "{t}" (id bigint PRIMARY KEY, name text, _ingest_stream bigint, '
                         '_ingest_offset bigint)')
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        conn.execute(f'GRANT CONNECT, TEMP ON DATABASE "{db}" TO {role}')
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE ON acme, beta TO {role}")
    try:
        dsn = make_conninfo(pg_dsn, user=role, password="pw")
        p = PipelineSettings.model_validate({
            "name": PIPELINE, "topics": ["t"], "dlq": {"kind": "kafka", "topic": "d"},
            "sink": {"dsn": dsn, "table": "{header.tenant}", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint"}, "name": {"type": "text"}}}})
        m = mapper_for(p)
        sink = backend("postgres").build(p, lanes=1)
        try:
            sink.write([m.map(Record("t", 0, i, None, json.dumps({"id": i, "name": "x"}).encode(), 0,
                                     (("tenant", t.encode()),)))[0] for i, t in enumerate(["acme", "beta", "acme"])])
        finally:
            sink.close()
        assert sink_names(pg_dsn) == {"acme": {0, 2}, "beta": {1}}
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"REVOKE ALL ON acme, beta FROM {role}")
            conn.execute(f"REVOKE ALL ON SCHEMA public FROM {role}")
            conn.execute(f'REVOKE ALL ON DATABASE "{db}" FROM {role}')
            conn.execute(f"DROP ROLE {role}")


def test_routed_batches_on_the_columnar_tier_write_what_the_row_path_writes(
        kafka_bootstrap, pg_dsn, tmp_path: Path) -> None:
    """A template reading the topic only: the columnar tier splits each batch by table (one key in two
    tables is two rows), and every table, the DLQ and the committed offsets equal the row path's."""
    rng = random.Random("routed-columnar")
    prefix = f"rc{rng.randrange(10**6)}"
    names = ["orders", "items", "payments", "ingest_offsets"]  # the last cannot be a table: unroutable
    for name in names:
        create_topic(kafka_bootstrap, f"{prefix}.{name}", 2)
    for name in names:
        records = []
        for i in range(600 if name != "ingest_offsets" else 20):
            key = rng.randrange(150)  # the same keys in every table, updated often
            doc: Any = {"id": key, "name": f"{name}-{i}", "amount": rng.randrange(10**8) / 100,
                        "ts": f"2026-12-05T10:{i % 60:02d}:00Z"}
            r = rng.random()
            if r < 0.01:
                value = b'{"id": 1, "name":'  # not JSON
            elif r < 0.02:
                value = json.dumps({"name": "no id"}).encode()  # a required column missing
            elif r < 0.03:
                value = json.dumps({**doc, "id": "seven"}).encode()  # a value of another type
            else:
                value = json.dumps(doc).encode()
            records.append((str(key).encode(), value))
        produce(kafka_bootstrap, f"{prefix}.{name}", records)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA tier_on; CREATE SCHEMA tier_off")
    results = {}
    for tier in ("on", "off"):
        pipeline = {
            "name": f"rc_{tier}", "topics": [f"^{prefix}\\.(?P<t>.+)$"], "group_id": f"{prefix}-{tier}", "lanes": 2,
            "batch": {"max_rows": 300, "max_latency_ms": 100}, "commit_interval_ms": 200,
            "columnar": tier == "on" or False,
            "sink": {"kind": "postgres", "dsn": pg_dsn, "schema": f"tier_{tier}", "table": "{t}", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "name": {"type": "text"},
                                 "amount": {"type": "numeric(12,2)"}, "ts": {"type": "timestamptz"}}},
            "dlq": {"kind": "postgres", "dsn": pg_dsn, "table": f"dlq_{tier}"},
        }
        config = write_config(tmp_path / tier, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                                          "client": dict(TEST_CONSUMER_SETTINGS)},
                                                "pipelines": [pipeline]})
        assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
        summary = tmp_path / tier / "summary.json"
        res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0", "--summary-json",
                          summary], timeout_s=180, log_dir=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        stats = read_summary(summary)["pipelines"][f"rc_{tier}"]
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            tables = {name: sorted(conn.execute(psycopg.sql.SQL("SELECT id, name, amount, ts FROM {}").format(
                psycopg.sql.Identifier(f"tier_{tier}", name))).fetchall()) for name in names[:-1]}
            dlq = conn.execute(psycopg.sql.SQL('SELECT topic, "partition", "offset", stage, error_class FROM {} '
                                               "ORDER BY 1, 2, 3").format(psycopg.sql.Identifier(f"dlq_{tier}"))
                               ).fetchall()
        for name in names:
            assert_committed_at_log_end(kafka_bootstrap, f"{prefix}-{tier}", f"{prefix}.{name}")
        results[tier] = (tables, dlq, stats)
    (on_tables, on_dlq, on_stats), (off_tables, off_dlq, off_stats) = results["on"], results["off"]
    assert on_tables == off_tables and all(len(rows) > 100 for rows in on_tables.values())
    assert on_dlq == off_dlq and {r[4] for r in on_dlq} >= {"unroutable", "invalid_json", "missing_field"}
    assert on_stats["columnar_records"] > on_stats["records_consumed"] / 2 and off_stats.get("columnar_records", 0) == 0
    assert set(on_stats["rows_written_by_table"]) == set(names[:-1])
    assert sum(on_stats["rows_written_by_table"].values()) == on_stats["rows_written"]
