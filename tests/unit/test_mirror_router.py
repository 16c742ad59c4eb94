"""Routing records to tables (pure logic): the row's table, the mapper wrapper, collapse by table and key.

The writes into many tables are tested against a real PostgreSQL in
``tests/integration/test_mirror_routing.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.core.collapse import collapse
from ingest.errors import InvalidRecord, NoChange
from ingest.mirror.router import table_of, with_table, without_table
from ingest.types import DeleteRow, ImageDeleteRow, Item, Record


def settings(table: str = "{t}", **extra: Any) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "m", "topics": [r"^shop\.public\.(?P<t>.+)$"],
        "sink": {"table": table, "conflict_key": ["id"], "columns": {"id": {"type": "bigint"}, "v": {"type": "text"}},
                 **extra.pop("sink", {})}, **extra})


def record(topic: str, value: Any, offset: int = 0, headers: tuple = ()) -> Record:
    return Record(topic, 0, offset, None, None if value is None else json.dumps(value).encode(), 0, headers)


@pytest.mark.parametrize("kind", [tuple, DeleteRow, ImageDeleteRow])
def test_the_table_rides_at_the_end_and_the_kind_of_row_is_kept(kind: type) -> None:
    row = kind((1, "a", None)) if kind is not tuple else (1, "a", None)
    routed = with_table(row, "orders")
    assert table_of(routed) == "orders" and type(routed) is type(row)
    back = without_table(routed)
    assert back == row and type(back) is type(row)


def test_a_record_maps_to_its_row_and_table() -> None:
    m = mapper_for(settings())
    row, _ = m.map(record("shop.public.order.lines", {"id": 7, "v": "x"}))
    assert row[:2] == (7, "x") and table_of(row) == "order_lines"
    assert m.column_names[-1] == "_ingest_table"


@pytest.mark.parametrize(("topic", "headers", "table", "reason"), [
    ("other.topic", (), "{t}", "gave no group 't'"),
    ("shop.public.ingest_dlq", (), "{t}", "is the DLQ table"),
    ("shop.public.x", (), "{header.tenant}_{t}", "no header"),
    ("shop.public." + "y" * 64, (), "{t}", "PostgreSQL names hold at most 63"),
])
def test_unroutable_records_name_why(topic: str, headers: tuple, table: str, reason: str) -> None:
    with pytest.raises(InvalidRecord) as err:
        mapper_for(settings(table)).map(record(topic, {"id": 1}, headers=headers))
    assert (err.value.stage, err.value.error_class) == ("route", "unroutable")
    assert reason in err.value.message, err.value.message


def test_a_tombstone_with_a_source_template_has_no_row() -> None:
    m = mapper_for(settings("{source.table}", envelope="debezium", sink={
        "columns": {"id": {"type": "bigint"}, "v": {"type": "text"}}}))
    with pytest.raises(NoChange):
        m.map(record("shop.public.x", None))


def test_settings_that_routing_cannot_take_are_refused() -> None:
    for table, extra, words in [("{nope}", {}, "sink.table"), ("{source.table}", {}, "set envelope debezium"),
                                ("{t", {}, "sink.table")]:
        with pytest.raises(ValidationError, match=words):
            settings(table, **extra)


def test_collapse_keys_rows_by_table_and_key() -> None:
    p = settings()
    assert p.routes_tables and p.collapse_rule().key_index == (0, len(p.sink.columns))
    m = mapper_for(p)
    items = [Item(r, m.map(r)[0], None, 0, 1) for r in [
        record("shop.public.a", {"id": 1, "v": "a1"}, 0), record("shop.public.b", {"id": 1, "v": "b1"}, 1),
        record("shop.public.a", {"id": 1, "v": "a2"}, 2)]]
    _, groups = collapse(items, p.collapse_rule())
    winners = sorted((table_of(g[0].row), g[0].row[1]) for g in groups)
    assert winners == [("a", "a2"), ("b", "b1")]


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 3)), max_size=40))
def test_collapse_leaves_one_row_per_table_and_key_the_last(records: list[tuple[str, int]]) -> None:
    p = settings()
    m = mapper_for(p)
    items = [Item(r, m.map(r)[0], None, 0, 1) for r in (
        record(f"shop.public.{t}", {"id": k, "v": str(i)}, i) for i, (t, k) in enumerate(records))]
    _, groups = collapse(items, p.collapse_rule())
    last: dict[tuple[str, int], str] = {}
    for i, (t, k) in enumerate(records):
        last[(t, k)] = str(i)
    assert {(table_of(g[0].row), g[0].row[0]): g[0].row[1] for g in groups} == last


def test_preview_shows_each_row_under_its_table() -> None:
    from ingest.config import Settings
    from ingest.preview import preview

    p = settings("{t}")
    report = preview(Settings.model_validate({"pipelines": [p.model_dump(by_alias=True)]}), p, [
        record("shop.public.orders", {"id": 1, "v": "a"}), record("shop.public.items", {"id": 2, "v": "b"}),
        record("elsewhere", {"id": 3})])
    tables = report.as_dict()["tables"]
    assert {t: [e["row"] for e in rows] for t, rows in tables.items() if rows} == {
        "orders": [{"id": 1, "v": "a"}], "items": [{"id": 2, "v": "b"}]}
    assert [e["error_class"] for e in report.errors] == ["unroutable"]


def test_the_tables_of_topics_refuse_a_second_spelling() -> None:
    from ingest.mirror.router import tables_of_topics

    got = tables_of_topics(settings("{t}"), ["shop.public.Acme", "shop.public.acme", "shop.public.b"], ["B"])
    assert [(t, table) for t, table, _ in got] == [("shop.public.Acme", "Acme"), ("shop.public.acme", None),
                                                   ("shop.public.b", None)]
    assert all("only in case" in why for _, table, why in got if table is None)


def test_braces_outside_a_template_are_refused() -> None:
    with pytest.raises(ValidationError, match="stand for braces in a template only"):
        settings("orders{{v2}}")
