"""Unit tests for the ClickHouse dialect of ingest.core.mapping and the ClickHouse sink config.

What reaches clickhouse-connect must be a value its Native encoder writes
exactly: it raises a bare ``struct.error`` for an out-of-range integer or Date
and silently wraps an oversized Decimal, so the mapper range-checks first and
such records become ``map`` failures (DLQ) instead.
"""

from __future__ import annotations

import uuid
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ingest.config import ColumnSpec, PipelineSettings, load_settings
from ingest.core.dialects import CH_INT_RANGES, ch_type
from ingest.core.mapping import Mapper
from ingest.errors import ConfigError, InvalidRecord
from ingest.sinks.clickhouse.settings import ClickHouseColumnSpec
from ingest.sinks.clickhouse.settings import ClickHouseSinkSettings as ClickHouseSink
from ingest.types import Record

UTC = timezone.utc


def rec(value: Any, *, offset: int = 17, key: bytes | None = b"k") -> Record:
    return Record("orders", 3, offset, key, orjson.dumps(value), 1_700_000_000_000)


def col(type_: str, **kw: Any) -> Mapper:
    return Mapper({"c": ClickHouseColumnSpec(type=type_, **kw)})


def one(type_: str, value: Any, **kw: Any) -> Any:
    row, _ = col(type_, **kw).map(rec({"c": value}))
    return row[0]


def fail(type_: str, value: Any, **kw: Any) -> InvalidRecord:
    with pytest.raises(InvalidRecord) as info:
        col(type_, **kw).map(rec({"c": value}))
    return info.value


# --------------------------------------------------------------------------- integers


@pytest.mark.parametrize("name", sorted(CH_INT_RANGES))
def test_int_bounds_are_exact(name: str) -> None:
    lo, hi = CH_INT_RANGES[name]
    assert one(name, lo) == lo and one(name, hi) == hi
    assert one(name, str(hi)) == hi and one(name, str(lo)) == lo
    for outside in (lo - 1, hi + 1):
        err = fail(name, str(outside))
        assert (err.stage, err.error_class) == ("map", "out_of_range"), err
        assert name in err.message and "column 'c'" in err.message


def test_uint64_max_as_json_number_and_float() -> None:
    assert one("UInt64", 2**64 - 1) == 2**64 - 1  # orjson parses it as an int
    assert one("UInt64", 1.8e19) == 18_000_000_000_000_000_000
    assert fail("UInt64", 1.9e19).error_class == "out_of_range"
    assert fail("UInt64", -1).error_class == "out_of_range"
    assert fail("UInt8", 256).error_class == "out_of_range"


@given(st.sampled_from(sorted(CH_INT_RANGES)), st.integers(min_value=-(2**65), max_value=2**65))
def test_int_accepts_exactly_its_range(name: str, n: int) -> None:
    lo, hi = CH_INT_RANGES[name]
    mapper = col(name)
    if lo <= n <= hi:
        assert mapper.map(rec({"c": str(n)}))[0] == (n,)
    else:
        with pytest.raises(InvalidRecord, match="out of range"):
            mapper.map(rec({"c": str(n)}))


@pytest.mark.parametrize(("value", "error_class"), [
    (1.5, "invalid_value"), ("abc", "invalid_value"), ("1e3", "invalid_value"),
    ([1], "wrong_type"), ({"a": 1}, "wrong_type"), (True, "wrong_type"),
])
def test_int_rejects_non_integers(value: Any, error_class: str) -> None:
    assert fail("Int32", value).error_class == error_class


# --------------------------------------------------------------------------- floats, decimals


def test_floats() -> None:
    assert one("Float64", 1.5) == 1.5 and one("Float32", "2.5") == 2.5 and one("Float64", 3) == 3.0
    assert fail("Float32", 1e39).error_class == "out_of_range"
    assert one("Float64", 1e39) == 1e39
    assert fail("Float64", "nan").error_class == "invalid_value"
    assert fail("Float64", "x").error_class == "invalid_value"


def test_decimal_rounds_to_scale_half_away_from_zero() -> None:
    assert one("Decimal(12, 2)", "1.005") == Decimal("1.01")
    assert one("Decimal(12,2)", -1.005) == Decimal("-1.01")  # repr(float) -> '-1.005'
    assert one("Decimal(12,2)", 7) == Decimal("7.00")
    assert one("Decimal(5)", "12345.4") == Decimal("12345")


@pytest.mark.parametrize("value", ["10000000000", "9999999999.995", "-10000000000.00", "1e11", 1e300])
def test_decimal_out_of_range(value: Any) -> None:
    # Decimal(12, 2) holds 10 digits before the point; clickhouse-connect would wrap silently.
    err = fail("Decimal(12, 2)", value)
    assert err.error_class == "out_of_range" and "Decimal(12, 2)" in err.message


def test_wide_decimal_keeps_every_digit() -> None:
    text = "-123456789012345678901234567890.0123456789"
    assert one("Decimal(40, 10)", text) == Decimal(text)
    assert one("Decimal(76, 0)", "9" * 76) == Decimal("9" * 76)
    assert fail("Decimal(76, 0)", "1" + "0" * 76).error_class == "out_of_range"


def test_decimal_rejects_non_numbers() -> None:
    assert fail("Decimal(10, 2)", "abc").error_class == "invalid_value"
    assert fail("Decimal(10, 2)", [1]).error_class == "wrong_type"


# --------------------------------------------------------------------------- strings, JSON


def test_strings_keep_nul_and_render_scalars() -> None:
    assert one("String", "a\x00b") == "a\x00b"  # ClickHouse String holds any bytes
    assert one("String", 12) == "12" and one("String", True) == "true"
    assert one("LowCardinality(String)", "eu") == "eu"
    assert fail("String", {"a": 1}).error_class == "wrong_type"


def test_json_as_string() -> None:
    assert one("JSON", {"b": [1, 2], "a": None}) == '{"b":[1,2],"a":null}'
    assert one("JSON", "text") == '"text"'
    assert one("Nullable(JSON)", 5) == "5"
    assert ch_type("JSON").ddl == "String" and ch_type("Array(JSON)").ddl == "Array(String)"


# --------------------------------------------------------------------------- Bool, Date, DateTime64, UUID


def test_bool() -> None:
    assert one("Bool", True) is True and one("Bool", "false") is False and one("Bool", 1) is True
    assert fail("Bool", "maybe").error_class == "invalid_value"
    assert fail("Bool", 2).error_class == "invalid_value"


def test_date_range() -> None:
    assert one("Date", "2149-06-06") == date(2149, 6, 6)
    assert one("Date", "1970-01-01") == date(1970, 1, 1)
    assert one("Date", "2024-03-01T12:00:00") == date(2024, 3, 1)
    for outside in ("1969-12-31", "2149-06-07"):
        assert fail("Date", outside).error_class == "out_of_range"


def ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def test_datetime64_is_sent_as_ticks() -> None:
    # The raw DateTime64 value (clickhouse-connect writes ints as is): ticks of 10**-p seconds.
    assert one("DateTime64(3)", "2024-01-02T03:04:05.678+02:00") == ms(datetime(2024, 1, 2, 1, 4, 5, 678000,
                                                                                   tzinfo=UTC))
    assert one("DateTime64(3)", "2024-01-02T03:04:05") == ms(datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC))  # naive=UTC
    assert one("DateTime64(3)", 1_700_000_000_123) == 1_700_000_000_123
    assert one("DateTime64(6)", 1_700_000_000_123) == 1_700_000_000_123_000
    assert one("DateTime64(0)", 1_700_000_000_999) == 1_700_000_000
    assert one("DateTime64(6)", "1969-12-31T23:59:59.999999Z") == -1
    assert one("DateTime64(3)", "1969-12-31T23:59:59.9999Z") == -1  # floored, like ClickHouse
    assert one("DateTime64(3)", 1.5) == 1
    assert one("DateTime64(9, 'UTC')", "2000-01-01T00:00:00.123456Z") == 946_684_800_123_456_000
    assert fail("DateTime64(3)", ms(datetime(1899, 12, 31, tzinfo=UTC))).error_class == "out_of_range"
    assert fail("DateTime64(3)", "1899-12-31T23:59:59Z").error_class == "out_of_range"
    assert fail("DateTime64(3)", "2300-01-01T00:00:00Z").error_class == "out_of_range"
    assert fail("DateTime64(3)", "yesterday").error_class == "invalid_value"
    assert fail("DateTime64(3)", [2024]).error_class == "wrong_type"


def test_uuid() -> None:
    u = uuid.uuid4()
    assert one("UUID", str(u)) == u
    assert fail("UUID", "not-a-uuid").error_class == "invalid_value"


# --------------------------------------------------------------------------- Nullable, Array, missing values


def test_missing_value_in_non_nullable_column_is_a_map_error() -> None:
    err = fail("UInt32", None)
    assert err.error_class == "missing_field"
    assert col("UInt32", default=7).map(rec({}))[0] == (7,)
    assert col("Nullable(UInt32)").map(rec({}))[0] == (None,)
    assert col("Nullable(UInt32)").map(rec({"c": 5}))[0] == (5,)
    assert fail("Nullable(UInt8)", 300).error_class == "out_of_range"


def test_arrays() -> None:
    assert one("Array(Int32)", [1, "2", 3]) == [1, 2, 3]
    assert one("Array(Nullable(Int32))", [1, None]) == [1, None]
    assert one("Array(Array(String))", [["a"], [], ["b", "c"]]) == [["a"], [], ["b", "c"]]
    assert col("Array(String)").map(rec({}))[0] == ([],)  # missing -> empty, ClickHouse's default
    assert fail("Array(Int32)", "1,2").error_class == "wrong_type"
    assert fail("Array(Int32)", [1, None]).error_class == "wrong_type"
    assert fail("Array(UInt8)", [1, 256]).error_class == "out_of_range"


def test_metadata_sources() -> None:
    mapper = Mapper({
        "k": ClickHouseColumnSpec(type="UInt64", source="@key"),
        "o": ClickHouseColumnSpec(type="UInt64", source="@offset"),
        "t": ClickHouseColumnSpec(type="LowCardinality(String)", source="@topic"),
    })
    assert mapper.map(rec({}, key=b"42", offset=9))[0] == (42, 9, "orders")
    assert mapper.column_types == ("UInt64", "UInt64", "LowCardinality(String)")


# --------------------------------------------------------------------------- dialect selection


def test_dialect_follows_the_column_spec_class() -> None:
    # "UInt8" exists only in ClickHouse ("Int8" would be PostgreSQL's int8 = bigint).
    assert Mapper({"c": ClickHouseColumnSpec(type="UInt8")}).map(rec({"c": 255}))[0] == (255,)
    with pytest.raises(ValueError, match="unsupported column type"):
        Mapper({"c": ColumnSpec(type="UInt8")})
    assert Mapper({"c": ColumnSpec(type="UInt8")}, dialect="clickhouse").map(rec({"c": 1}))[0] == (1,)
    with pytest.raises(ValueError, match="unsupported column type"):
        Mapper({"c": ClickHouseColumnSpec(type="UInt16")}, dialect="postgres")
    with pytest.raises(ValueError, match="unknown dialect"):
        Mapper({"c": ColumnSpec(type="text")}, dialect="mysql")


def test_bad_default_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="default is not a valid UInt8"):
        Mapper({"c": ClickHouseColumnSpec(type="UInt8", default=300)})


# --------------------------------------------------------------------------- config model


def _config(tmp_path: Path, sink: dict[str, Any]) -> Path:
    sink = {"kind": "clickhouse", "url": "chdb://memory", "table": "events", "order_by": ["id"],
            "columns": {"id": {"type": "UInt64"}, "v": {"type": "String"}}, **sink}
    path = tmp_path / "ingest.yaml"
    path.write_text(yaml.safe_dump({"pipelines": [{"name": "ev", "topics": ["t"], "sink": sink,
                                                   "dlq": {"dsn": "postgresql://x@127.0.0.1/db"}}]}))
    return path


def test_config_defaults_add_the_offset_version_column(tmp_path: Path) -> None:
    sink = load_settings(_config(tmp_path, {})).pipelines[0].sink
    assert isinstance(sink, ClickHouseSink)
    assert list(sink.columns) == ["id", "v", "_version"]
    assert sink.version_column == "_version"
    assert sink.columns["_version"].type == "UInt64" and sink.columns["_version"].source == "@offset"


def test_config_keeps_a_configured_version_column(tmp_path: Path) -> None:
    sink = load_settings(_config(tmp_path, {
        "version_column": "ts", "columns": {"id": {"type": "UInt64"}, "ts": {"type": "DateTime64(3)"}},
    })).pipelines[0].sink
    assert list(sink.columns) == ["id", "ts"] and sink.version_column == "ts"


@pytest.mark.parametrize(("sink", "where", "message"), [
    ({"columns": {"id": {"type": "UInt64"}, "amount": {"type": "Decimal(80, 2)"}}},
     "columns.amount.type", "Decimal precision must be 1..76"),
    ({"columns": {"id": {"type": "UInt64"}, "tags": {"type": "Map(String, String)"}}},
     "columns.tags.type", "unsupported column type 'Map(String, String)'"),
    ({"columns": {"id": {"type": "bigint"}}}, "columns.id.type", "unsupported column type 'bigint'"),
    ({"order_by": ["nope"]}, "sink", "order_by ['nope'] not among columns"),
    ({"columns": {"id": {"type": "Nullable(UInt64)"}}}, "sink", "must not be Nullable"),
    ({"version_column": "v"}, "sink", "version_column 'v' has type String"),
    ({"columns": {"id": {"type": "UInt64"}, "_version": {"type": "UInt64"}}}, "sink", "reserved"),
    ({"url": "clickhouse://host:9000"}, "sink.url", "invalid ClickHouse url"),
    ({"database": ""}, "sink.database", "invalid SQL identifier"),
])
def test_config_errors_name_the_field(tmp_path: Path, sink: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_config(tmp_path, sink))
    text = str(info.value)
    assert where in text and message in text, text


def test_types_normalise_in_the_model() -> None:
    p = PipelineSettings.model_validate({"name": "x", "topics": ["t"], "dlq": {"kind": "kafka", "topic": "dlq"},
                                         "sink": {
        "kind": "clickhouse", "url": "http://h:8123", "order_by": ["id"], "table": "t",
        "columns": {"id": {"type": "UInt64"}, "d": {"type": "Decimal( 12 ,2 )"}},
    }})
    assert p.sink.columns["d"].type == "Decimal(12, 2)"
    assert Mapper(p.sink.columns).column_types == ("UInt64", "Decimal(12, 2)", "UInt64")


# --------------------------------------------------------------------------- compiled fast path

_CH_FAST_TYPES = ["UInt8", "Int64", "UInt64", "String", "LowCardinality(String)", "Nullable(Int32)",
                  "LowCardinality(Nullable(String))", "Nullable(String)", "Float64", "Decimal(12, 2)",
                  "DateTime64(3)", "Array(Int16)", "Bool"]
_CH_VALUES = (st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64)
              | st.floats(allow_nan=False) | st.text(max_size=8) | st.lists(st.integers(-40000, 40000), max_size=3))


def _outcome(fn: Any, record: Record) -> tuple[str, Any]:
    try:
        return "ok", repr(fn(record))
    except InvalidRecord as err:
        return "error", (err.stage, err.error_class, err.message)


@given(st.sampled_from(_CH_FAST_TYPES), _CH_VALUES, st.booleans())
def test_fast_path_agrees_with_generic_loop(type_: str, value: Any, with_default: bool) -> None:
    """Inline checks see through Nullable/LowCardinality and keep each Int type's own range."""
    try:
        mapper = col(type_, default=1) if with_default and "Int" in type_ else col(type_)
        raw = orjson.dumps({"c": value})
    except (ValueError, TypeError):  # default not valid for the type / int beyond orjson's 64 bits
        return
    record = Record("orders", 3, 17, b"k", raw, 1_700_000_000_000)
    assert _outcome(mapper.map, record) == _outcome(mapper.map_generic, record)
