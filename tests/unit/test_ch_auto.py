"""``columns: auto`` into ClickHouse (pure logic): the settings, records → carriers in the ClickHouse
dialect, and carriers → one table's insert (values by column name, the hidden version and delete
columns, conversions). The tables themselves are tested against chDB and a real server in
``tests/integration/test_mirror_auto_ch.py``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from harness.debezium import Field, encode_event, encode_key
from pydantic import ValidationError

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.core.collapse import collapse
from ingest.core.dialects import ch_type
from ingest.errors import InvalidRecord
from ingest.mirror.auto import KEY_AT, SHAPE_AT, VALUES_AT, VERSION_AT
from ingest.mirror.ddl import ClickHouseTable
from ingest.mirror.router import table_of
from ingest.mirror.shape import Column, Shape, union
from ingest.sinks.clickhouse.auto import ClickHouseAutoTables, _filler, _table, rescaler
from ingest.types import DeleteRow, Item, Record

FIELDS = (Field("id", "int64", optional=False), Field("name", "string"), Field("price", "decimal(12,2)"),
          Field("at", "timestamp_ms"))
KEY = (Field("id", "int64", optional=False),)
AT = datetime.fromtimestamp(1_700_000_000.123, timezone.utc)


def settings(**extra: Any) -> PipelineSettings:
    sink = {"kind": "clickhouse", "url": "chdb://memory", "table": "{source.table}", "columns": "auto",
            **extra.pop("sink", {})}
    return PipelineSettings.model_validate({"name": "m", "topics": ["^db\\..*"], "envelope": "debezium",
                                            "deletes": {"mode": "hard"}, "sink": sink,
                                            "dlq": {"kind": "postgres", "dsn": "postgresql://x@localhost/x"}, **extra})


def event(op: str, i: int, name: str | None = "n", *, fields: tuple[Field, ...] = FIELDS, offset: int = 0,
          table: str = "items", **values: Any) -> Record:
    after = None if op == "d" else {"id": i, "name": name, "price": "1.50", "at": AT, **values}
    before = {"id": i} if op == "d" else None
    value = encode_event(op, before, after, fields=fields, lsn=offset, ts_ms=1, schemas=True, table=table)
    key = encode_key({"id": i}, fields=KEY, schemas=True, table=table)
    return Record("db.public." + table, 0, offset, key, value, 0)


# --------------------------------------------------------------------------- settings


def test_columns_auto_in_clickhouse_becomes_the_carrier_columns_ordered_by_the_key_versioned_by_the_offset() -> None:
    p = settings()
    assert p.auto_columns and p.routes_tables
    assert list(p.sink.columns) == ["_ingest_key", "_ingest_shape", "_ingest_values", "_ingest_stream",
                                    "_ingest_offset"]
    assert p.sink.order_by == ["_ingest_key"] and p.sink.version_column == "_ingest_offset"
    assert p.sink.evolve == "add_columns"
    rule = p.collapse_rule()
    assert rule.key_index == (0, len(p.sink.columns)) and rule.version_index == 4  # the key, then the table
    assert settings(sink={"order_by": "auto", "evolve": "add_and_widen"}).sink.evolve == "add_and_widen"


@pytest.mark.parametrize(("sink", "says"), [
    ({"order_by": ["id"]}, "order_by: auto"),
    ({"conflict_key": ["id"]}, "conflict_key: auto"),
    ({"version_column": "lsn"}, "version: {column: NAME, source: '@source.lsn'}"),
    ({"cluster": "c1"}, "cluster: not supported with columns: auto"),
    ({"evolve": "sometimes"}, "evolve"),
    ({"version": {"column": "lsn", "source": "@source.lsn", "type": "Nullable(UInt64)"}},
     "ReplacingMergeTree refuses a Nullable version"),
    ({"version": {"column": "lsn", "source": "@source.lsn", "type": "String"}},
     "ReplacingMergeTree takes an integer (UInt8-64, Int8-64), Date or DateTime64 version"),
    ({"version": {"column": "lsn", "source": "@source.lsn", "type": "Float64"}}, "takes an integer"),
    ({"version": {"column": "lsn", "source": "@source.lsn", "type": "DateTime"}}, "unsupported column type"),
    ({"version": {"column": "_version", "source": "@offset"}}, "the hidden version of tables versioned by the Kafka"),
    ({"version": {"column": "_ingest_lsn", "source": "@offset"}}, "reserved for ingest"),
    ({"version": {"column": "lsn", "source": "$.lsn"}}, "@source.PATH or record metadata"),
    ({"tables": {"t": {"version_column": "seq", "on_conflict": "none"}}}, "an append-only table has no version"),
])
def test_clickhouse_columns_auto_cannot_take_say_why(sink: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as err:
        settings(sink=sink)
    assert says in str(err.value)


@pytest.mark.parametrize("type_text", ["UInt64", "UInt8", "Int64", "Int32", "Date", "DateTime64(3)", "DateTime64(6, 'UTC')"])
def test_a_sink_wide_version_makes_a_carrier_version_the_collapse_version(type_text: str) -> None:
    """``version:`` of any type a ReplacingMergeTree version may have (both servers here take signed
    integers): the carriers get the version slot, collapse keeps its highest; the mapper fills it."""
    p = settings(sink={"version": {"column": "lsn", "source": "@source.lsn", "type": type_text}})
    assert list(p.sink.columns)[-1] == "_ingest_version" and p.sink.version_column == "_ingest_version"
    assert p.sink.version is not None and p.sink.version.column == "lsn"
    assert p.collapse_rule().version_index == 5
    assert settings(sink={"version": {"column": "lsn", "source": "@source.lsn"}}).sink.version.type == "UInt64"


def test_a_table_version_column_gives_every_carrier_a_version_slot() -> None:
    p = settings(sink={"tables": {"orders": {"version_column": "seq"}}})
    assert p.sink.version is None and p.sink.version_column == "_ingest_version"
    assert p.collapse_rule().version_index == 5


def test_version_and_tables_go_with_columns_auto_and_survive_a_dump() -> None:
    from ingest.config import Settings

    with pytest.raises(ValidationError) as err:
        PipelineSettings.model_validate({"name": "m", "topics": ["t"], "sink": {
            "kind": "clickhouse", "table": "t", "order_by": ["id"], "columns": {"id": {"type": "Int64"}},
            "version": {"column": "lsn", "source": "@offset"}}})
    assert "version: goes with columns: auto" in str(err.value)
    p = settings(sink={"version": {"column": "lsn", "source": "@source.lsn", "type": "UInt32"},
                       "tables": {"o*": {"version_column": "seq"}}})
    again = Settings.model_validate({"pipelines": [p.model_dump(by_alias=True)]}).pipelines[0]
    assert again.sink.version == p.sink.version and again.sink.tables == p.sink.tables
    assert list(again.sink.columns) == list(p.sink.columns) and again.sink.version_column == "_ingest_version"


def test_order_by_auto_needs_columns_auto() -> None:
    with pytest.raises(ValidationError) as err:
        PipelineSettings.model_validate({"name": "m", "topics": ["t"], "sink": {
            "kind": "clickhouse", "table": "t", "order_by": "auto", "columns": {"id": {"type": "Int64"}}}})
    assert "order_by: auto goes with columns: auto" in str(err.value)


# --------------------------------------------------------------------------- records → carriers


def test_a_change_event_maps_to_a_carrier_of_clickhouse_types_and_a_null_is_a_value() -> None:
    m = mapper_for(settings())
    row, _ = m.map(event("c", 7, None, offset=3))  # name is optional: its null is a value, not poison
    assert table_of(row) == "items" and row[KEY_AT] == (7,)
    shape = row[SHAPE_AT].shape
    assert [(c.name, c.type, c.nullable) for c in shape.columns] == [
        ("id", "Int64", False), ("name", "String", True), ("price", "Decimal(12, 2)", True),
        ("at", "DateTime64(3)", True)]
    assert row[VALUES_AT].values == (7, None, Decimal("1.50"), 1_700_000_000_123)  # DateTime64(3): ms ticks
    deleted, _ = m.map(event("d", 7, offset=5))
    assert type(deleted) is DeleteRow and deleted[KEY_AT] == (7,) and deleted[VALUES_AT] is None


def test_a_required_field_that_is_null_is_poison_and_a_version_field_is_schema_incompatible() -> None:
    m = mapper_for(settings())
    strict = (Field("id", "int64", optional=False), Field("name", "string", optional=False))
    with pytest.raises(InvalidRecord) as err:
        m.map(event("c", 1, None, fields=strict))
    assert err.value.error_class == "missing_field"
    with pytest.raises(InvalidRecord) as err:
        m.map(event("c", 1, fields=(*FIELDS, Field("_version", "int64"))))
    assert err.value.error_class == "schema_incompatible" and "_version" in err.value.message


def test_collapse_keeps_the_highest_offset_of_a_key_per_table_a_delete_included() -> None:
    m = mapper_for(settings())
    rows = [m.map(event("c", 1, offset=0))[0], m.map(event("d", 1, offset=1))[0],
            m.map(event("c", 1, "b", offset=2, table="other"))[0], m.map(event("u", 1, "a", offset=3, table="other"))[0]]
    items = [Item(None, row, None, 0, 1) for row in rows]  # type: ignore[arg-type]
    failed, groups = collapse(items, settings().collapse_rule())
    kept = [g[0].row for g in groups]
    assert failed == [] and [(table_of(r), r[4], type(r) is DeleteRow) for r in kept] == [
        ("items", 1, True), ("other", 3, False)]


def test_a_table_version_column_is_not_null_of_a_replacing_merge_tree_version_type_or_schema_incompatible() -> None:
    """ClickHouse: a table's own version column is its ReplacingMergeTree version -- NOT NULL (its null is
    poison, as a missing one) and an integer, Date or DateTime64 (else the record is schema_incompatible)."""
    seq = (*FIELDS, Field("seq", "int64"), Field("code", "string"), Field("ratio", "float64"))
    m = mapper_for(settings(sink={"tables": {"items": {"version_column": "seq"}, "texts": {"version_column": "code"},
                                             "floats": {"version_column": "ratio"}}}))
    row, _ = m.map(event("c", 1, fields=seq, seq=7, code="c", ratio=0.5))
    assert row[SHAPE_AT].shape.column("seq").nullable is False and row[VERSION_AT].value == 7
    with pytest.raises(InvalidRecord) as err:
        m.map(event("c", 1, fields=seq, seq=None, code="c", ratio=0.5))
    assert err.value.error_class == "missing_field" and "seq" in err.value.message
    for table, column, type_text in (("texts", "code", "String"), ("floats", "ratio", "Float64")):
        with pytest.raises(InvalidRecord) as err:
            m.map(event("c", 1, fields=seq, table=table, seq=1, code="c", ratio=0.5))
        assert err.value.error_class == "schema_incompatible", err.value
        assert err.value.message.startswith(f"the version column {column!r} is {type_text}: ReplacingMergeTree "
                                            "takes an integer") and "tables.NAME.columns" in err.value.message
    retyped = mapper_for(settings(sink={"tables": {"texts": {"version_column": "code",
                                                             "columns": {"code": {"type": "UInt32"}}}}}))
    with pytest.raises(InvalidRecord):  # a text that is no number is poison naming the column
        retyped.map(event("c", 1, fields=seq, table="texts", seq=1, code="c", ratio=0.5))
    assert retyped.map(event("c", 1, fields=seq, table="texts", seq=1, code="12", ratio=0.5))[0][VERSION_AT].value == 12


def test_collapse_keeps_the_highest_version_a_delete_included_with_the_sink_version() -> None:
    p = settings(sink={"version": {"column": "lsn", "source": "@source.lsn"}})
    m = mapper_for(p)
    rows = [m.map(event("u", 1, "new", offset=5))[0], m.map(event("u", 1, "old", offset=2))[0],
            m.map(event("d", 2, offset=9))[0], m.map(event("u", 2, "older", offset=3))[0]]
    assert [r[VERSION_AT] for r in rows] == [5, 2, 9, 3]  # the events' lsn (offset= sets it in event())
    failed, groups = collapse([Item(None, row, None, 0, 1) for row in rows], p.collapse_rule())  # type: ignore[arg-type]
    kept = [g[0].row for g in groups]
    assert failed == [] and [(r[KEY_AT], r[VERSION_AT], type(r) is DeleteRow) for r in kept] == [
        ((1,), 5, False), ((2,), 9, True)]


# --------------------------------------------------------------------------- carriers → an insert


def _shape(*columns: Column, key: tuple[str, ...] = ("id",)) -> Shape:
    return Shape("clickhouse", columns, key)


def test_rescaler_scales_datetime64_ticks_up_and_leaves_every_other_accepted_pair() -> None:
    up = rescaler("DateTime64(3)", ch_type("Nullable(DateTime64(6))"))
    assert up is not None and up(1_700_000_000_123) == 1_700_000_000_123_000 and up(None) is None
    arr = rescaler("Array(DateTime64(3))", ch_type("Array(DateTime64(9))"))
    assert arr is not None and arr([1, 2]) == [1_000_000, 2_000_000]
    assert rescaler("DateTime64(6)", ch_type("DateTime64(6)")) is None
    assert rescaler("Int32", ch_type("Nullable(Int64)")) is None
    assert rescaler("Decimal(10, 2)", ch_type("Decimal(12, 2)")) is None


def test_insert_data_puts_values_by_name_with_version_delete_mark_and_fillers() -> None:
    m = mapper_for(settings())
    wide = (*FIELDS, Field("tags", "string"))
    rows = [m.map(event("c", 1, "a", offset=10))[0],
            m.map(event("c", 2, "b", offset=11, fields=wide, tags="t"))[0],
            m.map(event("d", 3, offset=12))[0]]
    wanted = union([r[SHAPE_AT].shape for r in rows])
    where = ClickHouseTable("items", deletes=True)
    # the table as the catalog would show it: its columns in another order, `at` wider, one extra column
    table = _shape(Column("id", "Int64", False), Column("at", "DateTime64(6)", True),
                   Column("extra", "String", True), *[c for c in wanted.columns if c.name not in ("id", "at")],
                   *where.managed_columns(wanted))
    t = _table("items", table, where)
    data = ClickHouseAutoTables(settings().sink, True).insert_data(t, rows)
    assert data.names == ("id", "at", "name", "price", "tags", "_version", "_ingest_deleted")  # not `extra`
    got = {name: column for name, column in zip(data.names, data.columns)}
    assert got["id"] == [1, 2, 3]
    assert got["at"] == [1_700_000_000_123_000, 1_700_000_000_123_000, None]  # µs ticks; a delete's filler
    assert got["name"] == ["a", "b", None] and got["tags"] == [None, "t", None]
    assert got["price"] == [Decimal("1.50"), Decimal("1.50"), None]
    assert got["_version"] == [10, 11, 12] and got["_ingest_deleted"] == [0, 0, 1]
    assert [t.name for t in data.types] == ["Int64", "Nullable(DateTime64(6))", "Nullable(String)",
                                            "Nullable(Decimal(12, 2))", "Nullable(String)", "UInt64", "UInt8"]


def test_insert_data_writes_the_carrier_version_deletes_included_into_the_tables_version_column() -> None:
    """The sink's ``version:`` column and a table's own version column hold the carrier's version (a
    delete's too); ``where`` names them, and their type when the sink adds the column."""
    sink_wide = settings(sink={"version": {"column": "lsn", "source": "@source.lsn", "type": "UInt32"},
                               "tables": {"own": {"version_column": "seq"}}})
    auto = ClickHouseAutoTables(sink_wide.sink, True)
    assert (auto.where("items", None).version_column, auto.where("items", None).version_type) == ("lsn", "UInt32")
    assert auto.where("own", None).version_column == "seq"
    m = mapper_for(sink_wide)
    rows = [m.map(event("c", 1, "a", offset=10))[0], m.map(event("d", 2, offset=12))[0]]
    wanted = rows[0][SHAPE_AT].shape
    where = auto.where("items", None)
    t = _table("items", wanted.with_columns(where.managed_columns(wanted)), where)
    got = dict(zip((data := auto.insert_data(t, rows)).names, data.columns))
    assert got["lsn"] == [10, 12] and got["_ingest_deleted"] == [0, 1] and "_version" not in got
    assert data.types[data.names.index("lsn")].name == "UInt32"

    seq = (*FIELDS, Field("seq", "int64"))
    own = [m.map(event("c", 1, "a", fields=seq, table="own", seq=7))[0],
           m.map(Record("db.public.own", 0, 3, encode_key({"id": 2}, fields=KEY, schemas=True, table="own"),
                        encode_event("d", {"id": 2, "seq": 9}, None, fields=seq, lsn=3, ts_ms=1, schemas=True,
                                     table="own"), 0))[0]]
    where = auto.where("own", None)
    shape = own[0][SHAPE_AT].shape
    t = _table("own", shape.with_columns(where.managed_columns(shape)), where)
    assert [c.name for c in t.shape.columns if c.name in ("lsn", "_version")] == []  # only its own version
    got = dict(zip((data := auto.insert_data(t, own)).names, data.columns))
    assert got["seq"] == [7, 9] and got["_ingest_deleted"] == [0, 1]
    assert data.types[data.names.index("seq")].name == "Int64"  # NOT NULL


def test_a_column_that_cannot_hold_null_gets_its_zero_and_an_array_its_empty_list() -> None:
    m = mapper_for(settings())
    row = m.map(event("c", 1, "a", offset=1))[0]
    table = _shape(Column("id", "Int64", False), Column("name", "String", True),
                   Column("price", "Decimal(12, 2)", True), Column("at", "DateTime64(3)", False, "0"),
                   Column("_version", "UInt64", False))
    t = _table("items", table, ClickHouseTable("items"))
    late = m.map(event("c", 2, "b", offset=2, at=None))[0]
    data = ClickHouseAutoTables(settings().sink, False).insert_data(t, [row, late])
    got = dict(zip(data.names, data.columns))
    assert got["at"] == [1_700_000_000_123, 0]
    arr = _table("a", _shape(Column("id", "Int64", False), Column("tags", "Array(String)", False, "[]")),
                 ClickHouseTable("a"))
    assert _filler(arr.shape.columns[1], arr.types["tags"]) == []
    assert datetime.fromtimestamp(got["at"][0] / 1000, timezone.utc).year == 2023


def test_clickhouse_auto_settings_survive_a_dump_validated_again_and_preview_shows_the_columns() -> None:
    from ingest.config import Settings
    from ingest.preview import preview

    p = settings()
    again = Settings.model_validate({"pipelines": [p.model_dump(by_alias=True)]}).pipelines[0]
    assert again.auto_columns and again.sink.order_by == ["_ingest_key"] and again.sink.version_column == "_ingest_offset"
    assert list(again.sink.columns) == list(p.sink.columns)
    report = preview(Settings.model_validate({"pipelines": [p.model_dump(by_alias=True)]}), again,
                     [event("c", 1, "a"), event("d", 2, table="other")])
    tables = report.as_dict()["tables"]
    assert tables["items"][0]["row"] == {"id": 1, "name": "a", "price": Decimal("1.50"), "at": 1_700_000_000_123}
    assert tables["other"][0]["delete"] == {"id": 2}


@pytest.mark.parametrize(("engine_full", "refusal"), [
    ("ReplacingMergeTree(lsn, _ingest_deleted) ORDER BY id SETTINGS index_granularity = 8192", None),
    ("ReplicatedReplacingMergeTree('/ch/{shard}/t', '{replica}', `lsn`, `_ingest_deleted`) ORDER BY id", None),
    ("ReplacingMergeTree(_version, _ingest_deleted) ORDER BY id", "versioned by column '_version', not by 'lsn'"),
    ("ReplacingMergeTree ORDER BY id", "versioned by insertion order"),
    ("ReplacingMergeTree(lsn) ORDER BY id", "no '_ingest_deleted' mark"),
    ("MergeTree ORDER BY id", "its engine is MergeTree"),
])
def test_an_existing_tables_engine_must_be_versioned_as_the_pipeline_versions_it(engine_full: str,
                                                                                  refusal: str | None) -> None:
    got = ClickHouseTable("t", version_column="lsn", deletes=True).engine_refusal(engine_full)
    assert got is None if refusal is None else refusal in (got or ""), got
