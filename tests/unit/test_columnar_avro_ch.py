"""Avro through the Schema Registry on the columnar tier into ClickHouse, against the row path.

Differential, pure (no engine): for batches of hostile wire-format values (the strategies of
``test_columnar_avro.py``: truncated datums, bytes left over, unknown ids, garbage, no magic byte, two
writer schemas, doubles, NaN, ``decimal`` and ``timestamp-micros`` of years 1 to 9999), the plan of
ClickHouse columns -- ``Decimal(P,S)`` (decimal128 and decimal256) and ``DateTime64(0/3/6/9)`` staged
through the row mapper's own coercer, integers, strings, defaults -- followed by the sink's
:class:`~ingest.sinks.clickhouse.arrow.ColumnarConverter` must give, for the batches it takes, the very
Arrow table the row path inserts (``test_columnar_ch_plan._row_path``: mapped, collapsed, encoded by
:class:`~ingest.sinks.clickhouse.arrow.ArrowEncoder`). No poison record may be taken.
``tests/integration/test_columnar_registry_ch.py`` checks the engine's side.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from decimal import Decimal
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_columnar_avro import LOGICAL, TOPIC, V1, _datum, _framed, _records, registry, values  # noqa: F401
from test_columnar_avro import _row_path as avro_row_path
from test_columnar_ch_plan import _key, _row_path

from ingest.config import PipelineSettings
from ingest.config.formats import SchemaRegistrySettings
from ingest.core.mapping import Mapper
from ingest.formats.avro import AvroDecoder
from ingest.formats.protobuf import ProtobufDecoder
from ingest.runner.columnar import write_tier
from ingest.sinks.clickhouse.arrow import ArrowEncoder, ColumnarConverter
from ingest.sinks.clickhouse.sink import ClickHouseSink

COLUMNS = {
    "event_id": {"type": "UInt64", "source": "$.id"},  # required
    "n": {"type": "Nullable(Int32)"},
    "kind": {"type": "LowCardinality(Nullable(String))"},
    "amount": {"type": "Nullable(Decimal(12, 2))"},  # doubles and decimals of scale 3: rounded, or out of range
    "wide": {"type": "Decimal(40, 10)", "source": "$.amount", "default": "-1.5"},  # decimal256
    "ts": {"type": "Nullable(DateTime64(6))"},  # epoch milliseconds (v1, v2) and timestamp-micros (logical)
    "ms": {"type": "DateTime64(3)", "source": "$.ts", "default": "2024-01-02T03:04:05.678Z"},
    "secs": {"type": "Nullable(DateTime64(0))", "source": "$.ts"},
    "ns": {"type": "Nullable(DateTime64(9))", "source": "$.ts"},  # ticks beyond int64 from 2262 on
    "note": {"type": "Nullable(String)"},
    "channel": {"type": "String", "default": "none"},
    "at": {"type": "Int64", "source": "@offset"},
}


def _pipeline(**overrides) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": [TOPIC], "format": "avro",
        "sink": {"kind": "clickhouse", "url": "chdb://memory", "database": "d", "table": "t",
                 "order_by": ["event_id"], "columns": COLUMNS},
        "dlq": {"kind": "postgres", "dsn": "postgresql://nobody@127.0.0.1:1/none"}, **overrides})


@pytest.fixture(scope="module")
def case(registry):  # noqa: F811 - the fixture imported above
    stand_in, ids = registry
    p = _pipeline()
    decoder = AvroDecoder(p, SchemaRegistrySettings(url=stand_in.url))
    mapper = Mapper(p.sink.columns, decoder=decoder)
    rule = p.collapse_rule()
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None, mapper.columnar_refusal(rule.key_index, rule.version_index)
    types = list(p.sink.ch_types.values())
    encoder = ArrowEncoder.for_columns(list(p.sink.columns), types)
    return SimpleNamespace(ids=ids, decoder=decoder, mapper=mapper, rule=rule, plan=plan, encoder=encoder,
                           converter=ColumnarConverter(plan.columns, types, encoder.schema))


def _taken(case, raw: list[bytes]):
    """``(the plan's batch of raw values converted by the sink, the row path's encoded rows)``, both
    by key, when the plan takes the batch (every record it rejected is poison), else ``(None, None)``:
    the tier writes it by rows. Asserts that no poison record was taken."""
    records = _records(raw)
    case.decoder.prepare(records)
    built = case.plan.build(records)
    assert built is not None  # no tombstone, the registry answers: never the whole batch declined
    rejected = set(built.rejected)
    poison = set(avro_row_path(case.mapper, case.rule, records)[1])  # offsets: positions in the batch
    assert poison <= rejected, "a poison record was taken by the columnar plan"
    if not rejected <= poison:  # a rejected record maps after all: the tier writes the batch by rows
        return None, None
    expected, _ = _row_path(records, case)
    return sorted(case.converter.convert(built.table).to_pylist(), key=_key), expected


def test_the_typed_format_stages_decimals_and_timestamps_through_the_coercer(case):
    assert [c.kind for c in case.plan.columns] == ["int", "int", "text", "coerced_decimal", "coerced_decimal",
                                                   "coerced_ticks", "coerced_ticks", "coerced_ticks",
                                                   "coerced_ticks", "text", "text", "int", "int"]
    utc = timezone.utc
    docs = [{"id": 1, "n": 2, "amount": Decimal("12.345"), "ts": datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=utc)},
            {"id": 2, "n": 2, "amount": None, "ts": datetime(1900, 1, 1, tzinfo=utc)},
            {"id": 3, "n": 2, "amount": Decimal("-0.005"), "ts": datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=utc)},
            {"id": 4, "n": 2, "amount": Decimal("99999999999.995"), "ts": datetime(2026, 1, 1, tzinfo=utc)},  # out of range
            {"id": 5, "n": 2, "amount": None, "ts": datetime(1899, 12, 31, 23, 59, 59, 999999, tzinfo=utc)}]  # too
    got, expected = _taken(case, [_framed(case.ids["logical"], _datum(LOGICAL, d)) for d in docs])
    assert got == expected and [r["event_id"] for r in got] == [1, 2, 3]
    assert (got[0]["amount"], got[2]["amount"], got[1]["wide"]) == (Decimal("12.35"), Decimal("-0.01"), Decimal("-1.5"))
    v1 = {"id": 6, "n": 1, "kind": "NEW", "amount": 1.005, "ts": 1_764_460_800_123, "ratio": 0.5, "flag": True,
          "note": None}  # a double rounded half away from zero; epoch milliseconds beside micros
    got, expected = _taken(case, [_framed(case.ids["v1"], _datum(V1, v1)), _framed(case.ids["logical"], _datum(LOGICAL, docs[0]))])
    assert got == expected and got[1]["amount"] == Decimal("1.01")


def test_ticks_beyond_int64_go_by_rows(case):
    late = {"id": 1, "n": 2, "amount": None, "ts": datetime(2263, 1, 1, tzinfo=timezone.utc)}  # DateTime64(9)
    assert _taken(case, [_framed(case.ids["logical"], _datum(LOGICAL, late))]) == (None, None)


#: LOGICAL's documents within and around ClickHouse's ranges (most of ``test_columnar_avro``'s years are
#: out of DateTime64's): decimals of scale 3 for scale 2 (half-way cases), at and beyond the column's
#: precision, timestamps near 1900, 1970, 2262 (DateTime64(9)'s int64 end) and 2299
ch_logical_docs = st.fixed_dictionaries({
    "id": st.integers(min_value=0, max_value=6), "n": st.integers(min_value=-5, max_value=5),
    "amount": st.none() | st.decimals(min_value=-(10**10), max_value=10**10, places=3, allow_nan=False)
    | st.sampled_from([Decimal("0.005"), Decimal("-0.015"), Decimal("9999999999.994"), Decimal("9999999999.995"),
                       Decimal("-0.000")]),
    "ts": st.datetimes(min_value=datetime(1899, 12, 31), max_value=datetime(2300, 1, 1), timezones=st.just(timezone.utc))
    | st.sampled_from([datetime(1970, 1, 1, tzinfo=timezone.utc), datetime(2262, 4, 11, 23, 47, 16, 854775,
                                                                            tzinfo=timezone.utc)])})


def _batch_values(ids: dict[str, int]) -> st.SearchStrategy[bytes]:
    return st.one_of(values(ids), ch_logical_docs.map(lambda doc: _framed(ids["logical"], _datum(LOGICAL, doc))))


#: how many batches the differential compared whole, or left to the row path
COMPARED = {"columnar": 0, "by rows": 0}


@pytest.mark.xdist_group("columnar-avro-ch-differential")  # with its check, on one worker (--dist loadgroup)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_plan_and_the_conversion_insert_what_the_row_path_inserts(case, data):
    got, expected = _taken(case, data.draw(st.lists(_batch_values(case.ids), min_size=1, max_size=25)))
    COMPARED["by rows" if got is None else "columnar"] += 1
    assert got == expected


@pytest.mark.xdist_group("columnar-avro-ch-differential")
def test_the_differential_compared_columnar_batches():
    """Runs after it (file order, the same worker): the comparison must not have been skipped every time."""
    assert COMPARED["columnar"] >= 20, COMPARED


@pytest.mark.parametrize("fmt", ["avro", "protobuf"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_registry_pipeline_into_clickhouse_states_the_columnar_tier(registry, fmt, lanes):  # noqa: F811
    stand_in, _ = registry
    p = _pipeline(format=fmt, lanes=lanes)
    decoder = {"avro": AvroDecoder, "protobuf": ProtobufDecoder}[fmt](p, SchemaRegistrySettings(url=stand_in.url))
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    assert write_tier(p, sink, columnar_capable=True, exactly_once=False,
                      mapper=lambda: Mapper(p.sink.columns, decoder=decoder)) == "columnar"


def test_the_converter_refuses_coerced_values_staged_for_another_type(case):
    columns = list(case.plan.columns)
    types = list(_pipeline().sink.ch_types.values())
    at = {c.name: i for i, c in enumerate(columns)}
    for name, wrong in (("ts", dataclasses.replace(columns[at["ts"]], precision=3)),  # DateTime64(3) ticks for (6)
                        ("amount", dataclasses.replace(columns[at["amount"]], scale=3)),
                        ("amount", dataclasses.replace(columns[at["ts"]], name="amount"))):  # ticks for a Decimal
        staged = list(columns)
        staged[at[name]] = wrong
        with pytest.raises(ValueError, match="staged for another type"):
            ColumnarConverter(staged, types, case.encoder.schema)
