"""``columns: auto`` (issue #36 items 3, 4): tables created and evolved from the records' schemas.

Real broker, real PostgreSQL, ``python -m ingest`` subprocesses. Ground truth is the simulated source
tables (:mod:`harness.cdc_source`) and, for evolution, a small hand-made Debezium stream whose schema
changes mid-run: every sink table must end equal to its source, with the columns the schemas say,
committed offsets at the log end; what a table cannot take is dead-lettered (``schema_incompatible``)
while the other tables flow, and ``replay-dlq`` writes it once the table is fixed.
"""

from __future__ import annotations

import random
import signal
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import run_ingest, start_ingest, write_config
from harness.cdc_source import SourceTable, partition_of, produce_stream
from harness.debezium import encode_event
from harness.evolving import V1, V2, V3, V4, Evolving
from harness.kafka import TEST_CONSUMER_SETTINGS, create_topic, produce
from pipeline_helpers import assert_committed_at_log_end, dlq_rows, read_summary, wait_assigned, wait_until

pytestmark = pytest.mark.timeout(420)

PIPELINE = "mirror"
#: source tables: plain names, one with a dot (becomes ``_``), one needing quotes
TABLES = ["customers", "orders", "items.v2", 'Order "Lines"', "payments", "shipments"]


def _config(tmp_path: Path, bootstrap: str, pg_dsn: str, group_id: str, topics: list[str], *, deletes: str = "hard",
            **sink: Any) -> Path:
    pipeline = {
        "name": PIPELINE, "topics": topics, "topic_refresh_s": 2, "group_id": group_id, "envelope": "debezium",
        "deletes": {"mode": deletes}, "lanes": 2, "commit_interval_ms": 200, "shutdown_timeout_s": 10,
        "batch": {"max_rows": 300, "max_latency_ms": 100},
        "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "{source.table}", "columns": "auto", **sink},
        "dlq": {"kind": "postgres", "dsn": pg_dsn},
    }
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)}, "pipelines": [pipeline]})
    res = run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return config


def _registry_run(tmp_path: Path, bootstrap: str, registry_url: str, pipeline: dict[str, Any]) -> Path:
    """Write a config of ``pipeline`` with a schema registry, migrate, run it until idle (exit 0)."""
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "schema_registry": {"url": registry_url}, "pipelines": [pipeline]})
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    return config


def sink_rows(dsn: str, table: str, columns: str = "id, name, price, qty, updated_at", where: str = "") -> dict[int, tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(psycopg.sql.SQL("SELECT {} FROM {} {}").format(
            psycopg.sql.SQL(columns), psycopg.sql.Identifier("public", table), psycopg.sql.SQL(where))).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def _naive(ts: datetime | None) -> datetime | None:
    return ts.astimezone(timezone.utc).replace(tzinfo=None) if ts is not None and ts.tzinfo else ts


def source_rows(source: SourceTable) -> dict[int, tuple]:
    return {i: (r.name, r.price, r.qty, _naive(r.updated_at)) for i, r in source.rows.items()}


def table_columns(dsn: str, table: str) -> dict[str, tuple[str, bool]]:
    """column → (type as format_type spells it, NOT NULL)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            [psycopg.sql.Identifier("public", table).as_string(conn)]).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def primary_key(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = to_regclass(%s) AND i.indisprimary",
            [psycopg.sql.Identifier("public", table).as_string(conn)]).fetchall()
    return [r[0] for r in rows]


def _has_table(dsn: str, table: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                            [psycopg.sql.Identifier("public", table).as_string(conn)]).fetchone()[0]


@pytest.mark.parametrize(("delivery", "deletes"), [("at_least_once", "hard"), ("exactly_once", "hard"),
                                                   ("at_least_once", "soft")])
def test_tables_are_created_from_the_schemas_and_mirror_their_sources_through_a_kill(
        kafka_bootstrap, pg_dsn, group_id, tmp_path: Path, delivery: str, deletes: str) -> None:
    rng = random.Random(f"auto-{delivery}-{deletes}")
    prefix = f"db{rng.randrange(10**6)}"
    sources = [SourceTable(rng.randrange(2**32), keys=120, partitions=2, table=name, delete_frac=0.15,
                           snapshot_keys=40) for name in TABLES]
    late = SourceTable(rng.randrange(2**32), keys=60, partitions=2, table="late arrival", delete_frac=0.1)
    topics = [f"{prefix}.public.t{i}" for i in range(len(TABLES) + 1)]
    for topic in topics:
        create_topic(kafka_bootstrap, topic, 2)
    versioned = delivery == "exactly_once"  # one version for every table: the event's LSN
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\.t[0-9]+$"],
                     deletes=deletes, delivery=delivery,
                     **({"version": {"column": "lsn", "source": "@source.lsn"}} if versioned else {}))
    for topic, source in zip(topics, sources):
        produce_stream(kafka_bootstrap, topic, source.events(500))

    proc = start_ingest(["run", "--config", config, "--metrics-port", "0"], log_dir=tmp_path)
    wait_assigned(proc, timeout_s=90)
    wait_until(lambda: _has_table(pg_dsn, "customers") and len(sink_rows(pg_dsn, "customers")) > 0, 60,
               what="first table written", proc=proc)
    produce_stream(kafka_bootstrap, topics[-1], late.events(300))  # a table appears mid-run
    for topic, source in zip(topics, sources):
        produce_stream(kafka_bootstrap, topic, source.events(300))
    wait_until(lambda: _has_table(pg_dsn, "late arrival"), 60, what="the late table created", proc=proc)
    time.sleep(rng.uniform(0.2, 1.0))
    proc.kill9()
    assert proc.returncode == -signal.SIGKILL
    for topic, source in zip(topics, sources):
        produce_stream(kafka_bootstrap, topic, source.events(200))

    summary = tmp_path / "summary.json"
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0", "--summary-json",
                      summary], timeout_s=240, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    live = "WHERE deleted_at IS NULL" if deletes == "soft" else ""
    for source in [*sources, late]:
        name = source.table.replace(".", "_")
        assert sink_rows(pg_dsn, name, where=live) == source_rows(source), name
        if deletes == "soft":  # the deleted keys stay, marked
            assert set(sink_rows(pg_dsn, name, "id", "WHERE deleted_at IS NOT NULL")) == source.deleted, name
    assert dlq_rows(pg_dsn) == []
    for topic in topics:
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    # the columns the schemas say: the key from the record key, NOT NULL; precise decimals; MicroTimestamp
    assert table_columns(pg_dsn, "customers") == {
        "id": ("bigint", True), "name": ("text", False), "price": ("numeric(12,2)", False),
        "qty": ("integer", False), "updated_at": ("timestamp without time zone", False),
        "_ingest_stream": ("bigint", False), "_ingest_offset": ("bigint", False),
        **({"lsn": ("bigint", False)} if versioned else {}),
        **({"deleted_at": ("timestamp with time zone", False)} if deletes == "soft" else {})}
    assert primary_key(pg_dsn, "customers") == ["id"]
    stats = read_summary(summary)["pipelines"][PIPELINE]
    assert sum(stats["rows_written_by_table"].values()) == stats["rows_written"] > 0
    if versioned:  # every row carries its last event's LSN; an older event arriving late changes nothing
        assert sink_rows(pg_dsn, "customers", "id, lsn") == {i: (r.lsn,) for i, r in sources[0].rows.items()}
        key_id, row = next(iter(sources[0].rows.items()))
        stale = encode_event("u", None, {"id": key_id, "name": "stale", "price": None, "qty": 1, "updated_at": None},
                             fields=sources[0].fields, lsn=row.lsn - 1, ts_ms=1, schemas=True, table="customers")
        produce(kafka_bootstrap, topics[0], [(sources[0].key_bytes(key_id), stale, partition_of(key_id, 2), None)])
        res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                         log_dir=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert sink_rows(pg_dsn, "customers")[key_id] == source_rows(sources[0])[key_id]


# --------------------------------------------------------------------------- evolution

@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_columns_are_added_kept_and_an_incompatible_change_is_quarantined_then_replayed(
        kafka_bootstrap, pg_dsn, group_id, tmp_path: Path, delivery: str) -> None:
    prefix = f"evo{random.randrange(10**6)}"
    evo_topic, other_topic = f"{prefix}.public.evo", f"{prefix}.public.other"
    for topic in (evo_topic, other_topic):
        create_topic(kafka_bootstrap, topic, 1)
    evo, other = Evolving("evo"), Evolving("other")
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\..*"], delivery=delivery)
    produce(kafka_bootstrap, evo_topic, evo.upserts(V1, range(0, 50), lambda i: {"label": f"v1-{i}", "qty": i}))
    produce(kafka_bootstrap, other_topic, other.upserts(V1, range(0, 30), lambda i: {"label": f"o-{i}", "qty": i}))

    proc = start_ingest(["run", "--config", config, "--metrics-port", "0"], log_dir=tmp_path)
    wait_assigned(proc, timeout_s=90)
    wait_until(lambda: _has_table(pg_dsn, "evo") and len(sink_rows(pg_dsn, "evo", "id")) == 50, 60,
               what="v1 written", proc=proc)
    # a field appears: the column is added (nullable) before the first row that carries it
    produce(kafka_bootstrap, evo_topic, evo.upserts(V2, range(40, 80), lambda i: {"label": f"v2-{i}", "qty": -i,
                                                                                  "note": f"n{i}"}))
    # a field disappears: its column stays, written as NULL
    produce(kafka_bootstrap, evo_topic, evo.upserts(V3, range(70, 90), lambda i: {"label": f"v3-{i}", "note": "x"}))
    produce(kafka_bootstrap, evo_topic, evo.deletes(V3, [0, 1, 2]))
    wait_until(lambda: len(sink_rows(pg_dsn, "evo", "id")) == 87, 60, what="v2 and v3 written", proc=proc)
    # qty becomes text: incompatible with the integer column -- quarantined; the other table keeps flowing
    quarantined = evo.upserts(V4, range(100, 110), lambda i: {"label": f"v4-{i}", "qty": f"q{i}", "note": None})
    produce(kafka_bootstrap, evo_topic, quarantined)
    produce(kafka_bootstrap, other_topic, other.upserts(V1, range(30, 60), lambda i: {"label": f"o-{i}", "qty": i}))
    wait_until(lambda: len(dlq_rows(pg_dsn)) == 10 and len(sink_rows(pg_dsn, "other", "id")) == 60, 90,
               what="the incompatible records dead-lettered and the other table written", proc=proc)
    proc.terminate()
    assert proc.wait(60) == 0

    assert table_columns(pg_dsn, "evo") == {
        "id": ("bigint", True), "label": ("text", False), "qty": ("integer", False),
        "_ingest_stream": ("bigint", False), "_ingest_offset": ("bigint", False), "note": ("text", False)}
    dlq = dlq_rows(pg_dsn)
    assert {(d["stage"], d["error_class"]) for d in dlq} == {("write", "schema_incompatible")}, dlq
    assert all("qty" in d["error_message"] for d in dlq), dlq[0]["error_message"]
    expected = {i: (r["label"], r.get("qty"), r.get("note")) for i, r in evo.rows.items() if i < 100}
    assert sink_rows(pg_dsn, "evo", "id, label, qty, note") == expected

    # the operator makes the table take the new schema; replay writes the quarantined records once
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE evo ALTER COLUMN qty TYPE text")
    res = run_ingest(["replay-dlq", "--config", config, "--pipeline", PIPELINE, "--error-class",
                      "schema_incompatible"], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    expected = {i: (r["label"], None if r.get("qty") is None else str(r["qty"]), r.get("note"))
                for i, r in evo.rows.items()}
    assert sink_rows(pg_dsn, "evo", "id, label, qty, note") == expected
    assert sink_rows(pg_dsn, "other", "id, label, qty") == {i: (r["label"], r["qty"]) for i, r in other.rows.items()}
    assert_committed_at_log_end(kafka_bootstrap, group_id, evo_topic)
    assert_committed_at_log_end(kafka_bootstrap, group_id, other_topic)


# --------------------------------------------------------------------------- Avro through the registry


def test_debezium_avro_through_the_registry_creates_and_evolves_six_tables(
        kafka_bootstrap, pg_dsn, group_id, schema_registry, tmp_path: Path) -> None:
    """Debezium's Avro converter, six topics over a pattern: each table from the ``after`` record of its
    writer schema, the key from the key schema; a second writer schema mid-stream (a field added) adds
    its column to the tables whose topics carry it; deletes apply."""
    import json

    from harness.serde import avro_values
    from integration.test_cdc_formats import KEY_SCHEMA, VALUE_SCHEMA, Source

    prefix = f"avro{random.randrange(10**6)}"
    names = [f"tab{i}" for i in range(6)]
    v2 = json.loads(VALUE_SCHEMA)
    v2["fields"][0]["type"][1]["fields"].append({"name": "color", "type": ["null", "string"], "default": None})
    v2_text = json.dumps(v2)

    def encode(topic: str, table: str, schema: str,
               events: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[bytes, bytes | None]]:
        docs = [{**d, "source": {**d["source"], "table": table}} for _, d in events if d is not None]
        keys = avro_values(schema_registry.url, topic, KEY_SCHEMA, [{"id": i} for i, _ in events], field="key")
        values = iter(avro_values(schema_registry.url, topic, schema, docs))
        return [(k, None if d is None else next(values)) for k, (_, d) in zip(keys, events)]

    expected: dict[str, dict[int, dict[str, Any]]] = {}
    for n, table in enumerate(names):
        topic = f"{prefix}.public.{table}"
        create_topic(kafka_bootstrap, topic, 2)
        first, second = Source(), Source()
        for i in range(1, 41):
            first.upsert(i, i + n)
        for i in (3, 4, 5):
            first.delete(i, 40 + i)
        produce(kafka_bootstrap, topic, encode(topic, table, VALUE_SCHEMA, first.events))
        second.table = dict(first.table)
        if n % 2 == 0:  # the even tables' topics get a second writer schema with a new field
            for i in range(30, 61):
                second.upsert(i, 100 + i, color=None if i % 7 == 0 else f"c{i}")
            second.delete(31, 200)
            produce(kafka_bootstrap, topic, encode(topic, table, v2_text, second.events))
        expected[table] = second.table
    pipeline = {"name": PIPELINE, "topics": [f"^{prefix}\\.public\\..+"], "group_id": group_id, "format": "avro",
                "key_format": "avro", "envelope": "debezium", "lanes": 2, "commit_interval_ms": 200,
                "batch": {"max_rows": 25, "max_latency_ms": 100},
                "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "{source.table}", "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = _registry_run(tmp_path, kafka_bootstrap, schema_registry.url, pipeline)
    assert dlq_rows(pg_dsn) == []
    for n, table in enumerate(names):
        columns = {"id": ("bigint", True), "name": ("text", False), "price": ("numeric(12,2)", False),
                   "updated_at": ("timestamp with time zone", False), "_ingest_stream": ("bigint", False),
                   "_ingest_offset": ("bigint", False), **({"color": ("text", False)} if n % 2 == 0 else {})}
        assert table_columns(pg_dsn, table) == columns, table
        rows = {i: (r["name"], r["price"], r["updated_at"], r.get("color")) for i, r in expected[table].items()}
        got = sink_rows(pg_dsn, table, "id, name, price, updated_at, " + ("color" if n % 2 == 0 else "NULL"))
        assert got == rows, table
        assert 3 not in rows and (n % 2 == 1 or (31 not in rows and 60 in rows))
        assert_committed_at_log_end(kafka_bootstrap, group_id, f"{prefix}.public.{table}")
    res = run_ingest(["check", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0 and "columns auto" in res.stdout, res.stdout + res.stderr


def test_migrate_makes_no_table_without_a_schema_and_check_says_how_tables_are_made(
        kafka_bootstrap, pg_dsn, group_id, tmp_path: Path) -> None:
    prefix = f"mig{random.randrange(10**6)}"
    topic = f"{prefix}.public.accounts"
    create_topic(kafka_bootstrap, topic, 1)
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\.(?P<t>.+)$"])
    text = config.read_text().replace("'{source.table}'", "'{t}'")
    assert text != config.read_text()
    config.write_text(text)
    res = run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0 and "table accounts (topic " in res.stdout and "first record" in res.stdout, res.stdout
    assert not _has_table(pg_dsn, "accounts")
    res = run_ingest(["check", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"topic {topic} -> table accounts" in res.stdout and "columns auto" in res.stdout, res.stdout


def test_two_processes_racing_to_create_and_alter_the_same_tables_both_succeed(
        kafka_bootstrap, pg_dsn, tmp_path: Path) -> None:
    """Two pipelines (two consumer groups) mirror the same six topics into the same tables at once: every
    CREATE and ALTER one of them loses to the other is a success, and both end with the same tables."""
    prefix = f"race{random.randrange(10**6)}"
    sources = [Evolving(f"t{i}") for i in range(6)]
    topics = [f"{prefix}.public.t{i}" for i in range(6)]
    for topic in topics:
        create_topic(kafka_bootstrap, topic, 1)
    configs = [_config(tmp_path / name, kafka_bootstrap, pg_dsn, f"{prefix}-{name}", [f"^{prefix}\\.public\\..*"])
               for name in ("a", "b")]
    for round_, fields in enumerate((V1, V2)):
        for topic, source in zip(topics, sources):
            produce(kafka_bootstrap, topic, source.upserts(fields, range(round_ * 20, round_ * 20 + 40), lambda i: {
                "label": f"r{round_}-{i}", "qty": i, "note": f"n{i}"}))
        procs = [start_ingest(["run", "--config", c, "--until-idle", "2", "--metrics-port", "0"],
                              log_dir=c.parent) for c in configs]
        for proc in procs:
            assert proc.wait(120) == 0, proc.describe()
    for source in sources:
        expected = {i: (r["label"], r["qty"], r.get("note")) for i, r in source.rows.items()}
        assert sink_rows(pg_dsn, source.table, "id, label, qty, note") == expected, source.table
        assert list(table_columns(pg_dsn, source.table))[-1] == "note"
    assert dlq_rows(pg_dsn) == []


@pytest.mark.parametrize("fmt", ["json_schema", "protobuf"])
def test_debezium_json_schema_and_protobuf_through_the_registry_keyed_by_plain_json_keys(
        fmt, kafka_bootstrap, pg_dsn, new_topic, group_id, schema_registry, tmp_path: Path) -> None:
    """The table from the envelope's ``after`` object / message in the registry; the key's fields from a plain
    JSON record key (``{"id": 1}``), typed by the value's schema; deletes apply by it."""
    from integration.test_cdc_formats import ENCODERS, Source

    topic = new_topic(partitions=1)
    source = Source()
    for i in range(1, 31):
        source.upsert(i, i, name=None if i % 9 == 0 else f"n{i}")
    for i in (2, 4, 6):
        source.upsert(i, 100 + i, op="u")
    for i in (5, 7):
        source.delete(i, 200 + i)
    produce(kafka_bootstrap, topic, ENCODERS[fmt](schema_registry.url, topic, source.events))
    pipeline = {"name": PIPELINE, "topics": [topic], "group_id": group_id, "format": fmt, "envelope": "debezium",
                "commit_interval_ms": 200, "batch": {"max_rows": 10, "max_latency_ms": 100},
                "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "{source.table}", "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = _registry_run(tmp_path, kafka_bootstrap, schema_registry.url, pipeline)
    assert dlq_rows(pg_dsn) == []
    columns = table_columns(pg_dsn, "items")
    assert primary_key(pg_dsn, "items") == ["id"] and columns["id"] == ("bigint", True)
    assert columns["price"][0] == "text"  # both encode the decimal as its exact text
    if fmt == "protobuf":  # a google.protobuf.Timestamp
        assert columns["updated_at"][0] == "timestamp with time zone"
        expected = {i: (r["name"], str(r["price"]), r["updated_at"]) for i, r in source.table.items()}
    else:  # ISO 8601 text, as the envelope's schema says: a string
        assert columns["updated_at"][0] == "text"
        expected = {i: (r["name"], str(r["price"]), r["updated_at"].isoformat()) for i, r in source.table.items()}
    assert sink_rows(pg_dsn, "items", "id, name, price, updated_at") == expected
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_per_table_overrides_change_a_type_the_key_or_make_a_table_append_only(
        kafka_bootstrap, pg_dsn, group_id, tmp_path: Path) -> None:
    prefix = f"ov{random.randrange(10**6)}"
    topics = {name: f"{prefix}.public.{name}" for name in ("ov_a", "log", "plain")}
    for topic in topics.values():
        create_topic(kafka_bootstrap, topic, 1)
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\..*"], tables={
        "ov_*": {"conflict_key": ["label"], "columns": {"qty": {"type": "bigint"}}},
        "log": {"on_conflict": "none"}})
    sources = {name: Evolving(name) for name in topics}
    for name, topic in topics.items():  # ids 0..29, labels repeat every 10 ids
        produce(kafka_bootstrap, topic, sources[name].upserts(V1, range(30), lambda i: {"label": f"l{i % 10}", "qty": i}))
        produce(kafka_bootstrap, topic, sources[name].upserts(V1, range(5), lambda i: {"label": f"l{i % 10}", "qty": -i}))
    res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert dlq_rows(pg_dsn) == []
    # ov_a: keyed by label (the last record of each label wins), qty a bigint
    assert primary_key(pg_dsn, "ov_a") == ["label"] and table_columns(pg_dsn, "ov_a")["qty"] == ("bigint", False)
    by_label = {r["label"]: (r["id"], r["qty"]) for r in [
        *({"id": i, "label": f"l{i % 10}", "qty": i} for i in range(30)),
        *({"id": i, "label": f"l{i % 10}", "qty": -i} for i in range(5))]}
    assert sink_rows(pg_dsn, "ov_a", "label, id, qty") == by_label
    # log: every record a row, no key
    assert primary_key(pg_dsn, "log") == []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM log").fetchone()[0] == 35
    # plain: no override, keyed by the record key
    assert primary_key(pg_dsn, "plain") == ["id"] and table_columns(pg_dsn, "plain")["qty"] == ("integer", False)
    assert sink_rows(pg_dsn, "plain", "id, qty") == {i: (r["qty"],) for i, r in sources["plain"].rows.items()}


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_per_table_overrides_source_columns_version_a_table_and_soft_delete_another(
        kafka_bootstrap, pg_dsn, group_id, tmp_path: Path, delivery: str) -> None:
    """``tables:`` entries beside the sink's defaults (hard deletes, no version): ``vt`` versioned by its
    own ``qty`` (older updates and an older delete change nothing), ``st`` soft-deleting into ``gone``,
    ``src`` with columns sourced from the source block, the row image and the record's partition."""
    from harness.debezium import encode_key
    from harness.evolving import KEY

    prefix = f"tov{random.randrange(10**6)}"
    topics = {name: f"{prefix}.public.{name}" for name in ("vt", "st", "src", "hd")}
    for topic in topics.values():
        create_topic(kafka_bootstrap, topic, 1)
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\..*"], delivery=delivery,
                     tables={"vt": {"version_column": "qty"},
                             "st": {"deletes": {"mode": "soft", "soft_column": "gone"}},
                             "src": {"columns": {"lsn": {"type": "bigint", "source": "@source.lsn"},
                                                 "tag": {"type": "text", "source": "$.label"},
                                                 "part": {"type": "integer", "source": "@partition"}}}})
    lsn = iter(range(5000, 6000))

    def vt_event(op: str, i: int, qty: int, label: str) -> tuple[bytes, bytes, int, None]:
        image = {"id": i, "label": label, "qty": qty}
        return (encode_key({"id": i}, fields=KEY, schemas=True, table="vt"),
                encode_event(op, image if op == "d" else None, None if op == "d" else image, fields=V1,
                             lsn=next(lsn), ts_ms=1, schemas=True, table="vt"), 0, None)

    def run() -> None:
        res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                         log_dir=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]

    produce(kafka_bootstrap, topics["vt"], [vt_event("c", i, i * 10, f"a{i}") for i in range(20)])
    st, src, hd = Evolving("st"), Evolving("src"), Evolving("hd")
    for name, source in (("st", st), ("src", src), ("hd", hd)):
        produce(kafka_bootstrap, topics[name], source.upserts(V1, range(10), lambda i: {"label": f"s{i}", "qty": i}))
    lsn_of = {i: 1001 + i for i in range(10)}  # Evolving numbers its events' LSNs from 1001
    run()
    # later batches: only the table's version guard stands between these and the rows
    vt_events = [vt_event("u", i, i * 10 - 5, "stale") for i in range(10)]  # older versions: ignored
    vt_events += [vt_event("u", i, i * 10 + 5, f"new{i}") for i in range(5)]
    vt_events += [vt_event("d", i, i * 10, "gone") for i in range(15, 20)]  # as new as the row: applied
    vt_events += [vt_event("d", 17, 1, "old"), vt_event("c", 17, 2, "back")]  # older than the delete: ignored
    produce(kafka_bootstrap, topics["vt"], vt_events)
    for name, source in (("st", st), ("hd", hd)):
        produce(kafka_bootstrap, topics[name], source.deletes(V1, [0, 1, 2]))
    run()
    assert dlq_rows(pg_dsn) == []
    expected_vt = {i: (f"a{i}", i * 10) for i in range(5, 15)} | {i: (f"new{i}", i * 10 + 5) for i in range(5)}
    assert sink_rows(pg_dsn, "vt", "id, label, qty") == expected_vt
    assert primary_key(pg_dsn, "vt") == ["id"] and "lsn" not in table_columns(pg_dsn, "vt")
    assert sink_rows(pg_dsn, "st", "id, label, gone IS NOT NULL") == {i: (f"s{i}", i < 3) for i in range(10)}
    assert "deleted_at" not in table_columns(pg_dsn, "st")
    assert sink_rows(pg_dsn, "hd", "id, label") == {i: (f"s{i}",) for i in range(3, 10)}
    assert sink_rows(pg_dsn, "src", "id, lsn, tag, part") == {i: (lsn_of[i], f"s{i}", 0) for i in range(10)}
    assert {c: table_columns(pg_dsn, "src")[c] for c in ("lsn", "tag", "part")} == {
        "lsn": ("bigint", False), "tag": ("text", False), "part": ("integer", False)}
    for topic in topics.values():
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_a_tables_own_timestamp_version_column_orders_its_rows(kafka_bootstrap, pg_dsn, group_id, tmp_path: Path) -> None:
    """A ``timestamp`` (without time zone: Debezium's MicroTimestamp) version column: its values are written
    as the row mapper makes them (naive), compared as UTC -- an older update in a later batch changes nothing."""
    from datetime import timedelta

    from harness.debezium import Field, encode_key
    from harness.evolving import KEY

    prefix = f"tsv{random.randrange(10**6)}"
    topic = f"{prefix}.public.stamped"
    create_topic(kafka_bootstrap, topic, 1)
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\..*"],
                     tables={"stamped": {"version_column": "changed"}})
    fields = (Field("id", "int64", optional=False), Field("label", "string"), Field("changed", "micro_timestamp"))
    base = datetime(2026, 3, 1, 12, 0, 0)
    lsn = iter(range(100, 1000))

    def event(i: int, minutes: int, label: str) -> tuple[bytes, bytes, int, None]:
        after = {"id": i, "label": label, "changed": base + timedelta(minutes=minutes)}
        return (encode_key({"id": i}, fields=KEY, schemas=True, table="stamped"),
                encode_event("u", None, after, fields=fields, lsn=next(lsn), ts_ms=1, schemas=True, table="stamped"),
                0, None)

    def run() -> None:
        res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                         log_dir=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]

    produce(kafka_bootstrap, topic, [event(i, 10, f"first{i}") for i in range(5)])
    run()
    produce(kafka_bootstrap, topic, [event(i, 5, "stale") for i in range(5)] + [event(0, 20, "newer")])
    run()
    assert dlq_rows(pg_dsn) == []
    assert table_columns(pg_dsn, "stamped")["changed"] == ("timestamp without time zone", False)
    assert sink_rows(pg_dsn, "stamped", "id, label, changed") == {
        0: ("newer", base + timedelta(minutes=20)), **{i: (f"first{i}", base + timedelta(minutes=10)) for i in range(1, 5)}}


def test_migrate_dry_run_check_and_migrate_plan_tables_from_the_latest_registry_schemas(
        kafka_bootstrap, pg_dsn, group_id, schema_registry, tmp_path: Path) -> None:
    import json

    from harness.serde import avro_values
    from integration.test_cdc_formats import KEY_SCHEMA, VALUE_SCHEMA, Source

    prefix = f"plan{random.randrange(10**6)}"
    topic = f"{prefix}.public.accounts"
    create_topic(kafka_bootstrap, topic, 1)
    source = Source()
    source.upsert(1, 1)

    def register(schema: str) -> None:  # the serializer registers the subjects
        avro_values(schema_registry.url, topic, schema, [d for _, d in source.events])
        avro_values(schema_registry.url, topic, KEY_SCHEMA, [{"id": 1}], field="key")

    register(VALUE_SCHEMA)
    pipeline = {"name": PIPELINE, "topics": [f"^{prefix}\\.public\\.(?P<t>.+)$"], "group_id": group_id,
                "format": "avro", "key_format": "avro", "envelope": "debezium",
                "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "{t}", "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "schema_registry": {"url": schema_registry.url}, "pipelines": [pipeline]})

    def ingest(*args: str) -> str:
        res = run_ingest([*args, "--config", config], timeout_s=60, log_dir=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr[-3000:]
        return res.stdout

    out = ingest("migrate", "--dry-run")
    assert f"table accounts (topic {topic}): would be created" in out and 'CREATE TABLE IF NOT EXISTS "public"."accounts"' in out, out
    assert not _has_table(pg_dsn, "accounts")
    assert "would be created" in ingest("check")
    out = ingest("migrate")
    assert "table accounts" in out and ": created" in out, out
    assert primary_key(pg_dsn, "accounts") == ["id"] and "_ingest_offset" in table_columns(pg_dsn, "accounts")
    assert "exists and takes its latest schema" in ingest("check")

    wider = json.loads(VALUE_SCHEMA)  # a field added in the latest schema
    wider["fields"][0]["type"][1]["fields"].append({"name": "color", "type": ["null", "string"], "default": None})
    register(json.dumps(wider))
    out = ingest("migrate", "--dry-run")
    assert "would be altered" in out and '"color"' in out and "ALTER TABLE" in out, out
    assert "color" not in table_columns(pg_dsn, "accounts")
    assert "would be altered" in ingest("check")

    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a table its latest schema cannot fit
        conn.execute("ALTER TABLE accounts ALTER COLUMN name TYPE integer USING NULL")
    out = ingest("check")
    assert "warn" in out and "incompatible with its latest schema" in out and "'name'" in out, out


def test_migrate_leaves_a_table_keyed_by_plain_json_keys_to_its_first_record(
        kafka_bootstrap, pg_dsn, group_id, schema_registry, tmp_path: Path) -> None:
    """Registry values with plain JSON keys: only a record says the key, so migrate does not make the table
    (one made without its key would refuse every record); the run makes it, keyed by the record key."""
    from integration.test_cdc_formats import ENCODERS, Source

    prefix = f"pk{random.randrange(10**6)}"
    topic = f"{prefix}.public.items"
    create_topic(kafka_bootstrap, topic, 1)
    source = Source()
    for i in range(1, 11):
        source.upsert(i, i)
    produce(kafka_bootstrap, topic, ENCODERS["json_schema"](schema_registry.url, topic, source.events))
    pipeline = {"name": PIPELINE, "topics": [f"^{prefix}\\.public\\.(?P<t>.+)$"], "group_id": group_id,
                "format": "json_schema", "envelope": "debezium",
                "sink": {"kind": "postgres", "dsn": pg_dsn, "table": "{t}", "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "schema_registry": {"url": schema_registry.url}, "pipelines": [pipeline]})
    res = run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0 and "its key comes with each record" in res.stdout, res.stdout + res.stderr
    assert not _has_table(pg_dsn, "items")
    res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert dlq_rows(pg_dsn) == [] and primary_key(pg_dsn, "items") == ["id"]
    assert len(sink_rows(pg_dsn, "items", "id")) == 10
