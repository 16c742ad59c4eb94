"""``columns: auto`` into ClickHouse (issue #36): tables created and evolved from the records' schemas.

Real engines: chDB in-process (modern ClickHouse) -- the sink itself driven batch by batch (create,
evolve, incompatible, a table altered and dropped behind ingest's back), then ``python -m ingest``
subprocesses owning the chDB path (six tables over a pattern with a late table, deletes and a SIGKILL,
equal to their sources with ``FINAL``; a column added mid-stream; an incompatible change dead-lettered while
another table flows, replayed after the table is fixed by hand) -- and the real server the harness
starts (Debian's 18.16 here, through the test-only shim: no deletes engine, no Arrow, no tokens).
"""

from __future__ import annotations

import random
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from harness import run_ingest, start_ingest, write_config
from harness.cdc_source import SourceTable, produce_stream
from harness.clickhouse import http_client, needs_shim, sink_conn
from harness.evolving import V1, V2, V3, V4, Evolving
from harness.debezium import Field, encode_event, encode_key
from harness.kafka import TEST_CONSUMER_SETTINGS, committed_offsets, create_topic, produce
from pipeline_helpers import assert_committed_at_log_end, dlq_rows, wait_assigned, wait_until

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.errors import PermanentError, TransientError
from ingest.sinks.clickhouse.backend import BACKEND
from ingest.sinks.clickhouse.sink import ClickHouseSink

pytestmark = pytest.mark.timeout(420)

PIPELINE = "mirror"
DB = "mirror"
TABLES = ["customers", "orders", "items.v2", 'Order "Lines"', "payments", "shipments"]
KEY = (Field("id", "int64", optional=False),)
def _settings(url: str, *, deletes: bool = True, dsn: str = "postgresql://x@127.0.0.1/x", **sink: Any) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": PIPELINE, "topics": ["^db\\.public\\..*"], "envelope": "debezium",
        **({"deletes": {"mode": "hard"}} if deletes else {}),
        "sink": {"kind": "clickhouse", "url": url, "table": "{source.table}", "columns": "auto",
                 **{"database": DB, **sink}},
        "dlq": {"kind": "postgres", "dsn": dsn}})


class Feed:
    """Change events of :class:`Evolving` tables as records, mapped by a pipeline's mapper (offsets count up)."""

    def __init__(self, p: PipelineSettings) -> None:
        self.mapper = mapper_for(p)
        self.offset = 0

    def rows(self, events: list[tuple[bytes, bytes | None, int, None]], table: str) -> list[tuple[Any, ...]]:
        from ingest.errors import NoChange
        from ingest.types import Record

        out = []
        for key, value, _, _ in events:
            self.offset += 1
            try:
                out.append(self.mapper.map(Record(f"db.public.{table}", 0, self.offset, key, value, 0))[0])
            except NoChange:
                pass
        return out


def live(client: Any, table: str, columns: str = "id, label, qty, note", db: str = DB) -> dict[int, tuple]:
    q = f"SELECT {columns} FROM `{db}`.`{table}` FINAL WHERE _ingest_deleted = 0"
    return {r[0]: tuple(r[1:]) for r in client.query(q).result_rows}


def ch_columns(client: Any, table: str, db: str = DB) -> dict[str, str]:
    return dict(client.query("SELECT name, type FROM system.columns WHERE database = {d:String} AND "
                             "table = {t:String} ORDER BY position", parameters={"d": db, "t": table}).result_rows)


def engine(client: Any, table: str, db: str = DB) -> tuple[str, str]:
    return client.query("SELECT engine_full, sorting_key FROM system.tables WHERE database = {d:String} AND "
                        "name = {t:String}", parameters={"d": db, "t": table}).result_rows[0]


# --------------------------------------------------------------------------- the sink, batch by batch (chDB)


def test_the_sink_creates_evolves_refuses_and_repairs_tables_batch_by_batch(chdb) -> None:
    p = _settings(chdb.url)
    sink = BACKEND.build(p, lanes=1)
    feed = Feed(p)
    evo, other = Evolving("evo"), Evolving("other")
    try:
        # first sight: each table from its batch's schemas, ReplacingMergeTree by the hidden version, ORDER BY the key
        sink.write(feed.rows(evo.upserts(V1, range(0, 20), lambda i: {"label": f"v1-{i}", "qty": i}), "evo")
                   + feed.rows(other.upserts(V1, range(0, 5), lambda i: {"label": f"o-{i}", "qty": i}), "other"))
        client = sink.client()
        engine_full, sorting_key = engine(client, "evo")
        assert engine_full.startswith("ReplacingMergeTree(_version, _ingest_deleted)"), engine_full
        assert sorting_key.strip("()") == "id"
        assert ch_columns(client, "evo") == {"id": "Int64", "label": "Nullable(String)", "qty": "Nullable(Int32)",
                                             "_version": "UInt64", "_ingest_deleted": "UInt8"}
        # a field appears: its column is added (Nullable) before the rows that carry it; deletes in the same batch
        sink.write(feed.rows(evo.upserts(V2, range(15, 30), lambda i: {"label": f"v2-{i}", "qty": -i,
                                                                       "note": f"n{i}"}), "evo")
                   + feed.rows(evo.deletes(V2, [0, 1, 2]), "evo"))
        assert list(ch_columns(client, "evo"))[-1] == "note" and ch_columns(client, "evo")["note"] == "Nullable(String)"
        # a field disappears: its column stays, NULL for the new rows
        sink.write(feed.rows(evo.upserts(V3, range(25, 35), lambda i: {"label": f"v3-{i}", "note": "x"}), "evo"))
        expected = {i: (r["label"], r.get("qty"), r.get("note")) for i, r in evo.rows.items()}
        assert live(client, "evo") == expected
        # an incompatible schema: refused before anything of the batch is written, the table untouched
        before = client.query("SELECT count() FROM mirror.other").result_rows[0][0]
        bad = feed.rows(evo.upserts(V4, range(100, 102), lambda i: {"label": "v4", "qty": f"q{i}", "note": None}), "evo")
        with pytest.raises(PermanentError) as err:
            sink.write(bad + feed.rows(other.upserts(V1, range(5, 8), lambda i: {"label": "o", "qty": i}), "other"))
        assert err.value.error_class == "schema_incompatible" and "qty" in str(err.value), err.value
        assert client.query("SELECT count() FROM mirror.other").result_rows[0][0] == before
        assert ch_columns(client, "evo")["qty"] == "Nullable(Int32)"
        for i in (100, 101):
            del evo.rows[i]

        # a column dropped behind ingest's back: the insert fails, the table is read again and repaired
        with sink._call_lock():
            client.command("ALTER TABLE mirror.evo DROP COLUMN note")
        again = feed.rows(evo.upserts(V2, range(40, 45), lambda i: {"label": f"r-{i}", "qty": i, "note": "back"}),
                          "evo")
        with pytest.raises(TransientError) as terr:
            sink.write(again)
        assert terr.value.error_class == "table_changed"
        sink.write(again)  # the retry
        assert ch_columns(client, "evo")["note"] == "Nullable(String)"
        got = live(client, "evo")
        assert {i: got[i] for i in range(40, 45)} == {i: (f"r-{i}", i, "back") for i in range(40, 45)}
        # the table dropped behind ingest's back: created again by the retry
        with sink._call_lock():
            client.command("DROP TABLE mirror.other")
        rows = feed.rows(other.upserts(V1, range(50, 53), lambda i: {"label": f"o-{i}", "qty": i}), "other")
        with pytest.raises(TransientError):
            sink.write(rows)
        sink.write(rows)
        assert live(client, "other", "id, label, qty") == {i: (f"o-{i}", i) for i in range(50, 53)}
    finally:
        sink.close()
        chdb.close()


def test_an_incompatible_table_refuses_the_isolated_pieces_at_once_and_sees_a_fix_by_hand(chdb, monkeypatch) -> None:
    """After a batch was refused, the pieces isolation splits it into are refused from the table's shape as
    last read (no catalog query) for RECHECK_S; after that the table is read again, so a fix by hand is seen."""
    import ingest.sinks.clickhouse.auto as auto

    p = _settings(chdb.url)
    sink = BACKEND.build(p, lanes=1)
    feed = Feed(p)
    evo = Evolving("evo")
    try:
        sink.write(feed.rows(evo.upserts(V1, range(0, 5), lambda i: {"label": "a", "qty": i}), "evo"))
        bad = feed.rows(evo.upserts(V4, range(10, 12), lambda i: {"label": "b", "qty": f"q{i}", "note": None}), "evo")
        with pytest.raises(PermanentError):
            sink.write(bad)
        client = sink.client()
        queries: list[str] = []
        real_query = client.query
        monkeypatch.setattr(client, "query", lambda q, *a, **k: (queries.append(q), real_query(q, *a, **k))[1])
        with pytest.raises(PermanentError) as err:
            sink.write(bad[:1])
        assert err.value.error_class == "schema_incompatible" and queries == []
        with sink._call_lock():
            client.command("ALTER TABLE mirror.evo MODIFY COLUMN qty Nullable(String)")
        monkeypatch.setattr(auto, "RECHECK_S", 0.0)
        sink.write(bad)  # read again: the table takes the schema now
        assert queries and live(client, "evo")[10] == ("b", "q10", None)
    finally:
        sink.close()
        chdb.close()


def test_every_debezium_type_round_trips_through_a_clickhouse_auto_table(chdb) -> None:
    """Each Debezium (Connect JSON) type the harness writes lands in its type-map column and reads back as
    written: Bool, Float64, Decimal, VariableScaleDecimal as exact text, Date, ZonedTimestamp as
    DateTime64(6), MicroTime as ISO text, a required String; Arrow and Native inserts alike."""
    from datetime import date, time as clock
    from decimal import Decimal

    fields = (Field("id", "int64", optional=False), Field("flag", "boolean"), Field("ratio", "float64"),
              Field("price", "decimal(10,3)"), Field("amount", "variable_decimal"), Field("day", "date"),
              Field("at", "zoned_timestamp"), Field("clock", "micro_time"), Field("code", "string", optional=False))
    at = datetime(2026, 12, 5, 10, 30, 15, 123456, tzinfo=timezone.utc)
    rows = {i: {"flag": i % 2 == 0, "ratio": i / 4, "price": Decimal(f"{i}.125"), "amount": Decimal(f"-{i}.5"),
                "day": date(2026, 1, i + 1), "at": at, "clock": clock(23, 59, i, 999), "code": f"c{i}"}
            for i in range(3)}
    rows[3] = {**{k: None for k in rows[0]}, "code": ""}  # every optional field null
    for insert_format in ("auto", "native"):
        p = _settings(chdb.url, database=f"types_{insert_format}", insert_format=insert_format)
        sink = BACKEND.build(p, lanes=1)
        try:
            events = []
            for i, r in rows.items():
                events.append((encode_key({"id": i}, fields=KEY, schemas=True, table="types"),
                               encode_event("c", None, {"id": i, **r}, fields=fields, lsn=i, ts_ms=1, schemas=True,
                                            table="types"), 0, None))
            sink.write(Feed(p).rows(events, "types"))
            client = sink.client()
            assert ch_columns(client, "types", f"types_{insert_format}") == {
                "id": "Int64", "flag": "Nullable(Bool)", "ratio": "Nullable(Float64)",
                "price": "Nullable(Decimal(10, 3))", "amount": "Nullable(String)", "day": "Nullable(Date)",
                "at": "Nullable(DateTime64(6))", "clock": "Nullable(String)", "code": "String",
                "_version": "UInt64", "_ingest_deleted": "UInt8"}
            got = live(client, "types", ", ".join(["id", *rows[0]]), f"types_{insert_format}")
            want = {i: (r["flag"], r["ratio"], r["price"], None if r["amount"] is None else str(r["amount"]),
                        r["day"], None if r["at"] is None else r["at"].replace(tzinfo=None),
                        None if r["clock"] is None else r["clock"].isoformat(), r["code"]) for i, r in rows.items()}
            assert {i: (*v[:5], None if v[5] is None else _naive(v[5]), *v[6:]) for i, v in got.items()} == want
            assert sink.arrow_inserts == (1 if insert_format == "auto" else 0)
        finally:
            sink.close()
    chdb.close()


def test_a_wider_timestamp_column_takes_coarser_values_and_a_keyless_table_appends(chdb) -> None:
    p = _settings(chdb.url)
    sink = BACKEND.build(p, lanes=1)
    feed = Feed(p)
    micro = (Field("id", "int64", optional=False), Field("at", "micro_timestamp"))
    milli = (Field("id", "int64", optional=False), Field("at", "timestamp_ms"))
    t = datetime(2026, 12, 5, 10, 30, 15, 123000)
    src = Evolving("ts")
    try:
        sink.write(feed.rows(src.upserts(micro, range(0, 2), lambda i: {"at": t}), "ts"))
        sink.write(feed.rows(src.upserts(milli, range(2, 4), lambda i: {"at": t}), "ts"))  # ms ticks into DateTime64(6)
        client = sink.client()
        assert ch_columns(client, "ts")["at"] == "Nullable(DateTime64(6))"
        got = {i: at.replace(tzinfo=None) for i, at in live(client, "ts", "id, at").items() for at in at}
        assert got == {i: t for i in range(4)}
        # no key schema: MergeTree ORDER BY tuple(), every record a row
        value = encode_event("c", None, {"id": 1, "label": "a", "qty": 1}, fields=V1, lsn=1, ts_ms=1, schemas=True,
                             table="log")
        from ingest.types import Record

        rows = [feed.mapper.map(Record("db.public.log", 0, o, None, value, 0))[0] for o in (1, 2)]
        sink.write(rows)
        engine_full, sorting_key = engine(client, "log")
        assert engine_full.startswith("MergeTree") and sorting_key.strip("()") == ""
        assert client.query("SELECT id, label, qty FROM mirror.log").result_rows == [(1, "a", 1), (1, "a", 1)]
    finally:
        sink.close()
        chdb.close()


# --------------------------------------------------------------------------- ingest run (chDB owned by the subprocess)


def _config(tmp_path: Path, bootstrap: str, pg_dsn: str, group_id: str, topics: list[str], url: str,
            **pipeline: Any) -> Path:
    doc = {
        "name": PIPELINE, "topics": topics, "topic_refresh_s": 2, "group_id": group_id, "envelope": "debezium",
        "deletes": {"mode": "hard"}, "lanes": 2, "commit_interval_ms": 200, "shutdown_timeout_s": 10,
        "batch": {"max_rows": 200, "max_latency_ms": 100},
        "sink": {"kind": "clickhouse", "url": url, "database": DB, "table": "{source.table}", "columns": "auto"},
        "dlq": {"kind": "postgres", "dsn": pg_dsn}, **pipeline,
    }
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)}, "pipelines": [doc]})
    res = run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return config


def _naive(ts: datetime | None) -> datetime | None:
    return ts.astimezone(timezone.utc).replace(tzinfo=None) if ts is not None and ts.tzinfo else ts


def test_six_tables_and_a_late_one_over_a_pattern_equal_their_sources_with_final_through_a_kill(
        kafka_bootstrap, pg_dsn, group_id, chdb, tmp_path: Path) -> None:
    rng = random.Random("auto-ch")
    prefix = f"ach{rng.randrange(10**6)}"
    sources = [SourceTable(rng.randrange(2**32), keys=80, partitions=2, table=name, delete_frac=0.15,
                           snapshot_keys=20) for name in TABLES]
    late = SourceTable(rng.randrange(2**32), keys=40, partitions=2, table="late arrival", delete_frac=0.1)
    topics = [f"{prefix}.public.t{i}" for i in range(len(TABLES) + 1)]
    for topic in topics:
        create_topic(kafka_bootstrap, topic, 2)
    for topic, source in zip(topics, sources):
        produce_stream(kafka_bootstrap, topic, source.events(300))
    url = chdb.url
    chdb.close()  # the ingest subprocess owns the chDB path while it runs
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\.t[0-9]+$"], url)

    proc = start_ingest(["run", "--config", config, "--metrics-port", "0"], log_dir=tmp_path)
    try:
        wait_assigned(proc, timeout_s=90)
        wait_until(lambda: sum(committed_offsets(kafka_bootstrap, group_id, topics[0]).values()) > 0, 60,
                   what="the first batches committed", proc=proc)
        produce_stream(kafka_bootstrap, topics[-1], late.events(200))  # a table appears mid-run
        for topic, source in zip(topics, sources):
            produce_stream(kafka_bootstrap, topic, source.events(200))
        wait_until(lambda: sum(committed_offsets(kafka_bootstrap, group_id, topics[-1]).values()) > 0, 60,
                   what="the late table's first batches committed", proc=proc)
        time.sleep(rng.uniform(0.1, 0.6))
    finally:
        proc.kill9()  # mid-run: what was written and not committed is written again, FINAL absorbs it
    for topic, source in zip(topics, sources):
        produce_stream(kafka_bootstrap, topic, source.events(100))
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0"], timeout_s=240,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]

    client = chdb.client()
    try:
        for source in [*sources, late]:
            name = source.table.replace(".", "_")
            got = live(client, name, "id, name, price, qty, updated_at")
            want = {i: (r.name, r.price, r.qty, _naive(r.updated_at)) for i, r in source.rows.items()}
            assert {i: (*v[:3], _naive(v[3])) for i, v in got.items()} == want, name
            # deleted keys were written (their rows or delete markers are in the parts) and FINAL hides them
            seen = {r[0] for r in client.query(f"SELECT DISTINCT id FROM `{DB}`.`{name.replace('`', '')}`").result_rows}
            assert source.deleted and source.deleted <= seen and not source.deleted & set(got), name
        assert ch_columns(client, "customers") == {
            "id": "Int64", "name": "Nullable(String)", "price": "Nullable(Decimal(12, 2))", "qty": "Nullable(Int32)",
            "updated_at": "Nullable(DateTime64(6))", "_version": "UInt64", "_ingest_deleted": "UInt8"}
        assert engine(client, "late arrival")[0].startswith("ReplacingMergeTree(_version, _ingest_deleted)")
    finally:
        chdb.close()
    assert dlq_rows(pg_dsn) == []
    for topic in topics:
        assert_committed_at_log_end(kafka_bootstrap, group_id, topic)


def test_a_column_added_mid_stream_and_an_incompatible_change_quarantined_then_replayed(
        kafka_bootstrap, pg_dsn, group_id, chdb, tmp_path: Path) -> None:
    prefix = f"ache{random.randrange(10**6)}"
    evo_topic, other_topic = f"{prefix}.public.evo", f"{prefix}.public.other"
    for topic in (evo_topic, other_topic):
        create_topic(kafka_bootstrap, topic, 1)
    evo, other = Evolving("evo"), Evolving("other")
    produce(kafka_bootstrap, evo_topic, evo.upserts(V1, range(0, 50), lambda i: {"label": f"v1-{i}", "qty": i}))
    produce(kafka_bootstrap, other_topic, other.upserts(V1, range(0, 30), lambda i: {"label": f"o-{i}", "qty": i}))
    # a field appears mid-stream: its column is added before the first row that carries it
    produce(kafka_bootstrap, evo_topic, evo.upserts(V2, range(40, 80), lambda i: {"label": f"v2-{i}", "qty": -i,
                                                                                  "note": f"n{i}"}))
    # a field disappears: its column stays, NULL in the new rows
    produce(kafka_bootstrap, evo_topic, evo.upserts(V3, range(70, 90), lambda i: {"label": f"v3-{i}", "note": "x"}))
    produce(kafka_bootstrap, evo_topic, evo.deletes(V3, [0, 1, 2]))
    # qty becomes text: the Int32 column cannot take it -- quarantined; the other table keeps flowing
    produce(kafka_bootstrap, evo_topic, evo.upserts(V4, range(100, 110), lambda i: {"label": f"v4-{i}",
                                                                                    "qty": f"q{i}", "note": None}))
    produce(kafka_bootstrap, other_topic, other.upserts(V1, range(30, 60), lambda i: {"label": f"o-{i}", "qty": i}))
    url = chdb.url
    chdb.close()
    config = _config(tmp_path, kafka_bootstrap, pg_dsn, group_id, [f"^{prefix}\\.public\\..*"], url,
                     batch={"max_rows": 25, "max_latency_ms": 100})
    res = run_ingest(["run", "--config", config, "--until-idle", "3", "--metrics-port", "0"], timeout_s=180,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    dlq = dlq_rows(pg_dsn)
    assert len(dlq) == 10 and {d["error_class"] for d in dlq} == {"schema_incompatible"}, dlq
    assert all("qty" in d["error_message"] for d in dlq), dlq[0]["error_message"]
    assert_committed_at_log_end(kafka_bootstrap, group_id, evo_topic)
    assert_committed_at_log_end(kafka_bootstrap, group_id, other_topic)

    client = chdb.client()
    try:
        assert ch_columns(client, "evo") == {"id": "Int64", "label": "Nullable(String)", "qty": "Nullable(Int32)",
                                             "_version": "UInt64", "_ingest_deleted": "UInt8",
                                             "note": "Nullable(String)"}
        expected = {i: (r["label"], r.get("qty"), r.get("note")) for i, r in evo.rows.items() if i < 100}
        assert live(client, "evo") == expected
        assert live(client, "other", "id, label, qty") == {i: (r["label"], r["qty"]) for i, r in other.rows.items()}
        # the operator makes the table take the new schema
        client.command(f"ALTER TABLE `{DB}`.evo MODIFY COLUMN qty Nullable(String)")
    finally:
        chdb.close()
    res = run_ingest(["replay-dlq", "--config", config, "--pipeline", PIPELINE, "--error-class",
                      "schema_incompatible"], timeout_s=120, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    client = chdb.client()
    try:
        expected = {i: (r["label"], None if r.get("qty") is None else str(r["qty"]), r.get("note"))
                    for i, r in evo.rows.items()}
        assert live(client, "evo") == expected
    finally:
        chdb.close()
    res = run_ingest(["check", "--config", config], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "columns auto" in res.stdout and f"tables {DB}." in res.stdout, res.stdout


# --------------------------------------------------------------------------- a real server (HTTP)


def _struct(fields: dict[str, tuple[str, bool]], payload: dict[str, Any]) -> bytes:
    """A Kafka Connect JSON value with its schema part (``schemas.enable=true``): ``fields`` name → (type, optional)."""
    import orjson

    schema = {"type": "struct", "optional": False,
              "fields": [{"field": n, "type": t, "optional": o} for n, (t, o) in fields.items()]}
    return orjson.dumps({"schema": schema, "payload": payload})


def test_the_sink_creates_and_evolves_tables_on_a_real_server_over_http(clickhouse_url) -> None:
    """The HTTP path against the server the harness starts (18.16 here, through the test-only shim: no
    deletes engine, so plain Connect structs without an envelope; Native inserts, no token): a table
    from its first batch's schema, a column added by a second schema, a table without a key, FINAL."""
    from ingest.sinks.clickhouse.sink import quote_str
    from ingest.types import Record

    db = f"auto_{int(time.time() * 1000) % 10**9}"
    p = PipelineSettings.model_validate({
        "name": PIPELINE, "topics": ["^rs\\.(?P<t>[a-z]+)$"],
        "sink": {"kind": "clickhouse", **sink_conn(clickhouse_url), "compression": "gzip", "database": db,
                 "table": "{t}", "columns": "auto"},
        "dlq": {"kind": "postgres", "dsn": "postgresql://x@127.0.0.1/x"}})
    assert not p.has_deletes
    sink = ClickHouseSink(p.sink, pipeline=p.name, client_factory=lambda: http_client(clickhouse_url),
                          deletes=False)
    mapper = mapper_for(p)
    key = _struct({"id": ("int64", False)}, {"id": 0})
    v1 = {"id": ("int64", False), "label": ("string", True), "amount": ("float64", True)}
    v2 = {**v1, "note": ("string", True)}

    def rows(topic: str, fields: dict[str, tuple[str, bool]], docs: list[dict[str, Any]], offset: int,
             keyed: bool = True) -> list[tuple[Any, ...]]:
        return [mapper.map(Record(topic, 0, offset + n, key.replace(b'"id":0', b'"id":%d' % d["id"]) if keyed else None,
                                  _struct(fields, d), 0))[0] for n, d in enumerate(docs)]

    admin = http_client(clickhouse_url)
    try:
        sink.write(rows("rs.items", v1, [{"id": i, "label": f"a{i}", "amount": i / 2} for i in range(10)], 0))
        sink.write(rows("rs.items", v2, [{"id": i, "label": f"b{i}", "amount": None, "note": f"n{i}"}
                                         for i in range(5, 15)], 10)
                   + rows("rs.logs", v1, [{"id": 1, "label": "x", "amount": 1.0}] * 2, 0, keyed=False))
        where = f"database = {quote_str(db)} AND table = 'items'"
        columns = dict(admin.query(f"SELECT name, type FROM system.columns WHERE {where}").result_rows)
        assert columns == {"id": "Int64", "label": "Nullable(String)", "amount": "Nullable(Float64)",
                           "_version": "UInt64", "note": "Nullable(String)"}
        engine_full = admin.query(f"SELECT engine_full FROM system.tables WHERE database = {quote_str(db)} "
                                  "AND name = 'items'").result_rows[0][0]
        assert engine_full.startswith("ReplacingMergeTree(_version)") and "ORDER BY id" in engine_full, engine_full
        got = {r[0]: r[1:] for r in admin.query(f"SELECT id, label, amount, note FROM `{db}`.items FINAL").result_rows}
        assert got == {**{i: (f"a{i}", i / 2, None) for i in range(5)},
                       **{i: (f"b{i}", None, f"n{i}") for i in range(5, 15)}}
        assert admin.query(f"SELECT count() FROM `{db}`.logs").result_rows[0][0] == 2
        assert sink.inserts == 3 and sink.arrow_inserts == 0 or not needs_shim(clickhouse_url)
    finally:
        sink.close()
        admin.command(f"DROP DATABASE IF EXISTS `{db}`")
        admin.close()


def test_a_create_the_server_refuses_stops_the_pipeline_instead_of_dead_lettering_rows(clickhouse_url) -> None:
    """A DDL the server refuses is not the rows' fault: the write raises UnclassifiedError (the pipeline
    stops naming it, nothing committed), never PermanentError (which would dead-letter good rows). Here:
    a server too old for ``ReplacingMergeTree(version, is_deleted)`` (18.16 < 23.2) asked for a table with deletes."""
    from harness.clickhouse import server_version

    from ingest.errors import UnclassifiedError

    if server_version(clickhouse_url)[:2] >= (23, 2):
        pytest.skip("this server has the deletes engine: the CREATE is not refused")
    db = f"auto_{int(time.time() * 1000) % 10**9}"
    p = _settings(sink_conn(clickhouse_url)["url"], user=sink_conn(clickhouse_url)["user"],
                  password=sink_conn(clickhouse_url)["password"], compression="gzip", database=db)
    assert p.has_deletes
    sink = ClickHouseSink(p.sink, pipeline=p.name, client_factory=lambda: http_client(clickhouse_url), deletes=True)
    feed = Feed(p)
    admin = http_client(clickhouse_url)
    try:
        with pytest.raises(UnclassifiedError) as err:
            sink.write(feed.rows(Evolving("evo").upserts(V1, range(3), lambda i: {"label": "a", "qty": i}), "evo"))
        assert "evo" in str(err.value) and "refused" in str(err.value)
    finally:
        sink.close()
        admin.command(f"DROP DATABASE IF EXISTS `{db}`")
        admin.close()


def test_debezium_avro_through_the_registry_creates_and_evolves_the_clickhouse_table(
        kafka_bootstrap, pg_dsn, new_topic, group_id, schema_registry, chdb, tmp_path: Path) -> None:
    """Debezium's Avro converter into ClickHouse: the table from the ``after`` record of the writer schema,
    ordered by the key schema's fields; a second writer schema mid-stream adds its column; deletes apply."""
    import json

    from harness.serde import avro_values
    from integration.test_cdc_formats import KEY_SCHEMA, VALUE_SCHEMA, Source

    topic = new_topic(partitions=1)
    v2 = json.loads(VALUE_SCHEMA)
    v2["fields"][0]["type"][1]["fields"].append({"name": "color", "type": ["null", "string"], "default": None})
    first, second = Source(), Source()
    for i in range(1, 41):
        first.upsert(i, i)
    for i in (3, 4, 5):
        first.delete(i, 40 + i)
    second.table = dict(first.table)
    for i in range(30, 61):
        second.upsert(i, 100 + i, color=None if i % 7 == 0 else f"c{i}")
    second.delete(31, 200)

    def encode(schema: str, events: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[bytes, bytes | None]]:
        keys = avro_values(schema_registry.url, topic, KEY_SCHEMA, [{"id": i} for i, _ in events], field="key")
        values = iter(avro_values(schema_registry.url, topic, schema, [d for _, d in events if d is not None]))
        return [(k, None if d is None else next(values)) for k, (_, d) in zip(keys, events)]

    produce(kafka_bootstrap, topic, encode(VALUE_SCHEMA, first.events))
    produce(kafka_bootstrap, topic, encode(json.dumps(v2), second.events))
    url = chdb.url
    chdb.close()
    pipeline = {"name": PIPELINE, "topics": [topic], "group_id": group_id, "format": "avro", "key_format": "avro",
                "envelope": "debezium", "deletes": {"mode": "hard"}, "commit_interval_ms": 200,
                "batch": {"max_rows": 25, "max_latency_ms": 100},
                "sink": {"kind": "clickhouse", "url": url, "database": DB, "table": "{source.table}",
                         "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "schema_registry": {"url": schema_registry.url}, "pipelines": [pipeline]})
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert dlq_rows(pg_dsn) == []
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    client = chdb.client()
    try:
        assert ch_columns(client, "items") == {
            "id": "Int64", "name": "Nullable(String)", "price": "Nullable(Decimal(12, 2))",
            "updated_at": "Nullable(DateTime64(6))", "_version": "UInt64", "_ingest_deleted": "UInt8",
            "color": "Nullable(String)"}
        got = live(client, "items", "id, name, price, updated_at, color")
        expected = {i: (r["name"], r["price"], _naive(r["updated_at"]), r.get("color"))
                    for i, r in second.table.items()}
        assert {i: (v[0], v[1], _naive(v[2]), v[3]) for i, v in got.items()} == expected
        assert 31 not in got and 3 not in got and 60 in got
    finally:
        chdb.close()


@pytest.mark.parametrize("fmt", ["json_schema", "protobuf"])
def test_debezium_json_schema_and_protobuf_through_the_registry_into_clickhouse(
        fmt, kafka_bootstrap, pg_dsn, new_topic, group_id, schema_registry, chdb, tmp_path: Path) -> None:
    """The registry's JSON Schema / Protobuf change events keyed by plain JSON keys (``{"id": 1}``) into
    ClickHouse: ordered by the key's fields typed by the value's schema; deletes hidden by FINAL."""
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
    url = chdb.url
    chdb.close()
    pipeline = {"name": PIPELINE, "topics": [topic], "group_id": group_id, "format": fmt, "envelope": "debezium",
                "deletes": {"mode": "hard"}, "commit_interval_ms": 200, "batch": {"max_rows": 10, "max_latency_ms": 100},
                "sink": {"kind": "clickhouse", "url": url, "database": DB, "table": "{source.table}", "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "schema_registry": {"url": schema_registry.url}, "pipelines": [pipeline]})
    assert run_ingest(["migrate", "--config", config], timeout_s=60, log_dir=tmp_path).returncode == 0
    res = run_ingest(["run", "--config", config, "--until-idle", "2", "--metrics-port", "0"], timeout_s=120,
                     log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert dlq_rows(pg_dsn) == []
    assert_committed_at_log_end(kafka_bootstrap, group_id, topic)
    client = chdb.client()
    try:
        columns = ch_columns(client, "items")
        assert columns["id"] == "Int64" and engine(client, "items")[1].strip("()") == "id"
        assert columns["price"] == "Nullable(String)"  # both encode the decimal as its exact text
        got = live(client, "items", "id, name, price, updated_at")
        if fmt == "protobuf":  # a google.protobuf.Timestamp
            assert columns["updated_at"] == "Nullable(DateTime64(6))"
            got = {i: (*v[:2], _naive(v[2])) for i, v in got.items()}
            expected = {i: (r["name"], str(r["price"]), _naive(r["updated_at"])) for i, r in source.table.items()}
        else:  # ISO 8601 text, as the envelope's schema says: a string
            assert columns["updated_at"] == "Nullable(String)"
            expected = {i: (r["name"], str(r["price"]), r["updated_at"].isoformat()) for i, r in source.table.items()}
        assert got == expected and 5 not in got
    finally:
        chdb.close()


def test_migrate_dry_run_check_and_migrate_plan_clickhouse_tables_from_the_latest_registry_schemas(
        kafka_bootstrap, pg_dsn, group_id, schema_registry, chdb, tmp_path: Path) -> None:
    """``ingest migrate --dry-run`` / ``check`` / ``migrate`` for a ClickHouse ``columns: auto`` pipeline
    whose template names the table from the topic: planned from the latest registry schema, created,
    altered when a field is added in the registry, and an incompatible table reported."""
    import json

    from harness.serde import avro_values
    from integration.test_cdc_formats import KEY_SCHEMA, VALUE_SCHEMA, Source

    prefix = f"chplan{random.randrange(10**6)}"
    topic = f"{prefix}.public.accounts"
    create_topic(kafka_bootstrap, topic, 1)
    source = Source()
    source.upsert(1, 1)

    def register(schema: str) -> None:  # the serializer registers the subjects
        avro_values(schema_registry.url, topic, schema, [d for _, d in source.events])
        avro_values(schema_registry.url, topic, KEY_SCHEMA, [{"id": 1}], field="key")

    register(VALUE_SCHEMA)
    url = chdb.url
    chdb.close()
    pipeline = {"name": PIPELINE, "topics": [f"^{prefix}\\.public\\.(?P<t>.+)$"], "group_id": group_id,
                "format": "avro", "key_format": "avro", "envelope": "debezium", "deletes": {"mode": "hard"},
                "sink": {"kind": "clickhouse", "url": url, "database": DB, "table": "{t}", "columns": "auto"},
                "dlq": {"kind": "postgres", "dsn": pg_dsn}}
    config = write_config(tmp_path, {"kafka": {"bootstrap_servers": kafka_bootstrap,
                                               "client": dict(TEST_CONSUMER_SETTINGS)},
                                     "schema_registry": {"url": schema_registry.url}, "pipelines": [pipeline]})

    def ingest(*args: str) -> str:
        res = run_ingest([*args, "--config", config], timeout_s=60, log_dir=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr[-3000:]
        return res.stdout

    def columns() -> dict[str, str]:
        client = chdb.client()
        try:
            return ch_columns(client, "accounts")
        finally:
            chdb.close()

    out = ingest("migrate", "--dry-run")
    assert f"table accounts (topic {topic}): would be created" in out and "CREATE TABLE IF NOT EXISTS `mirror`.`accounts`" in out, out
    assert "ReplacingMergeTree(`_version`, `_ingest_deleted`)" in out and columns() == {}
    assert "would be created" in ingest("check")
    out = ingest("migrate")
    assert "table accounts" in out and ": created" in out, out
    assert list(columns()) == ["id", "name", "price", "updated_at", "_version", "_ingest_deleted"]
    assert "exists and takes its latest schema" in ingest("check")

    wider = json.loads(VALUE_SCHEMA)  # a field added in the latest schema
    wider["fields"][0]["type"][1]["fields"].append({"name": "color", "type": ["null", "string"], "default": None})
    register(json.dumps(wider))
    out = ingest("migrate", "--dry-run")
    assert "would be altered" in out and "ADD COLUMN `color` Nullable(String)" in out, out
    assert "color" not in columns()
    assert ": altered" in ingest("migrate") and columns()["color"] == "Nullable(String)"

    client = chdb.client()  # a table its latest schema cannot fit
    try:
        client.command(f"ALTER TABLE `{DB}`.accounts MODIFY COLUMN name Nullable(Int64)")
    finally:
        chdb.close()
    out = ingest("check")
    assert "warn" in out and "incompatible with its latest schema" in out and "'name'" in out, out


def test_per_table_overrides_rekey_retype_or_append_clickhouse_tables(chdb) -> None:
    """``tables:``: one table sorted by another column with a column's type given, one appending every
    record (MergeTree), one as its schema says."""
    p = _settings(chdb.url, deletes=False, tables={
        "ov_*": {"conflict_key": ["label"], "columns": {"qty": {"type": "Int64"}}},
        "log": {"on_conflict": "none"}})
    sink = BACKEND.build(p, lanes=1)
    feed = Feed(p)
    tables = {name: Evolving(name) for name in ("ov_a", "log", "plain")}
    try:
        for name, source in tables.items():  # ids 0..9, labels repeat every 5 ids; then 0..2 again
            sink.write(feed.rows(source.upserts(V1, range(10), lambda i: {"label": f"l{i % 5}", "qty": i}), name))
            sink.write(feed.rows(source.upserts(V1, range(3), lambda i: {"label": f"l{i % 5}", "qty": -i}), name))
        client = sink.client()
        assert engine(client, "ov_a")[1].strip("()") == "label" and ch_columns(client, "ov_a")["qty"] == "Nullable(Int64)"
        got = {r[0]: r[1:] for r in client.query(f"SELECT label, id, qty FROM `{DB}`.`ov_a` FINAL").result_rows}
        assert got == {"l0": (0, 0), "l1": (1, -1), "l2": (2, -2), "l3": (8, 8), "l4": (9, 9)}
        assert engine(client, "log")[0].startswith("MergeTree")
        assert client.query(f"SELECT count() FROM `{DB}`.`log`").result_rows[0][0] == 13
        assert engine(client, "plain")[1].strip("()") == "id" and ch_columns(client, "plain")["qty"] == "Nullable(Int32)"
    finally:
        sink.close()
