"""Avro through the Schema Registry on the columnar tier, against the row path, which decides.

The plan reads the documents the pipeline's own Avro decoder makes (``decode_batch``: fastavro per
record, the row mapper's decode exactly), so for every batch of hostile wire-format values --
truncated datums, bytes left over, unknown schema ids, no magic byte, garbage, two writer schemas
(an added field with a default, a widened type) in one batch, NaN and infinities, values out of a
column's range -- every record it takes must be one the row mapper maps, every record it rejects is
handed back, and the rows it keeps are the rows the row path writes after the collapse. The tier
hands poison back with the row mapper's own failure (stage, class, message), and logical types the
plan does not stage (decimal, timestamp-millis, date, uuid) send their batch to the row path.

The registry is the stand-in of ``tests/harness/schema_registry.py`` over real HTTP.
"""

from __future__ import annotations

import io
import json
import math
import struct
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Context, Decimal
from typing import Any

import orjson
import pytest
from fastavro import parse_schema, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.schema_registry import SchemaRegistryStandIn
from harness.serde import avro_varint
from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.config.formats import SchemaRegistrySettings
from ingest.core.collapse import collapse
from ingest.core.mapping import Mapper
from ingest.core.mapping.columnar import UNROUTED, Digits, Micros
from ingest.core.routing import key_bytes
from ingest.errors import InvalidRecord
from ingest.formats.avro import AvroDecoder
from ingest.runner.columnar import ColumnarTier, write_tier
from ingest.types import Item, Record

TOPIC = "orders"

V1 = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    {"name": "id", "type": "long"},
    {"name": "n", "type": "int"},
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["NEW", "PAID", "SHIPPED"]}},
    {"name": "amount", "type": "double"},
    {"name": "ts", "type": "long"},
    {"name": "ratio", "type": "float"},
    {"name": "flag", "type": "boolean"},
    {"name": "note", "type": ["null", "string"], "default": None},
]}
#: evolution: ``n`` widened to long, ``channel`` added with a default, ``flag`` removed
V2 = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    {"name": "id", "type": "long"},
    {"name": "n", "type": "long"},
    {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["NEW", "PAID", "SHIPPED"]}},
    {"name": "amount", "type": "double"},
    {"name": "ts", "type": "long"},
    {"name": "ratio", "type": "float"},
    {"name": "note", "type": ["null", "string"], "default": None},
    {"name": "channel", "type": "string", "default": "web"},
]}
#: logical types the plan stages through the row mapper's coercer: a decimal, timestamps (and a
#: nullable decimal, a union: Decimal or None)
LOGICAL = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    {"name": "id", "type": "long"},
    {"name": "n", "type": "int"},
    {"name": "amount", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 14, "scale": 3}]},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
]}
#: a logical type the plan does not stage (a UUID read into a text column): its batches go by rows
UUIDS = {"type": "record", "name": "Order", "namespace": "t", "fields": [
    {"name": "id", "type": "long"},
    {"name": "kind", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
]}

COLUMNS = {
    "id": {"type": "bigint", "required": True},
    "n": {"type": "integer"},
    "kind": {"type": "text"},
    "amount": {"type": "numeric(12,2)"},
    "ts": {"type": "timestamptz"},
    "ratio": {"type": "double precision"},
    "flag": {"type": "boolean"},
    "note": {"type": "text"},
    "channel": {"type": "text", "default": "none"},
    "at": {"type": "bigint", "source": "@offset"},
}
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: room for any double's digits when rounding to the column's scale
WIDE = Context(prec=400)


@pytest.fixture(scope="module")
def registry():
    stand_in = SchemaRegistryStandIn()
    try:
        ids = {name: stand_in.register(f"{TOPIC}-value", json.dumps(schema))
               for name, schema in (("v1", V1), ("v2", V2), ("logical", LOGICAL), ("uuids", UUIDS))}
        yield stand_in, ids
    finally:
        stand_in.stop()


def _pipeline(url: str, **overrides) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": [TOPIC], "format": "avro",
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["id"],
                 "columns": COLUMNS}, **overrides})


@pytest.fixture(scope="module")
def parts(registry):
    stand_in, ids = registry
    p = _pipeline(stand_in.url)
    decoder = AvroDecoder(p, SchemaRegistrySettings(url=stand_in.url))
    mapper = Mapper(p.sink.columns, decoder=decoder)
    rule = p.collapse_rule()
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None, mapper.columnar_refusal(rule.key_index)
    return ids, decoder, mapper, rule, plan


def _datum(schema: dict, doc: dict) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(schema), doc)
    return buf.getvalue()


def _framed(schema_id: int, datum: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + datum


def _records(values: list[bytes]) -> list[Record]:
    return [Record(TOPIC, i % 3, i, b"k", v, 1_700_000_000_000 + i) for i, v in enumerate(values)]


def _row_path(mapper: Mapper, rule, records: list[Record]) -> tuple[dict, dict[int, tuple]]:
    """Rows by key after the collapse, and each poison record's failure by offset."""
    items, poison = [], {}
    for rec in records:
        try:
            row, _ = mapper.map(rec)
            items.append(Item(rec, row, None, 0, 1))
        except InvalidRecord as exc:
            poison[rec.offset] = (exc.stage, exc.error_class, exc.message)
    _, groups = collapse(items, rule)
    return {group[0].row[0]: group[0].row for group in groups}, poison


def _as_database_would(row: dict) -> tuple:
    """A staged row converted as the upsert converts it (numeric text, epoch microseconds)."""
    converted = dict(row)
    if row["amount"] is not None:
        value = row["amount"]  # a float staged as its shortest digits (Arrow's CSV writer writes those)
        converted["amount"] = Decimal(value if type(value) is str else orjson.dumps(value).decode()).quantize(
            Decimal("0.01"), context=WIDE)
    if row["ts"] is not None:
        converted["ts"] = EPOCH + timedelta(microseconds=row["ts"])
    return tuple(converted.values())


def _as_row_path_would(row: tuple) -> tuple:
    """The row mapper's row with its numeric rounded to the column's scale (PostgreSQL does that)."""
    values = list(row)
    amount = COLUMNS_INDEX["amount"]
    if values[amount] is not None:
        values[amount] = Decimal(values[amount]).quantize(Decimal("0.01"), context=WIDE)
    return tuple(values)


COLUMNS_INDEX = {name: i for i, name in enumerate(COLUMNS)}

ints = st.one_of(st.integers(min_value=-5, max_value=5), st.sampled_from([2**31 - 1, -(2**31), 2**40, -(2**63)]))
floats = st.one_of(st.floats(width=64), st.sampled_from([0.285, 1e21, -0.0, 5e-324, 1234567890.125]))
texts = st.one_of(st.text(max_size=6), st.sampled_from(["a\x00b", "comma,", "line\nbreak", "ünï", ""]))
v1_docs = st.fixed_dictionaries({
    "id": st.integers(min_value=0, max_value=6), "n": st.integers(min_value=-(2**31), max_value=2**31 - 1),
    "kind": st.sampled_from(["NEW", "PAID", "SHIPPED"]), "amount": floats,
    "ts": st.one_of(st.integers(min_value=-(2**52), max_value=2**52), st.sampled_from([2**62, -(2**63)])),
    "ratio": st.floats(width=32), "flag": st.booleans(), "note": st.none() | texts})
v2_docs = st.fixed_dictionaries({
    "id": st.integers(min_value=0, max_value=6), "n": ints | st.sampled_from([2**63 - 1]),
    "kind": st.sampled_from(["NEW", "PAID"]), "amount": floats, "ts": st.integers(min_value=0, max_value=2**45),
    "ratio": st.floats(width=32, allow_nan=False), "note": st.none() | texts, "channel": texts})


logical_docs = st.fixed_dictionaries({
    "id": st.integers(min_value=0, max_value=6), "n": st.integers(min_value=-5, max_value=5),
    "amount": st.none() | st.decimals(min_value=-(10**11) + 1, max_value=10**11 - 1, places=3, allow_nan=False)
    | st.sampled_from([Decimal("-0.000"), Decimal("0.005"), Decimal("-0.015"), Decimal("99999999999.995")]),
    "ts": st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(timezone.utc))
    | st.sampled_from([datetime(1685, 1, 1, tzinfo=timezone.utc), datetime(2255, 12, 31, tzinfo=timezone.utc)])})


@st.composite
def values(draw: st.DrawFn, ids: dict[str, int]) -> bytes:
    kind = draw(st.sampled_from(["v1"] * 5 + ["v2"] * 4 + ["logical"] * 3 + ["truncated", "extra", "unknown",
                                                                             "garbage", "magic", "short"]))
    if kind in ("v1", "v2", "logical"):
        schema, docs = {"v1": (V1, v1_docs), "v2": (V2, v2_docs), "logical": (LOGICAL, logical_docs)}[kind]
        return _framed(ids[kind], _datum(schema, draw(docs)))
    datum = _datum(V1, draw(v1_docs))
    if kind == "truncated":
        return _framed(ids["v1"], datum[:draw(st.integers(min_value=0, max_value=len(datum) - 1))])
    if kind == "extra":
        return _framed(ids[draw(st.sampled_from(["v1", "v2"]))], datum + draw(st.binary(min_size=1, max_size=3)))
    if kind == "unknown":
        return _framed(9999, datum)
    if kind == "garbage":
        return _framed(ids[draw(st.sampled_from(["v1", "v2"]))], draw(st.binary(max_size=30)))
    if kind == "magic":
        return b"\x07" + datum
    return draw(st.binary(max_size=4))


#: how many batches the differential compared whole, or left to the row path; records routed by the plan
COMPARED = {"columnar": 0, "by rows": 0, "routed": 0}


@pytest.mark.xdist_group("columnar-avro-differential")  # with its check, on one worker (--dist loadgroup)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_plan_writes_what_the_row_path_writes(parts, data):
    ids, decoder, mapper, rule, plan = parts
    raw = data.draw(st.lists(values(ids), min_size=1, max_size=25))
    records = _records(raw)
    decoder.prepare(records)
    expected, poison = _row_path(mapper, rule, records)
    # lanes > 1: each record the plan routes goes where the row path routes it (its row's key)
    for record, key in zip(records, plan.lane_keys(records), strict=True):
        if key is not UNROUTED and record.offset not in poison:
            assert key == key_bytes(mapper.map(record)[0][rule.key_index[0]]), record
            COMPARED["routed"] += 1
    built = plan.build(records)
    assert built is not None  # no tombstone, the registry answers: never the whole batch declined
    rejected = set(built.rejected)
    assert set(poison) <= rejected, "a poison record was taken by the columnar plan"
    if not rejected <= set(poison):  # a rejected record maps after all: the tier writes the batch by rows
        COMPARED["by rows"] += 1
        return
    COMPARED["columnar"] += 1
    got = {row["id"]: _as_database_would(row) for row in built.table.to_pylist()}
    assert got == {k: _as_row_path_would(v) for k, v in expected.items()}
    # the tier hands each poison record back with the row mapper's own failure
    tier = ColumnarTier("p", plan, lambda table: table, lambda payload, token=None: None, mapper.map)
    items = [Item(r, None, None, 0, 1) for r in records]
    planned = tier.build(items)
    assert planned is not None
    assert {item.record.offset: (f.stage, f.error_class, f.message) for item, f in planned.poison} == poison


@pytest.mark.xdist_group("columnar-avro-differential")  # with its check, on one worker (--dist loadgroup)
def test_the_differential_compared_columnar_batches():
    """Runs after it (file order): the comparison must not have been skipped every time."""
    assert COMPARED["columnar"] >= 30 and COMPARED["routed"] >= 100, COMPARED


def test_a_clean_batch_of_two_writer_schemas_is_taken_whole(parts):
    ids, decoder, mapper, rule, plan = parts
    docs1 = [{"id": i % 4, "n": i, "kind": "NEW", "amount": i / 8, "ts": 1_764_460_800_000 + i, "ratio": 0.5,
              "flag": i % 2 == 0, "note": None if i % 3 else f"n{i}"} for i in range(10)]
    docs2 = [{"id": i % 4, "n": 2**31 + i, "kind": "PAID", "amount": 1.25, "ts": 1_764_460_800_000, "ratio": 1.5,
              "note": "x", "channel": f"c{i}"} for i in range(10, 13)]
    values_ = [_framed(ids["v1"], _datum(V1, d)) for d in docs1] + [_framed(ids["v2"], _datum(V2, d)) for d in docs2]
    values_.insert(5, _framed(ids["v2"], _datum(V2, {**docs2[0], "id": 5, "n": 7, "channel": "web"})))
    records = _records(values_)
    decoder.prepare(records)
    built = plan.build(records)
    assert built is not None
    # the three v2 records with n beyond an integer column are rejected (poison: out of range); the rest taken
    expected, poison = _row_path(mapper, rule, records)
    assert set(built.rejected) == set(poison) == {11, 12, 13}
    got = {row["id"]: _as_database_would(row) for row in built.table.to_pylist()}
    assert got == {k: _as_row_path_would(v) for k, v in expected.items()}
    rows = {row["id"]: row for row in built.table.to_pylist()}
    assert rows[5]["channel"] == "web"  # the v2 record at offset 5
    assert rows[0]["channel"] == "none"  # a v1 record: no such field, the column's default


def test_decimals_and_timestamps_are_taken_as_the_row_mapper_coerces_them(parts):
    ids, decoder, mapper, rule, plan = parts
    docs = [{"id": 1, "n": 2, "amount": Decimal("12.345"), "ts": datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)},
            {"id": 2, "n": 2, "amount": None, "ts": datetime(1970, 1, 1, tzinfo=timezone.utc)},
            {"id": 3, "n": 2, "amount": Decimal("-0.005"), "ts": datetime(1969, 12, 31, 23, 59, 59, 999999,
                                                                          tzinfo=timezone.utc)}]
    records = _records([_framed(ids["logical"], _datum(LOGICAL, d)) for d in docs])
    decoder.prepare(records)
    built = plan.build(records)
    assert built is not None and built.rejected == []
    rows = {row["id"]: row for row in built.table.to_pylist()}
    assert rows[1]["amount"] == "12.345" and rows[3]["amount"] == "-0.005" and rows[2]["amount"] is None
    assert [rows[i]["ts"] for i in (1, 2, 3)] == [1_767_323_045_678_901, 0, -1]
    expected, _ = _row_path(mapper, rule, records)
    assert {row["id"]: _as_database_would(row) for row in rows.values()} == {
        k: _as_row_path_would(v) for k, v in expected.items()}


def test_a_logical_type_the_plan_does_not_stage_sends_the_batch_to_the_row_path(parts):
    ids, decoder, mapper, rule, plan = parts
    doc = {"id": 1, "kind": uuid.uuid4(), "ts": datetime(2026, 1, 2, tzinfo=timezone.utc), "day": date(2026, 2, 28)}
    records = _records([_framed(ids["uuids"], _datum(UUIDS, doc))])
    decoder.prepare(records)
    built = plan.build(records)
    assert built is not None and built.rejected == [0]  # a UUID for a text column: only the row mapper's
    row, _ = mapper.map(records[0])  # ... which maps it: the tier writes the batch by rows
    assert row[COLUMNS_INDEX["kind"]] == str(doc["kind"])
    tier = ColumnarTier("p", plan, lambda table: table, lambda payload, token=None: None, mapper.map)
    assert tier.build([Item(records[0], None, None, 0, 1)]) is None


def test_non_finite_floats_are_left_to_the_row_mapper(parts):
    ids, decoder, mapper, rule, plan = parts
    base = {"id": 1, "n": 1, "kind": "NEW", "amount": 1.0, "ts": 0, "ratio": 0.5, "flag": True, "note": None}
    for field, value in (("amount", math.nan), ("amount", math.inf), ("ratio", -math.inf), ("ratio", math.nan)):
        records = _records([_framed(ids["v1"], _datum(V1, {**base, field: value}))])
        decoder.prepare(records)
        built = plan.build(records)
        assert built is not None and built.rejected == [0], (field, value)


def test_an_avro_pipeline_states_the_columnar_tier_and_why_not_where_it_cannot(registry):
    stand_in, _ = registry
    decoder_of = lambda p: AvroDecoder(p, SchemaRegistrySettings(url=stand_in.url))  # noqa: E731

    class Sink:
        def use_columnar(self, columns):
            pass

    def tier(p, exactly_once=False):  # the pipeline's own row mapper (a ChangeMapper for change events)
        return write_tier(p, Sink(), columnar_capable=True, exactly_once=exactly_once,
                          mapper=lambda: mapper_for(p, decoder=decoder_of(p)))

    assert tier(_pipeline(stand_in.url), exactly_once=True) == "columnar"  # one lane: the lanes' offsets hold

    assert tier(_pipeline(stand_in.url)) == "columnar"
    assert tier(_pipeline(stand_in.url, lanes=2)) == "columnar"  # routed by the decoder's documents' key values
    nested = _pipeline(stand_in.url)
    nested.sink.columns["city"] = nested.sink.columns["note"].model_copy(update={"source": "$.shipping.city"})
    assert tier(nested).startswith("rows (column 'city' reads '$.shipping.city'")
    assert tier(_pipeline(stand_in.url, envelope="debezium")) == "columnar"  # change events (ingest.cdc.columnar)
    assert tier(_pipeline(stand_in.url, envelope="debezium", deletes={"mode": "soft"}, lanes=2)) == "columnar"
    assert tier(_pipeline(stand_in.url, envelope="debezium", transforms=[{"set": {"label": "'x'"}}])) == \
        "rows (a change pipeline's transforms run on the row path)"
    assert tier(_pipeline(stand_in.url, envelope="debezium", dlq={"dsn": "postgresql://u@h/d"}, sink={
        "kind": "clickhouse", "url": "http://h:8123", "table": "t", "order_by": ["id"],
        "columns": {"id": {"type": "Int64"}}})) == "rows (a clickhouse table whose records delete is written by rows)"


def test_a_truncated_datum_is_dead_lettered_with_the_same_message_every_time(parts):
    """fastavro's EOFError names its buffer object by address; the DLQ message must not (the columnar
    tier and the row path, or two runs, decode the same bytes and must say the same)."""
    ids, decoder, mapper, rule, plan = parts
    datum = _datum(V1, {"id": 1, "n": 1, "kind": "NEW", "amount": 1.0, "ts": 0, "ratio": 0.5, "flag": True,
                        "note": None})
    records = _records([_framed(ids["v1"], datum[:5])] * 2)
    decoder.prepare(records)
    messages = set()
    for record in records:
        with pytest.raises(InvalidRecord) as info:
            mapper.map(record)
        messages.add(info.value.message)
    assert len(messages) == 1 and " at 0x" not in messages.pop()


# -- the batch reader (ingest.formats.avro_batch) against fastavro per datum ---------------------------

ALL_TYPES = {"type": "record", "name": "All", "namespace": "t", "fields": [
    {"name": "l", "type": "long"}, {"name": "i", "type": "int"}, {"name": "s", "type": "string"},
    {"name": "b", "type": "bytes"}, {"name": "f", "type": "float"}, {"name": "d", "type": "double"},
    {"name": "t", "type": "boolean"}, {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
    {"name": "n", "type": "null"}, {"name": "o", "type": ["null", "long"]}, {"name": "r", "type": ["string", "null"]},
    {"name": "dec", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 3}},
    {"name": "ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "lus", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "d0", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 0}]},
    {"name": "d6", "type": {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 6}},
    {"name": "mus", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
]}
ALL_PARSED = parse_schema(ALL_TYPES)
all_docs = st.fixed_dictionaries({
    "l": st.integers(min_value=-(2**63), max_value=2**63 - 1), "i": st.integers(min_value=-(2**31), max_value=2**31 - 1),
    "s": st.text(max_size=5), "b": st.binary(max_size=5), "f": st.floats(width=32), "d": st.floats(),
    "t": st.booleans(), "e": st.sampled_from(["A", "B"]), "n": st.none(), "o": st.none() | st.integers(min_value=-(2**40), max_value=2**40),
    "r": st.none() | st.text(max_size=3),
    "dec": st.decimals(min_value=-999999, max_value=999999, places=3, allow_nan=False),
    "ms": st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(timezone.utc))
    .map(lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000)),
    "lus": st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    "day": st.dates(), "u": st.uuids(),
    "d0": st.none() | st.decimals(min_value=-(10**17), max_value=10**17, places=0),
    "d6": st.decimals(min_value=-(10**13), max_value=10**13, places=6, allow_nan=False),
    "mus": st.none() | st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
                                    timezones=st.just(timezone.utc))})


@st.composite
def hostile_datums(draw: st.DrawFn) -> bytes:
    datum = _datum(ALL_TYPES, draw(all_docs))
    how = draw(st.sampled_from(["clean"] * 4 + ["cut", "extra", "flip", "garbage", "overlong"]))
    if how == "clean":
        return datum
    if how == "cut":
        return datum[:draw(st.integers(min_value=0, max_value=len(datum) - 1))]
    if how == "extra":
        return datum + draw(st.binary(min_size=1, max_size=4))
    if how == "flip":
        at = draw(st.integers(min_value=0, max_value=len(datum) - 1))
        return datum[:at] + bytes([draw(st.integers(min_value=0, max_value=255))]) + datum[at + 1:]
    if how == "overlong":  # the first long as an overlong varint (fastavro reads it; the batch reader defers)
        return b"\x80" * draw(st.integers(min_value=1, max_value=9)) + b"\x00" + datum[1:]
    return draw(st.binary(max_size=40))


@pytest.mark.xdist_group("columnar-avro-batch-reader")  # with its check, on one worker (--dist loadgroup)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile_datums(), min_size=1, max_size=12),
       st.none() | st.sets(st.sampled_from([f["name"] for f in ALL_TYPES["fields"]] + ["absent"]), max_size=3),
       st.booleans())
def test_the_batch_reader_gives_fastavros_values_or_leaves_the_datum_to_it(datums, through, staged):
    """Every datum the batch reader does not doubt decodes with fastavro, to exactly its values (types
    included); a datum fastavro refuses is always doubted. Framed as the wire format (offset 5).
    A prefix reader (``through``: lane routing) gives exactly fastavro's values of those fields for
    every datum fastavro decodes and it does not doubt (its values for one fastavro refuses do not
    matter: a poison record's lane). ``staged``: the decimal and the timestamp-millis given as the plan
    stages them (:func:`_staged_as`)."""
    from fastavro import schemaless_reader

    from ingest.formats.avro_batch import compile_batch, read_fields

    reader = compile_batch(ALL_PARSED, through, STAGED if staged else None)
    assert reader is not None
    fields, bad = read_fields(reader, [b"\x00\x00\x00\x00\x01" + d for d in datums], 5)
    if through is not None:
        assert set(fields) == through - {"absent"}
        for j, datum in enumerate(datums):
            buf = io.BytesIO(datum)
            try:
                doc = schemaless_reader(buf, ALL_PARSED, None)
            except Exception:  # noqa: BLE001
                continue
            if buf.tell() == len(datum) and not bad[j]:
                BATCH_READ["prefix"] += 1
                for name in fields:
                    v = _staged_as(name, doc[name]) if staged else doc[name]
                    got = fields[name][j]
                    assert type(got) is type(v) and (got == v or (v != v and got != got)), (name, datum)
        return
    for j, datum in enumerate(datums):
        buf = io.BytesIO(datum)
        try:
            doc = schemaless_reader(buf, ALL_PARSED, None)
            ok = buf.tell() == len(datum)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            assert bad[j], datum
            continue
        if bad[j]:
            BATCH_READ["doubted"] += 1  # allowed (fastavro decides), but should be rare for clean datums
            continue
        BATCH_READ["read"] += 1
        got = {name: values[j] for name, values in fields.items()}
        assert list(got) == list(doc), datum
        for name, v in doc.items():  # equal values of the same types (a NaN: a NaN)
            v = _staged_as(name, v) if staged else v
            assert type(got[name]) is type(v) and (got[name] == v or (v != v and got[name] != got[name])), (name, datum)


BATCH_READ = {"read": 0, "doubted": 0, "prefix": 0}
#: the fields of ALL_TYPES a staged reader gives as the plan stages them
STAGED = {"dec": Digits, "d0": Digits, "d6": Digits, "ms": Micros, "mus": Micros}


def _staged_as(name: str, v: Any) -> Any:
    """What the plan stages of fastavro's value of field ``name``: the row mapper's coercer of a
    ``numeric`` / ``timestamptz`` column keeps it as it is, then :func:`_precoerced` makes it
    :class:`Digits` (its text) or :class:`Micros` (microseconds since the epoch)."""
    if v is None or STAGED.get(name) is None:
        return v
    if STAGED[name] is Digits:
        return Digits(v)
    return Micros((v - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1))


def test_a_staged_reader_doubts_timestamps_fastavro_cannot_make_and_rounds_decimals_as_it_does():
    """At the edges: the first and last millisecond and microsecond a datetime holds are staged, one
    beyond is doubtful (fastavro raises); a decimal of more digits than its precision is doubtful too
    (fastavro's context rounds it, or overflows: fastavro and the row mapper's coercer decide it)."""
    from fastavro import schemaless_reader

    from ingest.formats.avro_batch import compile_batch, read_fields

    schema = parse_schema({"type": "record", "name": "Edge", "fields": [
        {"name": "ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "dec", "type": {"type": "bytes", "logicalType": "decimal", "precision": 3, "scale": 2}},
        {"name": "big", "type": {"type": "bytes", "logicalType": "decimal", "precision": 30, "scale": 6}}]})
    first_us, last_us = -62_135_596_800_000_000, 253_402_300_799_999_999
    # big: 8 bytes and 9 at each end of int64, the precision's edge, and fastavro's rounding beyond it
    cases = [(first_us // 1000, first_us, 999, 2**63 - 1), (last_us // 1000, last_us, -999, -(2**63)),
             (0, 0, 1000, 2**63), (5, 5, -123456, -(2**63) - 1), (1, 1, 7, 10**30 - 1), (2, 2, -7, -(10**30) - 1),
             (first_us // 1000 - 1, 0, 0, 0), (last_us // 1000 + 1, 0, 0, 0), (0, first_us - 1, 0, 0),
             (0, last_us + 1, 0, 0)]
    # every length of two's complement up to 8 bytes, at both ends and next to them
    cases[6:6] = [(0, 0, 0, u) for k in range(1, 9) for u in (-(2 ** (8 * k - 1)), -(2 ** (8 * k - 1)) + 1,
                                                               2 ** (8 * k - 1) - 1, -(2 ** max(8 * k - 9, 0)) - 1)]
    datums = []
    for ms, us, *unscaled in cases:  # written by hand: fastavro's writer refuses the values beyond the edges
        datum = avro_varint(ms) + avro_varint(us)
        for u in unscaled:
            body = u.to_bytes((u.bit_length() + 8) // 8, "big", signed=True) if u else b""
            datum += avro_varint(len(body)) + body
        datums.append(datum)
    reader = compile_batch(schema, None, {"ms": Micros, "us": Micros, "dec": Digits, "big": Digits})
    fields, bad = read_fields(reader, datums, 0)
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    beyond_precision = [not (-(10**3) < c[2] < 10**3 and -(10**30) < c[3] < 10**30) for c in cases]
    for j, datum in enumerate(datums):
        try:
            doc = schemaless_reader(io.BytesIO(datum), schema, None)
        except (OverflowError, ValueError):
            assert bad[j], cases[j]
            continue
        assert bad[j] == beyond_precision[j], cases[j]
        if bad[j]:
            continue
        assert fields["ms"][j] == (doc["ms"] - epoch) // timedelta(microseconds=1) and type(fields["ms"][j]) is Micros
        assert fields["us"][j] == (doc["us"] - epoch) // timedelta(microseconds=1)
        assert fields["dec"][j] == str(doc["dec"]) and type(fields["dec"][j]) is Digits
        assert fields["big"][j] == str(doc["big"]) and type(fields["big"][j]) is Digits
    assert bad == [b or j >= len(cases) - 4 for j, b in enumerate(beyond_precision)]
    assert beyond_precision.count(True) == 3  # dec 1000 and -123456, big -(10**30) - 1


@pytest.mark.xdist_group("columnar-avro-batch-reader")  # with its check, on one worker (--dist loadgroup)
def test_the_batch_reader_read_most_clean_datums_itself():
    assert BATCH_READ["read"] >= 150 and BATCH_READ["doubted"] <= BATCH_READ["read"] // 5, BATCH_READ
    assert BATCH_READ["prefix"] >= 150, BATCH_READ


def test_the_plan_reads_clean_batches_with_the_batch_reader(parts, monkeypatch):
    ids, decoder, mapper, rule, plan = parts
    docs = [{"id": i % 4, "n": i, "kind": "NEW", "amount": i / 8, "ts": i, "ratio": 0.5, "flag": True, "note": None}
            for i in range(20)]
    records = _records([_framed(ids["v1"], _datum(V1, d)) for d in docs]
                       + [_framed(ids["logical"], _datum(LOGICAL, {"id": 9, "n": 1, "amount": Decimal("1.5"),
                                                                   "ts": datetime(2026, 1, 1, tzinfo=timezone.utc)}))])
    decoder.prepare(records)
    calls = []
    monkeypatch.setattr(decoder, "decode", lambda record: calls.append(record) or AvroDecoder.decode(decoder, record))
    built = plan.build(records)
    assert built is not None and built.rejected == [] and calls == []  # no record decoded one by one
    expected, _ = _row_path(mapper, rule, records)
    assert {row["id"]: _as_database_would(row) for row in built.table.to_pylist()} == {
        k: _as_row_path_would(v) for k, v in expected.items()}
