"""The type map (ingest.mirror.types) and table shapes from schemas (ingest.mirror.shape).

Besides the expected columns, each format is checked end to end against the repo's own decoders and
column coercers: a record decoded the way the pipeline decodes it gives, for every column of the shape,
a value that column's coercer takes (the type map's rule: the column holds the value as delivered).
"""

from __future__ import annotations

import io
import json
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.cdc.debezium import unwrap, unwrap_key
from ingest.core.avro_schema import parse_avro_text
from ingest.core.dialects import ch_type, pg_base_type
from ingest.core.mapping.coerce_ch import _ch_coercer
from ingest.core.mapping.coerce_pg import _coercer_for
from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.names import CLICKHOUSE, POSTGRES
from ingest.mirror.shape import (
    Column,
    FieldType,
    Shape,
    build_shape,
    shape_from_avro,
    shape_from_connect,
    shape_from_json_schema,
    shape_from_protobuf,
    union,
)
from ingest.mirror.types import SIMPLE_KINDS, Logical, column_type, normalize_type, split_nullable

UTC = timezone.utc
DIALECTS = (POSTGRES, CLICKHOUSE)


def coerce(shape: Shape, column: Column, value: Any) -> Any:
    """The repo's coercer for ``column`` applied to ``value`` (None stays None where the column allows it)."""
    if value is None:
        assert column.nullable or column.default is not None, f"{column.name}: null into a NOT NULL column"
        return None
    if shape.dialect == POSTGRES:
        return _coercer_for(pg_base_type(column.type)[0])(value)
    return _ch_coercer(ch_type(shape.ddl_type(column)))(value)


def all_accepted(shape: Shape, row: dict[str, Any]) -> None:
    for column in shape.columns:
        coerce(shape, column, row.get(column.name))


# --------------------------------------------------------------------------- the map itself

_LOGICALS = st.deferred(lambda: st.one_of(
    st.sampled_from(sorted(SIMPLE_KINDS)).map(Logical),
    st.builds(lambda p, s: Logical("decimal", p, min(s, p)), st.integers(1, 1200), st.integers(0, 80)),
    st.builds(lambda s: Logical("decimal", None, s), st.integers(0, 80)),
    st.just(Logical("decimal")),
    st.builds(Logical, st.sampled_from(["timestamptz", "timestamp"]), st.integers(0, 9)),
    st.builds(lambda i, n: Logical("array", item=i, item_nullable=n), _LOGICALS, st.booleans()),
))


@given(_LOGICALS, st.sampled_from(DIALECTS), st.booleans())
def test_every_rendered_type_parses_in_the_repos_dialects_and_is_canonical(logical, dialect, nullable) -> None:
    t = column_type(logical, dialect)
    if dialect == POSTGRES:
        pg_base_type(t)
    else:
        ch_type(t)
        shape = Shape(CLICKHOUSE, (Column("c", t, nullable and not t.startswith("Array(")),))
        ch_type(shape.ddl_type(shape.columns[0]))
        assert split_nullable(shape.ddl_type(shape.columns[0]))[0] == t
    assert normalize_type(t, dialect) == (t if dialect == POSTGRES else ch_type(t).ddl)
    assert normalize_type(normalize_type(t, dialect), dialect) == normalize_type(t, dialect)


@pytest.mark.parametrize(("logical", "pg", "ch"), [
    (Logical("boolean"), "boolean", "Bool"),
    (Logical("int8"), "smallint", "Int8"),
    (Logical("int16"), "smallint", "Int16"),
    (Logical("int32"), "integer", "Int32"),
    (Logical("int64"), "bigint", "Int64"),
    (Logical("uint32"), "bigint", "UInt32"),
    (Logical("uint64"), "numeric(20,0)", "UInt64"),
    (Logical("float32"), "real", "Float32"),
    (Logical("float64"), "double precision", "Float64"),
    (Logical("decimal", 12, 2), "numeric(12,2)", "Decimal(12, 2)"),
    (Logical("decimal", 100, 2), "numeric(100,2)", "String"),
    (Logical("decimal", 2000, 2), "numeric", "String"),
    (Logical("decimal", None, 4), "numeric", "Decimal(38, 4)"),
    (Logical("decimal"), "numeric", "String"),
    (Logical("string"), "text", "String"),
    (Logical("enum"), "text", "String"),
    (Logical("bytes"), "bytea", "String"),
    (Logical("uuid"), "uuid", "UUID"),
    (Logical("date"), "date", "Date"),
    (Logical("time"), "time", "String"),
    (Logical("timestamptz", 3), "timestamptz", "DateTime64(3)"),
    (Logical("timestamp", 6), "timestamp", "DateTime64(6)"),
    (Logical("interval"), "interval", "String"),
    (Logical("json"), "jsonb", "String"),
    (Logical("array", item=Logical("int32"), item_nullable=True), "jsonb", "Array(Nullable(Int32))"),
    (Logical("array", item=Logical("array", item=Logical("string"))), "jsonb", "Array(Array(String))"),
    (Logical("array", item=Logical("json"), item_nullable=True), "jsonb", "Array(Nullable(String))"),
])
def test_the_documented_table(logical, pg, ch) -> None:
    assert column_type(logical, POSTGRES) == pg
    assert normalize_type(column_type(logical, CLICKHOUSE), CLICKHOUSE) == ch  # JSON is stored as String


# A value of each logical type as ingest's decoders deliver it (fastavro, protobuf's converter,
# orjson, ingest.cdc.debezium), and the columns that must take it.
_DELIVERED = [
    (Logical("boolean"), True), (Logical("int8"), -5), (Logical("int16"), 300), (Logical("int32"), 70000),
    (Logical("int64"), 2**40), (Logical("uint32"), 2**32 - 1), (Logical("uint64"), 2**64 - 1),
    (Logical("float32"), 1.5), (Logical("float64"), 2.5), (Logical("decimal", 12, 2), Decimal("1234.56")),
    (Logical("decimal"), Decimal("1.234567890123")), (Logical("decimal", None, 3), Decimal("-1.250")),
    (Logical("string"), "x"), (Logical("enum"), "RED"), (Logical("bytes"), b"abc"),
    (Logical("uuid"), UUID(int=7)), (Logical("uuid"), "00000000-0000-0000-0000-000000000007"),
    (Logical("date"), date(2024, 1, 2)), (Logical("time"), time(12, 30, 1, 500)),
    (Logical("timestamptz", 6), datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=UTC)),
    (Logical("timestamptz", 6), "2024-01-02T03:04:05.000006Z"),
    (Logical("timestamp", 3), datetime(2024, 1, 2, 3, 4, 5, 6000, tzinfo=UTC)),
    (Logical("timestamp", 6), datetime(2024, 1, 2, 3, 4, 5, 6)),
    (Logical("interval"), timedelta(seconds=5)), (Logical("json"), {"a": [1, Decimal("1.5"), None]}),
    (Logical("array", item=Logical("int32"), item_nullable=True), [1, None, 3]),
    (Logical("array", item=Logical("string")), ["a", "b"]),
]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(("logical", "value"), _DELIVERED, ids=lambda v: repr(v)[:40])
def test_each_column_takes_the_value_as_the_decoders_deliver_it(dialect, logical, value) -> None:
    shape = build_shape([FieldType("c", logical, False)], dialect)
    coerce(shape, shape.columns[0], value)


# --------------------------------------------------------------------------- Avro

AVRO_ROW = {
    "type": "record", "name": "Row", "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "flag", "type": "boolean"},
        {"name": "small", "type": "int"},
        {"name": "ratio", "type": "float"},
        {"name": "score", "type": ["null", "double"], "default": None},
        {"name": "blob", "type": "bytes"},
        {"name": "name", "type": ["null", "string"]},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
        {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "at_ms", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "time-micros"}},
        {"name": "ts_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "ts_us", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
        {"name": "local_ts", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
        {"name": "state", "type": {"type": "enum", "name": "State", "symbols": ["NEW", "PAID"]}},
        {"name": "state2", "type": "State"},
        {"name": "hash", "type": {"type": "fixed", "name": "Hash", "size": 4}},
        {"name": "price", "type": {"type": "fixed", "name": "Price", "size": 8, "logicalType": "decimal",
                                   "precision": 10, "scale": 3}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "scores", "type": {"type": "array", "items": ["null", "int"]}},
        {"name": "attrs", "type": {"type": "map", "values": "long"}},
        {"name": "address", "type": ["null", {"type": "record", "name": "Address",
                                              "fields": [{"name": "city", "type": "string"},
                                                         {"name": "next", "type": ["null", "Address"]}]}]},
        {"name": "either", "type": ["null", "int", "string"]},
        {"name": "micros_ts", "type": {"type": "long", "connect.name": "io.debezium.time.MicroTimestamp"}},
    ],
}
AVRO_PG = {
    "id": ("bigint", False), "flag": ("boolean", False), "small": ("integer", False), "ratio": ("real", False),
    "score": ("double precision", True), "blob": ("bytea", False), "name": ("text", True),
    "amount": ("numeric(12,2)", False), "uid": ("uuid", False), "day": ("date", False), "at_ms": ("time", False),
    "at_us": ("time", False), "ts_ms": ("timestamptz", False), "ts_us": ("timestamptz", True),
    "local_ts": ("timestamp", False), "state": ("text", False), "state2": ("text", False),
    "hash": ("bytea", False), "price": ("numeric(10,3)", False), "tags": ("jsonb", False),
    "scores": ("jsonb", False), "attrs": ("jsonb", False), "address": ("jsonb", True), "either": ("jsonb", True),
    "micros_ts": ("bigint", False),  # connect.name is not used: the value arrives as a plain long
}
AVRO_CH = {
    "id": ("Int64", False), "ts_ms": ("DateTime64(3)", False), "ts_us": ("DateTime64(6)", True),
    "tags": ("Array(String)", False), "scores": ("Array(Nullable(Int32))", False), "at_us": ("String", False),
    "price": ("Decimal(10, 3)", False), "address": ("JSON", True), "either": ("JSON", True),
}


def _cols(shape: Shape) -> dict[str, tuple[str, bool]]:
    return {c.name: (c.type, c.nullable) for c in shape.columns}


@pytest.mark.parametrize("parsed", [False, True], ids=["json", "fastavro-parsed"])
def test_avro_record_fields_become_columns(parsed) -> None:
    schema = parse_avro_text(json.dumps(AVRO_ROW)) if parsed else json.dumps(AVRO_ROW)
    pg = shape_from_avro(schema, POSTGRES, key_schema={"type": "record", "name": "K", "fields": [
        {"name": "id", "type": "long"}]})
    assert _cols(pg) == AVRO_PG and pg.key == ("id",) and pg.names == tuple(AVRO_PG)
    ch = _cols(shape_from_avro(schema, CLICKHOUSE))
    assert {k: ch[k] for k in AVRO_CH} == AVRO_CH


def _avro_record() -> dict[str, Any]:
    return {
        "id": 7, "flag": True, "small": 3, "ratio": 0.5, "score": None, "blob": b"\x00\x01", "name": "n",
        "amount": Decimal("12.34"), "uid": "00000000-0000-0000-0000-000000000001", "day": date(2024, 2, 29),
        "at_ms": time(1, 2, 3, 4000), "at_us": time(1, 2, 3, 4), "ts_ms": datetime(2024, 1, 1, tzinfo=UTC),
        "ts_us": datetime(2024, 1, 1, 0, 0, 0, 1, tzinfo=UTC), "local_ts": datetime(2024, 1, 1, 1),
        "state": "PAID", "state2": "NEW", "hash": b"abcd", "price": Decimal("1.5"), "tags": ["a"],
        "scores": [1, None], "attrs": {"k": 1}, "address": {"city": "Rome", "next": None}, "either": "x",
        "micros_ts": 1_700_000_000_000_000,
    }


@pytest.mark.parametrize("dialect", DIALECTS)
def test_an_avro_record_decoded_by_fastavro_fits_its_columns(dialect) -> None:
    from fastavro import schemaless_reader, schemaless_writer

    parsed = parse_avro_text(json.dumps(AVRO_ROW))
    buf = io.BytesIO()
    schemaless_writer(buf, parsed, _avro_record())
    decoded = schemaless_reader(io.BytesIO(buf.getvalue()), parsed, None)
    shape = shape_from_avro(parsed, dialect)
    if dialect == CLICKHOUSE:
        decoded["blob"] = b"ok"  # ClickHouse String takes UTF-8 bytes only (see the type map)
    all_accepted(shape, decoded)


def test_a_debezium_avro_envelope_gives_the_after_record() -> None:
    value = {"type": "record", "name": "Value", "namespace": "db.public.items",
             "fields": [{"name": "id", "type": "int"}, {"name": "name", "type": ["null", "string"]}]}
    envelope = {"type": "record", "name": "Envelope", "namespace": "db.public.items", "fields": [
        {"name": "before", "type": ["null", value]}, {"name": "after", "type": ["null", "Value"]},
        {"name": "op", "type": "string"}]}
    shape = shape_from_avro(envelope, POSTGRES, envelope=True)
    assert _cols(shape) == {"id": ("integer", False), "name": ("text", True)}
    with pytest.raises(SchemaIncompatible):
        shape_from_avro({"type": "record", "name": "E", "fields": [{"name": "op", "type": "string"}]},
                        POSTGRES, envelope=True)
    with pytest.raises(SchemaIncompatible):
        shape_from_avro("string", POSTGRES)


# --------------------------------------------------------------------------- Protobuf


def test_protobuf_fields_become_columns_and_the_converted_message_fits() -> None:
    from harness.proto_messages import classes

    from ingest.formats.protobuf import converter

    order_cls, _ = classes()
    descriptor = order_cls.DESCRIPTOR
    pg = shape_from_protobuf(descriptor, POSTGRES)
    assert _cols(pg) == {
        "id": ("bigint", False), "status": ("text", False), "active": ("boolean", False),
        "score": ("double precision", False), "ratio": ("real", False), "blob": ("bytea", False),
        "state": ("text", False), "at": ("timestamptz", True), "wait": ("interval", True),
        "maybe": ("bigint", True), "note": ("text", True), "address": ("jsonb", True), "tags": ("jsonb", False),
        "attrs": ("jsonb", False), "nickname": ("text", True), "big": ("numeric(20,0)", False),
        "small": ("integer", False), "extra": ("jsonb", True), "lines": ("jsonb", False),
    }
    ch = _cols(shape_from_protobuf(descriptor, CLICKHOUSE))
    assert ch["tags"] == ("Array(String)", False) and ch["big"] == ("UInt64", False)
    assert ch["lines"] == ("Array(JSON)", False) and ch["at"] == ("DateTime64(6)", True)
    assert ch["attrs"] == ("JSON", False) and ch["wait"] == ("JSON", True)  # a Duration: its seconds
    m = order_cls(id=1, status="s", active=True, score=1.5, ratio=0.25, blob=b"b", state=1, tags=["x"],
                  big=2**64 - 1, small=-3)
    m.at.seconds, m.at.nanos = 1_700_000_000, 5000
    m.wait.seconds = 3
    m.maybe.value = 5
    m.attrs["k"] = 1
    m.lines.add(sku="a", qty=2)
    m.extra.update({"a": 1})
    row = converter(descriptor)(m)
    for dialect in DIALECTS:
        all_accepted(shape_from_protobuf(descriptor, dialect, key_descriptor=None), row)


# --------------------------------------------------------------------------- JSON Schema

JSON_SCHEMA = {
    "type": "object", "required": ["id", "at"],
    "$defs": {"money": {"type": "number"}},
    "properties": {
        "id": {"type": "integer"}, "small": {"type": "integer", "connect.type": "int16"},
        "price": {"$ref": "#/$defs/money"}, "f32": {"type": "number", "connect.type": "float32"},
        "name": {"type": ["string", "null"]}, "at": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"}, "clock": {"type": "string", "format": "time"},
        "uid": {"type": "string", "format": "uuid"}, "raw": {"type": "string", "contentEncoding": "base64"},
        "ok": {"type": "boolean"}, "meta": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "any": {}, "color": {"enum": ["red", "blue"]}, "maybe": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
        "mixed": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    },
}


def test_json_schema_properties_become_columns() -> None:
    pg = shape_from_json_schema(json.dumps(JSON_SCHEMA), POSTGRES, key_schema={"type": "object", "properties": {
        "id": {"type": "integer"}}})
    assert _cols(pg) == {
        "id": ("bigint", False), "small": ("smallint", True), "price": ("double precision", True),
        "f32": ("real", True), "name": ("text", True), "at": ("timestamptz", False), "day": ("date", True),
        "clock": ("time", True), "uid": ("uuid", True), "raw": ("bytea", True), "ok": ("boolean", True),
        "meta": ("jsonb", True), "tags": ("jsonb", True), "any": ("jsonb", True), "color": ("text", True),
        "maybe": ("bigint", True), "mixed": ("jsonb", True),
    }
    assert pg.key == ("id",)
    ch = shape_from_json_schema(JSON_SCHEMA, CLICKHOUSE, key_schema={"type": "string"})  # a scalar key: no key
    assert ch.key == () and _cols(ch)["tags"] == ("Array(String)", False) and ch.column("tags").default == "[]"
    row = orjson.loads(b'{"id": 1, "small": 2, "price": 1.5, "f32": 0.5, "name": null, "at": "2024-01-01T00:00:00Z",'
                       b'"day": "2024-01-02", "clock": "10:11:12", "uid": "00000000-0000-0000-0000-000000000003",'
                       b'"raw": "AAE=", "ok": true, "meta": {"a": 1}, "tags": ["t"], "any": [1], "color": "red",'
                       b'"maybe": 3, "mixed": "m"}')
    all_accepted(pg, row)
    all_accepted(ch, {**row, "raw": "AAE="})


# --------------------------------------------------------------------------- Kafka Connect / Debezium JSON


def test_debezium_json_with_schemas_gives_the_after_struct_and_the_key() -> None:
    from harness.debezium import Field, encode_event, encode_key

    fields = [Field("id", "int64", optional=False), Field("name", "string"), Field("price", "decimal(12,2)"),
              Field("amount", "variable_decimal"), Field("created", "micro_timestamp"),
              Field("legacy", "timestamp_ms"), Field("day", "date"), Field("changed", "zoned_timestamp"),
              Field("clock", "micro_time"), Field("ok", "boolean"), Field("score", "float64")]
    after = {"id": 5, "name": "x", "price": Decimal("9.99"), "amount": Decimal("1.000001"),
             "created": datetime(2024, 1, 1, 1, 2, 3, 4), "legacy": datetime(2024, 1, 1), "day": date(2024, 3, 1),
             "changed": datetime(2024, 1, 1, tzinfo=UTC), "clock": time(23, 59), "ok": False, "score": 0.5}
    value = orjson.loads(encode_event("c", None, after, fields=fields, lsn=1, ts_ms=1, schemas=True))
    key = orjson.loads(encode_key({"id": 5}, fields=[Field("id", "int64", optional=False)], schemas=True))
    pg = shape_from_connect(value["schema"], POSTGRES, key_schema=key["schema"])
    assert _cols(pg) == {
        "id": ("bigint", False), "name": ("text", True), "price": ("numeric(12,2)", True),
        "amount": ("numeric", True), "created": ("timestamp", True), "legacy": ("timestamp", True),
        "day": ("date", True), "changed": ("timestamptz", True), "clock": ("time", True), "ok": ("boolean", True),
        "score": ("double precision", True),
    }
    assert pg.key == ("id",)
    ch = shape_from_connect(value["schema"], CLICKHOUSE, key_schema=key["schema"])
    assert _cols(ch)["amount"] == ("String", True) and _cols(ch)["created"] == ("DateTime64(6)", True)
    change = unwrap(value)
    assert unwrap_key(key) == {"id": 5}
    all_accepted(pg, change.after)
    all_accepted(ch, change.after)


CONNECT_SEMANTIC = [
    ({"type": "int32", "name": "io.debezium.time.Date"}, "date", "Date"),
    ({"type": "int32", "name": "org.apache.kafka.connect.data.Date"}, "date", "Date"),
    ({"type": "int32", "name": "io.debezium.time.Time"}, "time", "String"),
    ({"type": "int32", "name": "org.apache.kafka.connect.data.Time"}, "time", "String"),
    ({"type": "int64", "name": "io.debezium.time.MicroTime"}, "time", "String"),
    ({"type": "int64", "name": "io.debezium.time.NanoTime"}, "bigint", "Int64"),
    ({"type": "int64", "name": "io.debezium.time.Timestamp"}, "timestamp", "DateTime64(3)"),
    ({"type": "int64", "name": "org.apache.kafka.connect.data.Timestamp"}, "timestamp", "DateTime64(3)"),
    ({"type": "int64", "name": "io.debezium.time.MicroTimestamp"}, "timestamp", "DateTime64(6)"),
    ({"type": "int64", "name": "io.debezium.time.NanoTimestamp"}, "timestamp", "DateTime64(6)"),
    ({"type": "string", "name": "io.debezium.time.ZonedTimestamp"}, "timestamptz", "DateTime64(6)"),
    ({"type": "string", "name": "io.debezium.time.ZonedTime"}, "text", "String"),
    ({"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "3"}},
     "numeric", "Decimal(38, 3)"),
    ({"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
      "parameters": {"scale": "3", "connect.decimal.precision": "9"}}, "numeric(9,3)", "Decimal(9, 3)"),
    ({"type": "struct", "name": "io.debezium.data.VariableScaleDecimal", "fields": []}, "numeric", "String"),
    ({"type": "string", "name": "io.debezium.data.Json"}, "text", "String"),
    ({"type": "string", "name": "io.debezium.data.Uuid"}, "uuid", "UUID"),
    ({"type": "string", "name": "io.debezium.data.Enum"}, "text", "String"),
    ({"type": "string", "name": "io.debezium.data.EnumSet"}, "text", "String"),
    ({"type": "bytes", "name": "io.debezium.data.Bits"}, "bytea", "String"),
    ({"type": "double", "name": "io.debezium.time.Interval"} | {"type": "float64"}, "double precision", "Float64"),
    ({"type": "string", "name": "io.debezium.time.Interval"}, "text", "String"),
    ({"type": "int32", "name": "io.debezium.time.Year"}, "integer", "Int32"),
    ({"type": "struct", "name": "io.debezium.data.geometry.Point", "fields": []}, "jsonb", "String"),
    ({"type": "struct", "name": "io.debezium.data.geometry.Geometry", "fields": []}, "jsonb", "String"),
    ({"type": "int8"}, "smallint", "Int8"), ({"type": "int16"}, "smallint", "Int16"),
    ({"type": "float32"}, "real", "Float32"), ({"type": "bytes"}, "bytea", "String"),
    ({"type": "map", "keys": {"type": "string"}, "values": {"type": "int32"}}, "jsonb", "String"),
    ({"type": "struct", "fields": []}, "jsonb", "String"),
    ({"type": "array", "items": {"type": "int64", "optional": True}}, "jsonb", "Array(Nullable(Int64))"),
    ({"type": "array", "items": {"type": "int32", "name": "io.debezium.time.Date"}}, "jsonb", "Array(Date)"),
]


@pytest.mark.parametrize(("schema", "pg", "ch"), CONNECT_SEMANTIC, ids=lambda v: str(v)[:60])
def test_kafka_connect_types_and_debeziums_semantic_names(schema, pg, ch) -> None:
    struct = {"type": "struct", "fields": [{**schema, "field": "c", "optional": False}]}
    assert shape_from_connect(struct, POSTGRES, envelope=False).columns[0].type == pg
    got = shape_from_connect(struct, CLICKHOUSE, envelope=False).columns[0].type
    assert normalize_type(got, CLICKHOUSE) == normalize_type(ch, CLICKHOUSE)


def test_an_unknown_connect_type_is_schema_incompatible() -> None:
    with pytest.raises(SchemaIncompatible) as err:
        shape_from_connect({"type": "struct", "fields": [{"type": "int128", "field": "x"}]}, POSTGRES, envelope=False)
    assert err.value.reason == "unsupported_schema"
    with pytest.raises(SchemaIncompatible):
        shape_from_connect({"type": "struct", "fields": []}, POSTGRES)  # no 'after'


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("dialect", DIALECTS)
def test_key_columns_are_never_nullable_and_a_key_only_field_comes_first(dialect) -> None:
    value = [FieldType("id", Logical("int64"), True), FieldType("v", Logical("string"), True)]
    key = [FieldType("tenant", Logical("string"), False), FieldType("id", Logical("int64"), False)]
    shape = build_shape(value, dialect, key_fields=key)
    assert shape.names == ("tenant", "id", "v")
    assert shape.key == ("tenant", "id")
    assert not shape.column("id").nullable and shape.column("tenant").from_key
    assert shape.column("v").nullable
    assert build_shape(value, dialect).key == ()


def test_hostile_and_reserved_field_names() -> None:
    shape = build_shape([FieldType('we"ird `name` é', Logical("string"), True)], POSTGRES)
    assert shape.names == ('we"ird `name` é',)
    for bad in ("_ingest_deleted", "a" * 64, "x\x00"):
        with pytest.raises(SchemaIncompatible) as err:
            build_shape([FieldType(bad, Logical("string"), True)], POSTGRES)
        assert err.value.reason == "bad_column_name"
    with pytest.raises(SchemaIncompatible):
        build_shape([FieldType("_version", Logical("int64"), True)], CLICKHOUSE, reserved_columns=["_version"])


# --------------------------------------------------------------------------- union


def _shape(dialect: str, key: tuple[str, ...] = ("id",), **cols: tuple[str, bool]) -> Shape:
    return Shape(dialect, tuple(Column(n, t, nl) for n, (t, nl) in cols.items()), key)


def test_union_takes_every_column_the_wider_type_and_null_where_a_schema_lacks_it() -> None:
    v1 = _shape(POSTGRES, id=("bigint", False), qty=("integer", False), note=("text", True))
    v2 = _shape(POSTGRES, id=("bigint", False), qty=("bigint", False), added=("numeric(10,2)", False))
    u = union([v1, v2])
    assert _cols(u) == {"id": ("bigint", False), "qty": ("bigint", False), "note": ("text", True),
                        "added": ("numeric(10,2)", True)}
    assert u.key == ("id",)
    assert union([v2, v1]).names == ("id", "qty", "added", "note")  # order of first appearance
    assert union([v1]) == v1


def test_union_refuses_types_that_cannot_share_a_column_and_different_keys() -> None:
    with pytest.raises(SchemaIncompatible) as err:
        union([_shape(POSTGRES, id=("bigint", False), x=("text", True)),
               _shape(POSTGRES, id=("bigint", False), x=("bigint", True))])
    assert err.value.reason == "batch_types_differ"
    with pytest.raises(SchemaIncompatible) as err:
        union([_shape(POSTGRES, id=("bigint", False), t=("text", False)),
               _shape(POSTGRES, key=("id", "t"), id=("bigint", False), t=("text", False))])
    assert err.value.reason == "key_changed"


def test_a_clickhouse_array_some_schema_lacks_gets_an_empty_default_not_nullable() -> None:
    u = union([_shape(CLICKHOUSE, id=("Int64", False), a=("Array(Int32)", False)),
               _shape(CLICKHOUSE, id=("Int64", False))])
    assert u.column("a") == Column("a", "Array(Int32)", False, "[]")


_PG_TYPES = st.sampled_from(["smallint", "integer", "bigint", "real", "double precision", "text", "numeric(10,2)",
                             "numeric(12,2)", "numeric"])


@st.composite
def _shapes(draw: Any) -> Shape:
    names = draw(st.lists(st.sampled_from("abcdef"), unique=True, max_size=5))
    return Shape(POSTGRES, (Column("id", "bigint", False),) + tuple(
        Column(n, draw(_PG_TYPES), draw(st.booleans())) for n in names), ("id",))


@given(st.lists(_shapes(), min_size=1, max_size=4))
def test_the_union_holds_every_shape_of_the_batch(shapes) -> None:
    """Property: whatever the order, the union (when there is one) has every column of every shape,
    each of a type that holds the shape's type, nullable unless every shape has it NOT NULL."""
    from ingest.mirror.types import accepts

    try:
        u = union(shapes)
    except SchemaIncompatible:
        return
    assert set(u.names) == set(union(list(reversed(shapes))).names)
    for s in shapes:
        for c in s.columns:
            assert accepts(u.column(c.name).type, c.type, POSTGRES)
            assert u.column(c.name).nullable or not c.nullable
    for c in u.columns:
        if not c.nullable:
            assert all(s.column(c.name) is not None and not s.column(c.name).nullable for s in shapes)
