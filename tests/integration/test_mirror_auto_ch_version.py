"""Versions of ClickHouse ``columns: auto`` tables, on chDB (modern ClickHouse in-process).

The sink itself, batch by batch: the sink's ``version: {column, source, type}`` and a table's own
``tables.NAME.version_column`` become the table's ``ReplacingMergeTree`` version, so older updates
that arrive in later batches (and older deletes) lose to what the table holds -- read with ``FINAL``;
a sourced column (``tables.NAME.columns.C: {type, source}``) is added and filled, and can be the
version itself; a table whose engine is versioned otherwise is refused (``schema_incompatible``), and
``ingest migrate --dry-run`` shows the version in the DDL.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness.debezium import Field, encode_event, encode_key

from ingest.cdc.mapper import mapper_for
from ingest.cli.mirror_plan import AutoTablePlan, describe
from ingest.config import PipelineSettings
from ingest.errors import InvalidRecord, NoChange, PermanentError
from ingest.sinks.clickhouse.backend import BACKEND
from ingest.types import Record

pytestmark = pytest.mark.timeout(300)

DB = "versions"
KEY = (Field("id", "int64", optional=False),)
FIELDS = (Field("id", "int64", optional=False), Field("label", "string"), Field("seq", "int64"))


def _settings(url: str, *, deletes: bool = True, **sink: Any) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "versions", "topics": ["^db\\.public\\..*"], "envelope": "debezium",
        **({"deletes": {"mode": "hard"}} if deletes else {}),
        "sink": {"kind": "clickhouse", "url": url, "table": "{source.table}", "columns": "auto", "database": DB,
                 **sink},
        "dlq": {"kind": "postgres", "dsn": "postgresql://x@127.0.0.1/x"}})


class Changes:
    """Change events of one table as carriers, each with the ``lsn`` (``@source.lsn``) and ``seq`` given."""

    def __init__(self, p: PipelineSettings) -> None:
        self.mapper = mapper_for(p)
        self.offset = 0

    def record(self, table: str, op: str, i: int, lsn: int, label: str | None = None,
               seq: int | None = None, before_seq: bool = True) -> Record:
        after = None if op == "d" else {"id": i, "label": label, "seq": seq}
        before = ({"id": i, "seq": seq} if before_seq else {"id": i}) if op == "d" else None
        self.offset += 1
        value = encode_event(op, before, after, fields=FIELDS, lsn=lsn, ts_ms=lsn, schemas=True, table=table)
        return Record(f"db.public.{table}", 0, self.offset, encode_key({"id": i}, fields=KEY, schemas=True,
                                                                        table=table), value, 0)

    def rows(self, table: str, changes: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """``changes``: ``(op, id, lsn, label, seq)`` each."""
        out = []
        for change in changes:
            try:
                out.append(self.mapper.map(self.record(table, *change))[0])
            except NoChange:
                pass
        return out


def live(client: Any, table: str, columns: str = "id, label") -> dict[int, tuple[Any, ...]]:
    q = f"SELECT {columns} FROM `{DB}`.`{table}` FINAL WHERE _ingest_deleted = 0 ORDER BY id"
    return {r[0]: tuple(r[1:]) for r in client.query(q).result_rows}


def columns_of(client: Any, table: str) -> dict[str, str]:
    return dict(client.query("SELECT name, type FROM system.columns WHERE database = {d:String} AND "
                             "table = {t:String} ORDER BY position", parameters={"d": DB, "t": table}).result_rows)


def engine_of(client: Any, table: str) -> str:
    return client.query("SELECT engine_full FROM system.tables WHERE database = {d:String} AND name = {t:String}",
                        parameters={"d": DB, "t": table}).result_rows[0][0]


def test_the_sink_version_keeps_the_highest_lsn_of_each_key_across_batches_deletes_included(chdb) -> None:
    p = _settings(chdb.url, version={"column": "lsn", "source": "@source.lsn"})
    sink = BACKEND.build(p, lanes=1)
    feed = Changes(p)
    try:
        sink.write(feed.rows("t", [("c", i, 100 + i, f"new{i}", None) for i in range(10)]))
        client = sink.client()
        assert engine_of(client, "t").startswith("ReplacingMergeTree(lsn, _ingest_deleted)"), engine_of(client, "t")
        assert columns_of(client, "t") == {"id": "Int64", "label": "Nullable(String)", "seq": "Nullable(Int64)",
                                           "lsn": "UInt64", "_ingest_deleted": "UInt8"}
        # older updates arrive later (0-4), newer ones too (5-9); in one batch the older of a key comes last
        sink.write(feed.rows("t", [*[("u", i, 50, f"old{i}", None) for i in range(5)],
                                   *[("u", i, 200, f"newer{i}", None) for i in range(5, 10)],
                                   ("u", 9, 300, "newest9", None), ("u", 9, 250, "older9", None)]))
        assert live(client, "t") == {**{i: (f"new{i}",) for i in range(5)},
                                     **{i: (f"newer{i}",) for i in range(5, 9)}, 9: ("newest9",)}
        # a delete newer than the row hides it; one older than the row (key 1) does not; an update older
        # than the delete (key 0, a later batch) stays hidden; one newer (key 2) brings the key back
        sink.write(feed.rows("t", [("d", 0, 400), ("d", 1, 10), ("d", 2, 400)]))
        sink.write(feed.rows("t", [("u", 0, 350, "stale0", None), ("u", 2, 450, "back2", None)]))
        got = live(client, "t")
        assert 0 not in got and got[1] == ("new1",) and got[2] == ("back2",), got
        newest = f"SELECT lsn, _ingest_deleted FROM `{DB}`.t WHERE id = 0 ORDER BY lsn DESC LIMIT 1"
        assert client.query(newest).result_rows == [(400, 1)]  # the delete, with its version
    finally:
        sink.close()


def test_a_table_version_column_and_the_sink_version_side_by_side_with_a_sourced_column(chdb) -> None:
    """``own`` is versioned by its field ``seq`` (NOT NULL, no ``lsn`` column); ``src`` by a sourced column
    (``@source.ts_ms``) next to another sourced column (``@topic``); ``plain`` by the sink's ``lsn``."""
    p = _settings(chdb.url, version={"column": "lsn", "source": "@source.lsn"}, tables={
        "own": {"version_column": "seq"},
        "src": {"version_column": "changed_ms", "columns": {"changed_ms": {"type": "UInt64", "source": "@source.ts_ms"},
                                                            "topic": {"type": "String", "source": "@topic"}}}})
    sink = BACKEND.build(p, lanes=1)
    feed = Changes(p)
    try:
        # lsn and seq disagree on purpose: own follows seq, plain follows lsn, src follows ts_ms (= lsn here)
        for table in ("own", "src", "plain"):
            sink.write(feed.rows(table, [("c", i, 100, f"first{i}", 10) for i in range(4)]))
            sink.write(feed.rows(table, [("u", 0, 50, "seq-newer", 20), ("u", 1, 200, "lsn-newer", 5),
                                         ("d", 2, 300, None, 10), ("d", 3, 300, None, 9)]))
        client = sink.client()
        assert engine_of(client, "own").startswith("ReplacingMergeTree(seq, _ingest_deleted)")
        assert columns_of(client, "own") == {"id": "Int64", "label": "Nullable(String)", "seq": "Int64",
                                             "_ingest_deleted": "UInt8"}
        # key 2's delete carries seq 10 (its before image), equal to the row's: the later insert wins
        assert live(client, "own") == {0: ("seq-newer",), 1: ("first1",), 3: ("first3",)}
        assert engine_of(client, "src").startswith("ReplacingMergeTree(changed_ms, _ingest_deleted)")
        assert columns_of(client, "src") == {"id": "Int64", "label": "Nullable(String)", "seq": "Nullable(Int64)",
                                             "changed_ms": "UInt64", "topic": "Nullable(String)",
                                             "_ingest_deleted": "UInt8"}
        assert live(client, "src", "id, label, changed_ms, topic") == {
            0: ("first0", 100, "db.public.src"), 1: ("lsn-newer", 200, "db.public.src")}
        assert engine_of(client, "plain").startswith("ReplacingMergeTree(lsn, _ingest_deleted)")
        assert live(client, "plain") == {0: ("first0",), 1: ("lsn-newer",)}
        # a delete whose before image lacks the table's version column cannot be ordered: poison
        with pytest.raises(InvalidRecord) as err:
            feed.mapper.map(feed.record("own", "d", 0, 500, before_seq=False))
        assert err.value.error_class == "missing_field" and "seq" in err.value.message
    finally:
        sink.close()


def test_a_table_versioned_otherwise_is_schema_incompatible_and_migrate_dry_run_shows_the_version(chdb) -> None:
    """A table made versioned by the offset (``_version``) is refused once the pipeline versions it by
    ``lsn`` -- every batch of it, nothing written -- while another table flows; ``migrate --dry-run``
    says so, and plans a new table with its version."""
    offset = _settings(chdb.url)
    sink = BACKEND.build(offset, lanes=1)
    try:
        sink.write(Changes(offset).rows("t", [("c", i, 100, f"a{i}", None) for i in range(3)]))
        client = sink.client()
        assert engine_of(client, "t").startswith("ReplacingMergeTree(_version, _ingest_deleted)")
    finally:
        sink.close()
    p = _settings(chdb.url, version={"column": "lsn", "source": "@source.lsn"})
    sink = BACKEND.build(p, lanes=1)
    feed = Changes(p)
    try:
        for _ in range(2):  # the second time from the table as last read (no catalog query)
            with pytest.raises(PermanentError) as err:
                sink.write(feed.rows("t", [("u", 0, 900, "never", None)]))
            assert err.value.error_class == "schema_incompatible", err.value
            assert "versioned by column '_version', not by 'lsn'" in str(err.value), err.value
        sink.write(feed.rows("other", [("c", 1, 5, "flows", None)]))
        client = sink.client()
        assert live(client, "t") == {i: (f"a{i}",) for i in range(3)} and live(client, "other") == {1: ("flows",)}

        shape = feed.rows("t", [("c", 1, 1, "x", 1)])[0][1].shape
        refused = describe(AutoTablePlan("db.public.t", "t", sink.plan_auto_table("t", shape, dry_run=True)),
                           dry_run=True)
        assert refused[0].startswith("warn table t") and "versioned by column '_version'" in refused[0], refused
        fresh = describe(AutoTablePlan("db.public.n", "n", sink.plan_auto_table("n", shape, dry_run=True)),
                         dry_run=True)
        text = "\n".join(fresh)
        assert "would be created" in text and "`lsn` UInt64" in text, text
        assert "ReplacingMergeTree(`lsn`, `_ingest_deleted`)" in text, text
    finally:
        sink.close()


def test_a_table_without_the_delete_mark_is_refused_when_the_pipeline_deletes(chdb) -> None:
    """A table made without deletes (``ReplacingMergeTree(_version)``, here by hand) would never hide a
    delete: a pipeline that deletes has its rows refused instead of silently kept."""
    p = _settings(chdb.url)
    sink = BACKEND.build(p, lanes=1)
    try:
        client = sink.client()
        with sink._call_lock():
            client.command(f"CREATE DATABASE IF NOT EXISTS {DB}")
            client.command(f"CREATE TABLE {DB}.t (id Int64, label Nullable(String), seq Nullable(Int64), "
                           "_version UInt64) ENGINE = ReplacingMergeTree(_version) ORDER BY id")
        with pytest.raises(PermanentError) as err:
            sink.write(Changes(p).rows("t", [("d", 1, 2)]))
        assert err.value.error_class == "schema_incompatible" and "'_ingest_deleted' mark" in str(err.value)
        assert "_ingest_deleted" not in columns_of(client, "t")  # nothing altered
    finally:
        sink.close()
