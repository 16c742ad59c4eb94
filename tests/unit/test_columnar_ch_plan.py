"""The columnar tier for ClickHouse tables: the plan plus the sink's conversion against the row path.

Differential, pure (no engine): for batches of hostile JSON records, the plan
(:class:`~ingest.core.mapping.columnar.ColumnarPlan`, ClickHouse columns) followed by the sink's
:class:`~ingest.sinks.clickhouse.arrow.ColumnarConverter` must produce, for the batches it takes,
the very Arrow table the row path inserts: each record mapped by the row mapper, collapsed by
:func:`ingest.core.collapse.collapse` (highest ``_version`` -- the offset -- per key, ties to the
last record), encoded by :class:`~ingest.sinks.clickhouse.arrow.ArrowEncoder`. No poison record
may be taken. ``tests/integration/test_columnar_ch.py`` checks the engine's side.
"""

from __future__ import annotations

import json
from decimal import Decimal

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ingest.core.collapse import collapse
from ingest.core.mapping import Mapper
from ingest.errors import InvalidRecord
from ingest.sinks.clickhouse.arrow import ArrowEncoder, ColumnarConverter
from ingest.sinks.clickhouse.settings import ClickHouseSinkSettings
from ingest.types import Item, Record

COLUMNS = {
    "event_id": {"type": "UInt64", "source": "$.id"},  # not Nullable, no default: required
    "small": {"type": "Nullable(UInt8)", "source": "$.s"},
    "big": {"type": "Nullable(Int64)", "source": "$.b"},
    "kind": {"type": "LowCardinality(Nullable(String))", "source": "$.kind"},
    "note": {"type": "Nullable(String)", "source": "$.note"},
    "amount": {"type": "Nullable(Decimal(12, 2))", "source": "$.amount"},
    "ts": {"type": "Nullable(DateTime64(3))", "source": "$.ts"},
    "micros": {"type": "Nullable(DateTime64(6))", "source": "$.us"},
    "secs": {"type": "Nullable(DateTime64(0))", "source": "$.sec"},
    "part": {"type": "Int32", "source": "@partition"},
}


#: The same columns with defaults the tier stages exactly (a missing or null value takes them), and a
#: non-Nullable column that a default makes optional.
DEFAULTED = {**COLUMNS,
             "small": {**COLUMNS["small"], "default": 7}, "big": {**COLUMNS["big"], "default": -3},
             "kind": {**COLUMNS["kind"], "default": "none"}, "note": {**COLUMNS["note"], "default": ""},
             "amount": {**COLUMNS["amount"], "default": "1.25"},
             "ts": {**COLUMNS["ts"], "default": "2024-01-02T03:04:05.678Z"},
             "micros": {**COLUMNS["micros"], "default": 1_700_000_000_123},  # epoch ms
             "secs": {**COLUMNS["secs"], "default": "2024-01-01T00:00:00Z"},
             "count": {"type": "UInt32", "source": "$.b", "default": 0}}


def _settings(**kw) -> ClickHouseSinkSettings:
    return ClickHouseSinkSettings(kind="clickhouse", url="chdb://memory", database="d", table="t", **kw)


class Case:
    """One column set: its settings, row mapper, collapse rule, columnar plan and the row path's encoder."""

    def __init__(self, columns: dict) -> None:
        self.cfg = _settings(order_by=["event_id"], columns=columns)
        self.mapper = Mapper(self.cfg.columns)
        self.rule = self.cfg.collapse_rule()
        self.plan = self.mapper.columnar_plan(self.rule.key_index, self.rule.version_index)
        self.types = list(self.cfg.ch_types.values())
        self.encoder = ArrowEncoder.for_columns(list(self.cfg.columns), self.types)


CASES = {"plain": Case(COLUMNS), "defaults": Case(DEFAULTED)}
CFG, MAPPER, RULE, PLAN = CASES["plain"].cfg, CASES["plain"].mapper, CASES["plain"].rule, CASES["plain"].plan
TYPES, ENCODER = CASES["plain"].types, CASES["plain"].encoder

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 255, 256, 2**63 - 1, 2**63, 1_764_460_800_123, 10_413_791_999_999,
                     10_413_792_000_000, 9_223_372_036_854]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.1, 0.285, 1.005, 12.5, -3.25, 1e21, 1e-7, -0.0, 5e-324, 99999999.99, 999999999.99,
                     1e9, 0.30000000000000004]),
    st.text(max_size=8), st.sampled_from(["", "a\x00b", "quote\"d", "ünï", "line\nbreak"]),
    st.lists(st.integers(), max_size=2),
)
documents = st.fixed_dictionaries(
    {"id": st.one_of(st.integers(min_value=0, max_value=5), scalars)},
    optional={"s": scalars, "b": scalars, "kind": scalars, "note": scalars, "amount": scalars, "ts": scalars,
              "us": scalars, "sec": scalars, "extra": scalars},
)


@st.composite
def values(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([b"", b"{", b"[1]", b"null", b'{"id":1}{"id":2}', b'{"id": 1e400}',
                                     b'{"id":1,"kind":"\xff"}']))
    return json.dumps(draw(documents)).encode()  # stdlib: integers beyond 64 bits too


def _records(raw: list[bytes]) -> list[Record]:
    """Offsets that repeat and go backwards across partitions: the version (the offset) decides
    which record of a key wins, ties going to the later record."""
    return [Record("t", i % 3, (i * 5) % 7, b"k", value, 1_700_000_000_000 + i) for i, value in enumerate(raw)]


def _row_path(records: list[Record], case: Case = CASES["plain"]) -> tuple[list[dict] | None, set[int]]:
    """The row path: mapped, collapsed, encoded as the sink's Arrow table (rows by key); and the
    positions of the poison records."""
    items, poison = [], set()
    for i, rec in enumerate(records):
        try:
            row, _ = case.mapper.map(rec)
            items.append(Item(rec, row, None, 0, 1))
        except InvalidRecord:
            poison.add(i)
    _, groups = collapse(items, case.rule)
    rows = [group[0].row for group in groups]
    table = case.encoder.table(list(zip(*rows))) if rows else None
    return (sorted(table.to_pylist(), key=_key) if table is not None else []), poison


def _key(row: dict) -> int:
    return row["event_id"]


COMPARED = {name: {"columnar": 0, "by rows": 0} for name in CASES}


def test_the_bench_shape_and_these_columns_have_a_plan_and_others_do_not():
    assert PLAN is not None
    assert [c.kind for c in PLAN.columns] == ["int", "int", "int", "text", "text", "decimal", "epoch_ms",
                                               "epoch_ms", "epoch_ms", "int", "int"]  # + the hidden _version
    assert [c.scale for c in PLAN.columns if c.kind == "decimal"] == [2]
    assert not any(c.forbid_nul for c in PLAN.columns if c.kind == "text")  # ClickHouse strings hold NUL
    assert [c.default for c in CASES["defaults"].plan.columns] == [
        None, 7, -3, "none", "", 1.25, 1_704_164_645_678, 1_700_000_000_123, 1_704_067_200_000, None, 0, None]
    for column in ({"type": "UInt64", "source": "$.x.y"}, {"type": "Float64", "source": "$.x"},
                   {"type": "Nullable(DateTime64(6))", "source": "$.x", "default": "2024-01-01T00:00:00.000001Z"},
                   {"type": "Nullable(Decimal(30, 20))", "source": "$.x", "default": "0.1000000000000000055511"},
                   {"type": "Bool", "source": "$.x"},
                   {"type": "Date", "source": "$.x"}, {"type": "UUID", "source": "$.x"},
                   {"type": "Array(UInt8)", "source": "$.x"}):
        cfg = _settings(order_by=["id"], columns={"id": {"type": "UInt64"}, "a": column})
        rule = cfg.collapse_rule()
        assert Mapper(cfg.columns).columnar_plan(rule.key_index, rule.version_index) is None, column


def test_a_version_column_that_is_not_an_integer_column_has_no_plan():
    cfg = _settings(order_by=["id"], version_column="at",
                    columns={"id": {"type": "UInt64"}, "at": {"type": "DateTime64(0)"}})
    rule = cfg.collapse_rule()
    assert rule.version_index == 1
    assert Mapper(cfg.columns).columnar_plan(rule.key_index, rule.version_index) is None


@pytest.mark.xdist_group("columnar-ch-differential")  # with the check below, on one worker (pytest-xdist --dist loadgroup)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(values(), min_size=1, max_size=25))
@example([b'{"id": 1, "amount": 1.005}', b'{"id": 2, "amount": 12.5}'])  # 1.005 rounds: by rows
@example([b'{"id": 1, "note": "a\\u0000b", "s": 7}', b'{"id": 1, "s": 8}'])  # NUL is fine in ClickHouse
@example([b'{"id": 3, "ts": 10413791999999, "us": 10413791999999, "sec": 1999}'])  # the last DateTime64 ms
@example([b'{"id": 4, "s": null, "b": null, "kind": null, "amount": null, "ts": null}', b'{"id": 5}'])  # defaults
@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_and_the_conversion_insert_what_the_row_path_inserts(case, raw):
    c = CASES[case]
    records = _records(raw)
    expected, poison = _row_path(records, c)
    built = c.plan.build(records)
    assert built is not None  # no tombstone, no newline: the plan never declines the whole batch
    rejected = set(built.rejected)
    assert poison <= rejected, "a poison record was taken by the columnar plan"
    if not rejected <= poison:  # a rejected record maps after all: the tier writes this batch by rows
        COMPARED[case]["by rows"] += 1
        return
    COMPARED[case]["columnar"] += 1
    converted = ColumnarConverter(c.plan.columns, c.types, c.encoder.schema).convert(built.table)
    assert converted.schema == c.encoder.schema
    assert sorted(converted.to_pylist(), key=_key) == expected


@pytest.mark.xdist_group("columnar-ch-differential")
def test_the_differential_test_compared_columnar_batches():
    """Runs after it (file order, the same worker): the comparison must not have been skipped every time."""
    assert all(counts["columnar"] >= 20 for counts in COMPARED.values()), COMPARED


def test_the_highest_version_wins_a_key_and_ties_go_to_the_later_record():
    docs = [{"id": 1, "s": i} for i in range(4)]
    records = [Record("t", p, off, b"k", orjson.dumps(d), 0) for (p, off), d in zip([(0, 9), (1, 3), (2, 9), (0, 1)], docs)]
    built = PLAN.build(records)
    assert built is not None and built.rejected == []
    assert [(r["small"], r["_version"]) for r in built.table.to_pylist()] == [(2, 9)]


def test_values_that_need_rounding_or_are_out_of_range_are_left_to_the_row_mapper():
    raw = [b'{"id": 1, "amount": 1.005}', b'{"id": 2, "amount": 1e10}', b'{"id": 3, "ts": 10413792000000}',
           b'{"id": 4, "s": 256}', b'{"id": 5, "amount": 99.99, "ts": 0}']
    built = PLAN.build(_records(raw))
    assert built is not None and built.rejected == [0, 1, 2, 3]
    converted = ColumnarConverter(PLAN.columns, TYPES, ENCODER.schema).convert(built.table)
    row = converted.to_pylist()[0]
    assert (row["event_id"], row["amount"], row["ts"].year) == (5, Decimal("99.99"), 1970)


def test_the_converter_refuses_a_staged_kind_the_column_cannot_take():
    kinds = list(PLAN.columns)
    wrong = [kinds[6]] + kinds[1:6] + [kinds[0]] + kinds[7:]  # epoch ms for the UInt64 column
    with pytest.raises(ValueError, match="epoch milliseconds"):
        ColumnarConverter(wrong, TYPES, ENCODER.schema)
