"""``columns: auto`` (pure logic): the settings it takes and refuses, and records → carrier rows.

The tables it creates and evolves are tested against a real PostgreSQL and broker in
``tests/integration/test_mirror_auto.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness.debezium import Field, encode_event, encode_key
from pydantic import ValidationError

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.core.collapse import collapse
from ingest.errors import InvalidRecord, NoChange
from ingest.mirror.auto import KEY_AT, SHAPE_AT, VALUES_AT
from ingest.mirror.router import table_of
from ingest.types import DeleteRow, Item, Record

FIELDS = (Field("id", "int64", optional=False), Field("name", "string"), Field("price", "decimal(12,2)"))
KEY = (Field("id", "int64", optional=False),)


def settings(**extra: Any) -> PipelineSettings:
    sink = {"kind": "postgres", "table": "{source.table}", "columns": "auto", **extra.pop("sink", {})}
    return PipelineSettings.model_validate({"name": "m", "topics": ["^db\\..*"], "envelope": "debezium",
                                            "sink": sink, **extra})


def event(op: str, i: int, name: str | None = "n", *, fields: tuple[Field, ...] = FIELDS, offset: int = 0,
          table: str = "items") -> Record:
    after = None if op == "d" else {"id": i, "name": name, "price": "1.50"}
    before = {"id": i} if op == "d" else None
    value = encode_event(op, before, after, fields=fields, lsn=offset, ts_ms=1, schemas=True, table=table)
    key = encode_key({"id": i}, fields=KEY, schemas=True, table=table)
    return Record("db.public." + table, 0, offset, key, value, 0)


def test_columns_auto_becomes_the_carrier_columns_keyed_by_the_records_key() -> None:
    p = settings()
    assert p.auto_columns and p.routes_tables
    assert list(p.sink.columns)[:3] == ["_ingest_key", "_ingest_shape", "_ingest_values"]
    assert p.sink.conflict_key == ["_ingest_key"] and p.sink.evolve == "add_columns"
    assert p.collapse_rule().key_index == (0, len(p.sink.columns))  # the key, then the table


@pytest.mark.parametrize(("extra", "says"), [
    ({"sink": {"conflict_key": ["id"]}}, "conflict_key: auto"),
    ({"sink": {"version_column": "lsn"}}, "version: {column: NAME"),
    ({"sink": {"version": {"column": "_ingest_v", "source": "@source.lsn"}}}, "reserved for ingest"),
    ({"sink": {"version": {"column": "lsn", "source": "$.lsn"}}}, "@source.PATH or record metadata"),
    ({"sink": {"evolve": "sometimes"}}, "evolve"),
    ({"sink": {"write_method": "values"}}, "write_method copy"),
    ({"format": "xml"}, "format"),
    ({"format": "avro", "schema_registry": None}, "set key_format avro"),
    ({"transforms": [{"drop": ["x"]}]}, "transforms"),
    ({"key": "$.id"}, "key:"),
])
def test_settings_columns_auto_cannot_take_say_why(extra: dict[str, Any], says: str) -> None:
    extra.pop("schema_registry", None)
    with pytest.raises(ValidationError) as err:
        settings(**extra)
    assert says in str(err.value)


def test_a_change_event_maps_to_a_carrier_of_its_schema_and_table() -> None:
    m = mapper_for(settings())
    row, _ = m.map(event("c", 7, offset=3))
    assert table_of(row) == "items" and row[KEY_AT] == (7,)
    shape = row[SHAPE_AT]
    assert shape.shape.names == ("id", "name", "price") and shape.shape.key == ("id",)
    assert [c.type for c in shape.shape.columns] == ["bigint", "text", "numeric(12,2)"]
    assert row[VALUES_AT].values == (7, "n", __import__("decimal").Decimal("1.50"))
    again, _ = m.map(event("u", 8, offset=4))
    assert again[SHAPE_AT] is shape  # one RowShape per schema
    deleted, _ = m.map(event("d", 7, offset=5))
    assert type(deleted) is DeleteRow and deleted[KEY_AT] == (7,) and deleted[VALUES_AT] is None


def test_a_new_field_is_a_new_shape_and_collapse_keeps_the_last_record_of_a_key_per_table() -> None:
    m = mapper_for(settings())
    wider = (*FIELDS, Field("color", "string"))
    rows = [m.map(event("c", 1, offset=0))[0], m.map(event("u", 1, offset=1, fields=wider))[0],
            m.map(event("c", 1, offset=2, table="other"))[0]]
    assert rows[0][SHAPE_AT] is not rows[1][SHAPE_AT]
    assert rows[1][SHAPE_AT].shape.names[-1] == "color"
    items = [Item(None, row, None, 0, 1) for row in rows]  # type: ignore[arg-type]
    failed, groups = collapse(items, settings().collapse_rule())
    assert failed == [] and [(table_of(g[0].row), g[0].row[4]) for g in groups] == [("items", 1), ("other", 2)]


def test_records_without_a_schema_a_bad_value_and_tombstones() -> None:
    m = mapper_for(settings())
    with pytest.raises(InvalidRecord) as err:
        m.map(Record("db.public.items", 0, 0, None, b'{"id": 1}', 0))
    assert err.value.error_class == "no_schema"
    bad = event("c", 1)
    bad_value = bad.value.replace(b'"name":"n"', b'"name":{"deep":1}')  # type: ignore[union-attr]
    with pytest.raises(InvalidRecord) as err:
        m.map(Record(bad.topic, 0, 0, bad.key, bad_value, 0))
    assert "column 'name'" in err.value.message
    with pytest.raises(NoChange):
        m.map(Record("db.public.items", 0, 1, event("c", 1).key, None, 0))


def test_a_field_that_cannot_be_a_column_is_schema_incompatible() -> None:
    m = mapper_for(settings())
    with pytest.raises(InvalidRecord) as err:
        m.map(event("c", 1, fields=(*FIELDS, Field("_ingest_stream", "int64"))))
    assert err.value.error_class == "schema_incompatible"


def test_a_table_without_a_key_appends_every_record() -> None:
    m = mapper_for(settings())
    value = encode_event("c", None, {"id": 1, "name": "a", "price": None}, fields=FIELDS, lsn=1, ts_ms=1,
                         schemas=True, table="log")
    a, _ = m.map(Record("db.public.log", 0, 5, None, value, 0))
    b, _ = m.map(Record("db.public.log", 0, 6, None, value, 0))
    assert a[SHAPE_AT].shape.key == () and a[KEY_AT] != b[KEY_AT]


def test_one_version_for_every_table_rides_last_and_collapse_keeps_the_highest() -> None:
    p = settings(sink={"version": {"column": "lsn", "source": "@source.lsn"}})
    m = mapper_for(p)
    high, _ = m.map(event("u", 1, offset=0))
    high = (*high[:5], 900, high[-1])  # as if its LSN were 900
    low, _ = m.map(event("u", 1, offset=1))
    assert low[5] == 1  # the event's source.lsn (event() writes lsn=offset)
    failed, groups = collapse([Item(None, r, None, 0, 1) for r in (high, low)], p.collapse_rule())  # type: ignore[arg-type]
    assert failed == [] and groups[0][0].row[5] == 900
    with pytest.raises(InvalidRecord) as err:  # a field named like the version column cannot be a column
        m.map(event("c", 2, fields=(*FIELDS, Field("lsn", "int64"))))
    assert err.value.error_class == "schema_incompatible"


@pytest.mark.parametrize(("sink", "says"), [
    ({"tables": {"t": {"columns": {"x": {"type": "nonsense(("}}}}}, "tables"),
    ({"tables": {"t": {"conflict_key": ["id"], "on_conflict": "none"}}}, "append-only table has no key"),
    ({"tables": {"t": {"conflict_key": []}}}, "at least one column"),
    ({"tables": {"t": {"version_column": "id", "conflict_key": ["id"]}}}, "version_column is a key column"),
    ({"tables": {"t": {"version_column": "v", "on_conflict": "none"}}}, "no version guard"),
    ({"tables": {"t": {"columns": {"x": {"source": "$.y"}}}}}, "type"),
    ({"tables": {"t": {"columns": {"x": {"type": "text", "source": "y"}}}}}, "invalid source"),
    ({"tables": {"t": {"deletes": {"mode": "soft", "tombstone_table": "x"}}}}, "own <table>_ingest_deleted"),
    ({"tables": {"t": {"deletes": {"mode": "soft"}, "on_conflict": "none"}}}, "no key to delete by"),
])
def test_table_overrides_it_cannot_take_say_why(sink: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as err:
        settings(sink=sink)
    assert says in str(err.value)


def test_tables_go_with_columns_auto_only() -> None:
    with pytest.raises(ValidationError) as err:
        PipelineSettings.model_validate({"name": "m", "topics": ["t"], "sink": {
            "table": "t", "conflict_key": ["id"], "columns": {"id": {"type": "bigint"}}, "tables": {"t": {}}}})
    assert "tables: per-table overrides go with columns: auto" in str(err.value)


def test_an_override_rekeys_and_retypes_the_tables_it_matches_only() -> None:
    m = mapper_for(settings(sink={"tables": {"ite*": {"conflict_key": ["name"], "columns": {"price": {"type": "text"}}}}}))
    row, _ = m.map(event("c", 7, name="n7"))
    assert row[KEY_AT] == ("n7",) and row[SHAPE_AT].shape.key == ("name",)
    assert row[VALUES_AT].values == (7, "n7", "1.50")  # the text the numeric coerces to as text
    other, _ = m.map(event("c", 7, name="n7", table="other"))
    assert other[KEY_AT] == (7,)
    with pytest.raises(InvalidRecord) as err:  # the key column must be a field of the value
        mapper_for(settings(sink={"tables": {"items": {"conflict_key": ["nope"]}}})).map(event("c", 1))
    assert err.value.error_class == "schema_incompatible"


def test_preview_shows_the_columns_each_schema_gives_under_its_table() -> None:
    from ingest.config import Settings
    from ingest.preview import preview

    p = settings(sink={"version": {"column": "lsn", "source": "@source.lsn"}})
    again = Settings.model_validate({"pipelines": [p.model_dump(by_alias=True)]})  # settings survive a round trip
    assert again.pipelines[0].auto_columns and again.pipelines[0].sink.version_column == "_ingest_version"
    report = preview(again, p, [event("c", 1), event("d", 2, table="other"), event("c", 3, table="other")])
    tables = report.as_dict()["tables"]
    assert tables["items"] == [{"topic": "db.public.items", "partition": 0, "offset": 0,
                                "row": {"id": 1, "name": "n", "price": __import__("decimal").Decimal("1.50")}}]
    assert [e.get("delete") or e.get("row") for e in tables["other"]] == [
        {"id": 2}, {"id": 3, "name": "n", "price": __import__("decimal").Decimal("1.50")}]


def test_plain_connect_json_values_are_converted_by_their_schema() -> None:
    """Without an envelope, a Connect struct's Decimal (base64) and Date (days) are read by the schema."""
    schema = {"type": "struct", "optional": False, "fields": [
        {"field": "id", "type": "int64", "optional": False},
        {"field": "price", "type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
         "parameters": {"scale": "2", "connect.decimal.precision": "12"}},
        {"field": "day", "type": "int32", "optional": True, "name": "io.debezium.time.Date"}]}
    import datetime
    import json

    p = PipelineSettings.model_validate({"name": "m", "topics": ["plain"], "sink": {
        "kind": "postgres", "table": "plain", "columns": "auto"}})
    key = json.dumps({"schema": {"type": "struct", "fields": [{"field": "id", "type": "int64", "optional": False}]},
                      "payload": {"id": 5}}).encode()
    value = json.dumps({"schema": schema, "payload": {"id": 5, "price": "AOE=", "day": 20000}}).encode()
    row, _ = mapper_for(p).map(Record("plain", 0, 0, key, value, 0))
    assert row[VALUES_AT].values == (5, __import__("decimal").Decimal("2.25"), datetime.date(2024, 10, 4))


def test_sourced_columns_take_their_values_from_the_image_the_source_block_or_metadata() -> None:
    m = mapper_for(settings(sink={"tables": {"items": {"columns": {
        "lsn": {"type": "bigint", "source": "@source.lsn"}, "tag": {"type": "text", "source": "$.name"},
        "part": {"type": "integer", "source": "@partition"}, "name": {"type": "varchar(10)"}}}}}))
    row, _ = m.map(event("c", 7, name="n7", offset=42))
    shape = row[SHAPE_AT].shape
    assert shape.names == ("id", "name", "price", "lsn", "tag", "part")
    assert [(c.type, c.nullable) for c in shape.columns[3:]] == [("bigint", True), ("text", True), ("integer", True)]
    assert row[VALUES_AT].values[3:] == (42, "n7", 0)
    other, _ = m.map(event("c", 7, table="other"))  # no entry: the schema's columns only
    assert other[SHAPE_AT].shape.names == ("id", "name", "price")
    bad = mapper_for(settings(sink={"tables": {"items": {"columns": {"n": {"type": "integer", "source": "$.name"}}}}}))
    with pytest.raises(InvalidRecord) as err:  # a sourced value is coerced like a hand-written column's
        bad.map(event("c", 1, name="abc"))
    assert err.value.error_class == "invalid_value" and "'n'" in str(err.value)


def test_a_sourced_key_column_keys_upserts_and_deletes() -> None:
    m = mapper_for(settings(sink={"tables": {"items": {"conflict_key": ["k"], "columns": {
        "k": {"type": "bigint", "source": "$.id"}}}}}))
    row, _ = m.map(event("c", 7))
    assert row[KEY_AT] == (7,) and row[SHAPE_AT].shape.key == ("k",)
    assert row[SHAPE_AT].shape.column("k").nullable is False
    deleted, _ = m.map(event("d", 7))  # the before image holds the id the key is sourced from
    assert type(deleted) is DeleteRow and deleted[KEY_AT] == (7,)


def test_a_tables_own_version_column_rides_in_the_version_slot_and_collapse_keeps_the_highest() -> None:
    from decimal import Decimal

    p = settings(sink={"tables": {"items": {"version_column": "price"}}})
    assert p.sink.version_column == "_ingest_version"  # the carriers have a version slot
    m = mapper_for(p)

    def priced(i: int, price: str | None, offset: int, op: str = "u") -> Record:
        before = {"id": i, "price": price} if op == "d" else None
        after = None if op == "d" else {"id": i, "name": f"p{price}", "price": price}
        value = encode_event(op, before, after, fields=FIELDS, lsn=offset, ts_ms=1, schemas=True, table="items")
        return Record("db.public.items", 0, offset, encode_key({"id": i}, fields=KEY, schemas=True, table="items"),
                      value, 0)

    high, _ = m.map(priced(1, "9.00", 0))
    low, _ = m.map(priced(1, "2.00", 1))
    assert (high[5].value, low[5].value) == (Decimal("9.00"), Decimal("2.00")) and high[5] > low[5]
    failed, groups = collapse([Item(None, r, None, 0, 1) for r in (high, low)], p.collapse_rule())  # type: ignore[arg-type]
    assert failed == [] and groups[0][0].row is high
    deleted, _ = m.map(priced(1, "9.50", 2, op="d"))  # a delete's version is its before image's
    assert type(deleted) is DeleteRow and deleted[5].value == Decimal("9.50")
    other, _ = m.map(event("c", 1, table="other"))
    assert other[5] == 0  # a table without a version: the last record wins
    for record in (priced(1, None, 3), priced(1, None, 4, op="d")):
        with pytest.raises(InvalidRecord) as err:
            m.map(record)
        assert err.value.error_class == "missing_field" and "'price'" in str(err.value)
    for version, says in (("nope", "neither a field"), ("name", None)):
        m = mapper_for(settings(sink={"tables": {"items": {"version_column": version}}}))
        if says is None:  # text orders too
            assert m.map(event("c", 1, name="b"))[0][5].value == "b"
            continue
        with pytest.raises(InvalidRecord) as err:
            m.map(event("c", 1))
        assert err.value.error_class == "schema_incompatible" and says in str(err.value)


def test_a_tables_own_deletes_change_its_soft_column_and_merge_soft_deletes() -> None:
    p = settings(deletes={"mode": "hard"}, sink={"tables": {"items": {"deletes": {"mode": "soft", "soft_column": "gone"}}}})
    assert p.collapse_rule().merge_deletes  # one table soft-deletes
    assert not settings(deletes={"mode": "hard"}).collapse_rule().merge_deletes
    m = mapper_for(p)
    gone = (*FIELDS, Field("gone", "string"))
    with pytest.raises(InvalidRecord) as err:  # the table's soft column is no field's
        m.map(event("c", 1, fields=gone))
    assert err.value.error_class == "schema_incompatible" and "reserved" in str(err.value)
    row, _ = m.map(event("c", 1, fields=gone, table="other"))  # another table may have a field of that name
    assert "gone" in row[SHAPE_AT].shape.names
    with pytest.raises(ValidationError) as verr:  # a pipeline whose records never delete
        settings(envelope="none", format="json", sink={"table": "{topic}",
                                                        "tables": {"t": {"deletes": {"mode": "soft"}}}})
    assert "never delete" in str(verr.value)


def test_a_delete_without_a_before_image_still_reads_its_sourced_source_block_column() -> None:
    """Review defect: with no before image, ``@source`` was dropped and a sourced key read as missing."""
    m = mapper_for(settings(sink={"tables": {"items": {"columns": {"lsn": {"type": "bigint", "source": "@source.lsn"}},
                                                       "version_column": "lsn"}}}))
    value = encode_event("d", None, None, fields=FIELDS, lsn=77, ts_ms=1, schemas=True, table="items")
    record = Record("db.public.items", 0, 5, encode_key({"id": 3}, fields=KEY, schemas=True, table="items"), value, 0)
    deleted, _ = m.map(record)
    assert type(deleted) is DeleteRow and deleted[KEY_AT] == (3,) and deleted[5].value == 77

