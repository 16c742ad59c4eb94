"""The evolution planner (ingest.mirror.evolve): modes, the widening list, what is incompatible."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.mirror.evolve import Change, Incompatible, Plan, plan
from ingest.mirror.names import CLICKHOUSE, POSTGRES
from ingest.mirror.shape import Column, Shape
from ingest.mirror.types import accepts


def shape(dialect: str = POSTGRES, key: tuple[str, ...] = ("id",), **cols: Any) -> Shape:
    columns = []
    for name, spec in cols.items():
        t, nullable, *default = spec
        columns.append(Column(name, t, nullable, default[0] if default else None))
    return Shape(dialect, tuple(columns), key)


ID = ("bigint", False)
CH_ID = ("Int64", False)


def incompatible(existing: Shape, wanted: Shape, mode: str) -> str:
    p = plan(existing, wanted, mode)  # type: ignore[arg-type]
    assert isinstance(p, Incompatible), p
    return str(p)


def test_no_table_is_a_create_of_the_wanted_shape_in_every_mode() -> None:
    wanted = shape(id=ID, v=("text", True))
    for mode in ("off", "add_columns", "add_and_widen"):
        p = plan(None, wanted, mode)
        assert isinstance(p, Plan) and p.create and p.shape == wanted and not p.empty


def test_a_table_that_already_holds_everything_needs_nothing() -> None:
    existing = shape(id=ID, qty=("bigint", True), name=("text", True), price=("numeric(12,2)", False, "0"),
                     extra=("jsonb", True))
    wanted = shape(id=ID, qty=("integer", False), name=("varchar(10)", False), price=("numeric(10,2)", True))
    for mode in ("off", "add_columns", "add_and_widen"):
        p = plan(existing, wanted, mode)
        assert isinstance(p, Plan) and p.empty and p.shape == existing


def test_a_new_field_is_added_nullable_whatever_the_schema_says() -> None:
    existing = shape(id=ID, a=("text", True))
    p = plan(existing, shape(id=ID, a=("text", True), b=("integer", False), c=("jsonb", True)), "add_columns")
    assert isinstance(p, Plan)
    assert p.changes == (Change("add", Column("b", "integer", True)), Change("add", Column("c", "jsonb", True)))
    assert p.shape.names == ("id", "a", "b", "c")
    assert "off" in incompatible(existing, shape(id=ID, a=("text", True), b=("integer", True)), "off")


def test_clickhouse_adds_nullable_columns_and_arrays_with_an_empty_default() -> None:
    existing = shape(CLICKHOUSE, id=CH_ID)
    wanted = shape(CLICKHOUSE, id=CH_ID, n=("Int32", False), tags=("Array(String)", False, "[]"))
    p = plan(existing, wanted, "add_columns")
    assert isinstance(p, Plan)
    assert [c.column for c in p.changes] == [Column("n", "Int32", True), Column("tags", "Array(String)", False, "[]")]


def test_a_clickhouse_json_column_is_the_string_the_catalog_shows() -> None:
    existing = shape(CLICKHOUSE, id=CH_ID, doc=("String", True), list=("Array(String)", False))
    wanted = shape(CLICKHOUSE, id=CH_ID, doc=("JSON", True), list=("Array(JSON)", False))
    assert plan(existing, wanted, "off").empty  # type: ignore[union-attr]


@pytest.mark.parametrize(("dialect", "old", "new"), [
    (POSTGRES, "smallint", "integer"), (POSTGRES, "integer", "bigint"), (POSTGRES, "smallint", "bigint"),
    (POSTGRES, "real", "double precision"), (POSTGRES, "varchar(10)", "varchar(20)"), (POSTGRES, "varchar(10)", "text"),
    (POSTGRES, "numeric(10,2)", "numeric(14,2)"), (POSTGRES, "numeric(10,2)", "numeric"),
    (CLICKHOUSE, "Int8", "Int64"), (CLICKHOUSE, "UInt16", "UInt32"), (CLICKHOUSE, "UInt32", "Int64"),
    (CLICKHOUSE, "Float32", "Float64"), (CLICKHOUSE, "Decimal(10, 2)", "Decimal(20, 2)"),
    (CLICKHOUSE, "Array(Int32)", "Array(Int64)"),
])
def test_the_widening_list_is_opt_in(dialect, old, new) -> None:
    key = ("id",)
    idc = ID if dialect == POSTGRES else CH_ID
    existing = shape(dialect, key, id=idc, v=(old, True))
    wanted = shape(dialect, key, id=idc, v=(new, True))
    assert "add_and_widen" in incompatible(existing, wanted, "add_columns")
    p = plan(existing, wanted, "add_and_widen")
    assert isinstance(p, Plan) and p.changes == (Change("widen", Column("v", new, True), Column("v", old, True)),)
    assert p.shape.column("v").type == new


@pytest.mark.parametrize(("dialect", "old", "new"), [
    (POSTGRES, "bigint", "text"), (POSTGRES, "text", "bigint"), (POSTGRES, "numeric(10,2)", "numeric(10,4)"),
    (POSTGRES, "timestamp", "timestamptz"), (POSTGRES, "jsonb", "text"), (POSTGRES, "integer", "numeric(20,0)"),
    (POSTGRES, "integer[]", "jsonb"), (POSTGRES, "double precision", "bigint"),
    (CLICKHOUSE, "Int64", "UInt64"), (CLICKHOUSE, "String", "Int64"), (CLICKHOUSE, "DateTime64(3)", "DateTime64(6)"),
    (CLICKHOUSE, "Decimal(10, 2)", "Decimal(10, 4)"), (CLICKHOUSE, "DateTime", "DateTime64(3)"),
])
def test_a_type_that_changes_is_incompatible_in_every_mode(dialect, old, new) -> None:
    idc = ID if dialect == POSTGRES else CH_ID
    existing = shape(dialect, id=idc, v=(old, True))
    wanted = shape(dialect, id=idc, v=(new, True))
    for mode in ("off", "add_columns", "add_and_widen"):
        assert "'v'" in incompatible(existing, wanted, mode)


def test_a_key_that_changes_is_incompatible() -> None:
    existing = shape(id=ID, t=("text", False))
    assert "key changes" in incompatible(existing, shape(key=("id", "t"), id=ID, t=("text", False)), "add_and_widen")
    assert "key changes" in incompatible(existing, shape(key=(), id=("bigint", True), t=("text", True)), "add_columns")
    assert "key changes" in incompatible(shape(key=(), id=("bigint", True)), shape(id=ID), "add_columns")
    assert plan(shape(key=("a", "b"), a=ID, b=ID), shape(key=("b", "a"), a=ID, b=ID)).empty  # type: ignore[union-attr]


def test_a_not_null_column_whose_field_disappears() -> None:
    existing = shape(id=ID, gone=("text", False), kept_default=("integer", False, "0"), opt=("text", True))
    wanted = shape(id=ID)
    assert "'gone'" in incompatible(existing, wanted, "add_columns")
    assert "'gone'" in incompatible(existing, wanted, "off")
    p = plan(existing, wanted, "add_and_widen")
    assert isinstance(p, Plan)
    assert p.changes == (Change("relax", Column("gone", "text", True), Column("gone", "text", False)),)
    assert p.shape.column("gone").nullable and not p.shape.column("kept_default").nullable


def test_a_not_null_column_the_schema_now_allows_null_in() -> None:
    existing = shape(id=ID, v=("integer", False))
    wanted = shape(id=ID, v=("bigint", True))
    assert "NOT NULL" in incompatible(existing, wanted, "add_columns")
    p = plan(existing, wanted, "add_and_widen")
    assert isinstance(p, Plan)
    assert [c.kind for c in p.changes] == ["widen", "relax"]
    assert p.shape.column("v") == Column("v", "bigint", True)


def test_clickhouse_cannot_change_a_sorting_key_column_or_make_an_array_nullable() -> None:
    existing = shape(CLICKHOUSE, id=("Int32", False), a=("Array(Int32)", False))
    assert "sorting key" in incompatible(existing, shape(CLICKHOUSE, id=("Int64", False),
                                                         a=("Array(Int32)", False)), "add_and_widen")
    assert "Array" in incompatible(existing, shape(CLICKHOUSE, id=("Int32", False)), "add_and_widen")
    p = plan(shape(CLICKHOUSE, id=CH_ID, n=("Int32", False)), shape(CLICKHOUSE, id=CH_ID, n=("Int32", True)),
             "add_and_widen")
    assert isinstance(p, Plan) and p.changes[0].kind == "relax"


def test_postgres_may_widen_a_key_column() -> None:
    p = plan(shape(id=("integer", False)), shape(id=("bigint", False)), "add_and_widen")
    assert isinstance(p, Plan) and p.changes[0].column == Column("id", "bigint", False)


def test_every_difference_is_listed() -> None:
    existing = shape(id=ID, a=("text", False), b=("bigint", True))
    wanted = shape(key=("id", "c"), id=ID, b=("text", True), c=("integer", False))
    found = incompatible(existing, wanted, "add_columns")
    assert "key changes" in found and "'a'" in found and "'b'" in found
    assert found.count(";") == 2


_TYPES = ["smallint", "integer", "bigint", "real", "double precision", "text", "varchar(5)", "varchar(9)",
          "numeric(10,2)", "numeric(12,2)", "numeric", "jsonb"]


@st.composite
def _table(draw: Any) -> Shape:
    names = draw(st.lists(st.sampled_from("abcde"), unique=True, max_size=5))
    return Shape(POSTGRES, (Column("id", "bigint", False),) + tuple(
        Column(n, draw(st.sampled_from(_TYPES)), draw(st.booleans()), draw(st.sampled_from([None, "0"])))
        for n in names), ("id",))


@given(_table(), _table(), st.sampled_from(["off", "add_columns", "add_and_widen"]))
def test_after_a_plan_the_table_fits_and_keeps_every_column(existing, wanted, mode) -> None:
    """Property: a plan's resulting shape keeps every existing column, holds every wanted column's
    values (and NULL where the wanted column may be null or is gone), and planning again from it is
    empty. An Incompatible names at least one difference."""
    p = plan(existing, wanted, mode)
    if isinstance(p, Incompatible):
        assert p.differences
        return
    final = p.shape
    assert final.names[:len(existing.names)] == existing.names
    for w in wanted.columns:
        c = final.column(w.name)
        assert c is not None and accepts(c.type, w.type, POSTGRES)
        assert c.nullable or not w.nullable or c.default is not None
    for e in existing.columns:
        if wanted.column(e.name) is None:
            assert final.column(e.name).nullable or final.column(e.name).default is not None
    again = plan(final, wanted, mode)
    assert isinstance(again, Plan) and again.empty
    if mode == "off":
        assert p.empty
