"""The ``explode`` step and its child rows, without a database (pure logic: settings, step, mapper).

The writes -- parent and children in one transaction, replace, the guard -- are tested against a
real PostgreSQL in ``tests/integration/test_explode.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.errors import InvalidRecord
from ingest.types import FamilyRow, Record

CHILD_COLUMNS = {"order_id": {"type": "bigint"}, "line_no": {"type": "integer"},
                 "sku": {"type": "text", "required": True}, "qty": {"type": "integer"}}


def explode(**overrides: Any) -> dict[str, Any]:
    return {"path": "items", "table": "order_items", "conflict_key": ["order_id", "line_no"],
            "columns": CHILD_COLUMNS, "parent": {"order_id": "value.id"}, "index_as": "line_no", **overrides}


def pipeline(step: dict[str, Any] | None = None, *, sink: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "orders", "topics": ["t"], "transforms": [{"explode": step or explode()}, *extra.pop("more", [])],
            "sink": {"table": "orders", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint"}, "note": {"type": "text"}}, **(sink or {})}, **extra}


def mapper(data: dict[str, Any]) -> Any:
    return mapper_for(PipelineSettings.model_validate(data))


def record(value: Any, offset: int = 5) -> Record:
    return Record("t", 2, offset, None, json.dumps(value).encode(), 0)


def test_each_element_becomes_a_child_row_with_the_parent_link_and_position() -> None:
    row, _ = mapper(pipeline(explode(index_start=1))).map(record(
        {"id": 7, "note": "n", "items": [{"sku": "a", "qty": 2}, {"sku": "b", "order_id": 99}]}))
    assert isinstance(row, FamilyRow) and row[:2] == (7, "n")
    (link, children), = row.families
    assert link == (7,)
    # the parent column wins over an element's field of the same name; hidden source columns follow
    assert [c[:4] for c in children] == [(7, 1, "a", 2), (7, 2, "b", None)]
    assert {c[4:] for c in children} == {row[2:]}  # the record's stream and offset, as the parent's


def test_an_element_that_is_not_an_object_is_read_as_value() -> None:
    step = explode(columns={"order_id": {"type": "bigint"}, "line_no": {"type": "integer"},
                            "tag": {"type": "text", "source": "$.value"}})
    row, _ = mapper(pipeline(step)).map(record({"id": 1, "items": ["x", "y"]}))
    assert [c[:3] for c in row.families[0][1]] == [(1, 0, "x"), (1, 1, "y")]


@pytest.mark.parametrize(("value", "words"), [
    ({"id": 1}, "explode: field 'items' is missing or null"),
    ({"id": 1, "items": None}, "explode: field 'items' is missing or null"),
    ({"id": 1, "items": {"sku": "a"}}, "explode: field 'items' is not an array, got dict"),
    ({"id": 1, "items": [{"sku": "a"}, {"qty": 1}]}, "explode element 1: column 'sku'"),
    ({"id": 1, "items": [{"sku": "a", "qty": "many"}]}, "explode element 0: column 'qty'"),
])
def test_a_poison_element_or_array_fails_the_whole_record(value: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRecord) as err:
        mapper(pipeline()).map(record(value))
    assert (err.value.stage, err.value.error_class) == ("transform", "transform_error")
    assert err.value.message.startswith("transforms[0] (0-explode): ") and words in err.value.message, err.value.message


def test_elements_repeating_a_child_key_fail_the_record() -> None:
    step = explode(conflict_key=["order_id", "sku"], index_as=None)
    with pytest.raises(InvalidRecord, match="explode elements 0 and 2 have one child key"):
        mapper(pipeline(step)).map(record({"id": 1, "items": [{"sku": "a"}, {"sku": "b"}, {"sku": "a"}]}))


def test_a_parent_expression_that_fails_names_its_column() -> None:
    with pytest.raises(InvalidRecord, match=r"explode.parent.order_id: "):
        mapper(pipeline(explode(parent={"order_id": "value.missing"}))).map(record({"id": 1, "items": []}))


def test_when_false_leaves_the_children_alone_and_empty_means_none() -> None:
    m = mapper(pipeline({**explode()}, more=[]) | {"transforms": [{"explode": explode(), "when": "value.id > 5"}]})
    skipped, _ = m.map(record({"id": 1, "items": [{"sku": "a"}]}))
    assert skipped.families == (None,)
    empty, _ = m.map(record({"id": 9, "items": []}))
    assert empty.families == (((9,), []),)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.fixed_dictionaries({"sku": st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1, max_size=5), "qty": st.integers(-5, 5)}),
                max_size=30), st.integers(0, 1))
def test_n_elements_give_n_child_rows_in_order(items: list[dict[str, Any]], start: int) -> None:
    row, _ = mapper(pipeline(explode(index_start=start))).map(record({"id": 3, "items": items}))
    (_, children), = row.families
    assert [(c[1], c[2], c[3]) for c in children] == [(i + start, it["sku"], it["qty"]) for i, it in enumerate(items)]


@pytest.mark.parametrize(("data", "words"), [
    (pipeline() | {"sink": {"kind": "clickhouse", "table": "orders", "order_by": ["id"],
                            "columns": {"id": {"type": "Int64"}}}}, "columns.order_id.type: unsupported column type"),
    (pipeline() | {"sink": {"kind": "clickhouse", "table": "orders", "order_by": ["id"], "version_column": "v",
                            "columns": {"id": {"type": "Int64"}, "v": {"type": "UInt64"}}}}, "version_column"),
    (pipeline(sink={"version_column": "id"}), "version_column"),
    (pipeline(sink={"on_conflict": "none", "conflict_key": []}), "on_conflict update"),
    (pipeline(sink={"write_method": "values"}), "write_method copy"),
    (pipeline(tombstones="delete", sink={"columns": {"id": {"type": "bigint", "source": "@key"}}}),
     "does not combine with deletes"),
    (pipeline(explode(table="orders")), "is the sink's own table"),
    (pipeline(more=[{"explode": explode(path="other")}]), "two explode steps write 'order_items'"),
    (pipeline(explode(conflict_key=["sku", "nope"])), "conflict_key ['nope'] not among columns"),
    (pipeline(explode(parent={"order_id": "value.id", "x": "1"})), "parent ['x'] not among columns"),
    (pipeline(explode(columns={**CHILD_COLUMNS, "order_id": {"type": "bigint", "source": "$.oid"}})),
     "takes its value from parent/index_as"),
    (pipeline(explode(columns={**CHILD_COLUMNS, "_ingest_x": {"type": "text"}})), "reserved for ingest"),
    (pipeline(explode(columns={**CHILD_COLUMNS, "qty": {"type": "fancy"}})), "transforms[0].explode: columns: column 'qty': unsupported column type 'fancy'"),
    (pipeline(explode(path="items..x")), "invalid path"),
])
def test_settings_that_cannot_work_are_refused_naming_why(data: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError) as err:
        PipelineSettings.model_validate(data)
    assert words in str(err.value), str(err.value)


def test_clickhouse_children_mark_the_stale_ones_and_skip_late_parents() -> None:
    """The ClickHouse child table's insert for a batch (pure: the table reads are given): new children,
    a delete marker for each child the parent's array no longer holds, nothing for a parent whose
    stored version is newer than its record."""
    from ingest.sinks.clickhouse.children import ChildTable

    p = PipelineSettings.model_validate(pipeline(explode(columns={
        "order_id": {"type": "Int64"}, "line_no": {"type": "Int32"}, "sku": {"type": "String"},
        "qty": {"type": "Nullable(Int32)"}})) | {"sink": {"kind": "clickhouse", "table": "orders", "order_by": ["id"],
                                                        "columns": {"id": {"type": "Int64"},
                                                                    "note": {"type": "Nullable(String)"}}},
                                                  "dlq": {"kind": "kafka", "topic": "dlq"}})
    child = ChildTable(0, p.sink, p.explode_steps[0][1])
    m = mapper_for(p)
    fresh, _ = m.map(record({"id": 1, "items": [{"sku": "a", "qty": 1}]}, offset=9))
    late, _ = m.map(record({"id": 2, "items": [{"sku": "z"}]}, offset=3))

    def query(text: str, parameters: dict[str, Any]) -> list[tuple[Any, ...]]:
        if "keys" in parameters:  # the parents' stored versions: order 2 has a newer row than offset 3
            return [(2, 7)]
        assert parameters == {"links": [(1,)]}  # only the parents that apply are asked about
        return [(1, 0, 1), (1, 1, 1)]  # order 1 holds line 0 and line 1: line 1 is gone now

    out = child.rows(query, [fresh, late])
    names = child.columns
    rows = [dict(zip(names, r)) for r in out]
    assert [(r["order_id"], r["line_no"], r["sku"], r["_ingest_deleted"], r["_version"]) for r in rows] == [
        (1, 0, "a", 0, 9), (1, 1, "", 1, 9)]


def test_clickhouse_explode_refuses_columns_that_do_not_come_back_as_mapped() -> None:
    """A DateTime64 in the parent's sorting key or the child's key comes back from ClickHouse as a datetime
    (the mapper's value is its ticks): explode could not tell a child it reads back from one it wrote."""
    base = pipeline(explode(columns={"order_id": {"type": "Int64"}, "line_no": {"type": "Int32"},
                                     "sku": {"type": "String"}, "qty": {"type": "Nullable(Int32)"}}))
    sink = {"kind": "clickhouse", "table": "orders", "order_by": ["id", "at"],
            "columns": {"id": {"type": "Int64"}, "at": {"type": "DateTime64(3)"}}}
    with pytest.raises(ValidationError, match=r"transforms\[0\]\.explode: sink.order_by: column 'at' is DateTime64"):
        PipelineSettings.model_validate(base | {"sink": sink, "dlq": {"kind": "kafka", "topic": "d"}})
