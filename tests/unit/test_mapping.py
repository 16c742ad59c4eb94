"""Unit tests for ingest.core.mapping: coercions, sources, keys, and hostile input."""

from __future__ import annotations

import json
import math
import struct
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.adapt import PyFormat, Transformer

from ingest.config import ColumnSpec
from ingest.core.mapping import Mapper, fastmap
from ingest.core.mapping.common import float_decimal
from ingest.core.mapping.fastmap import EXACT_FROMTIMESTAMP_MS
from ingest.core.routing import stream_id
from ingest.errors import InvalidRecord
from ingest.types import Record

UTC = timezone.utc
_ABSENT = object()


def rec(
    value: Any = _ABSENT,
    *,
    raw: bytes | None | object = _ABSENT,
    key: bytes | None = b"k",
    headers: tuple[tuple[str, bytes | None], ...] = (),
    topic: str = "orders",
    partition: int = 3,
    offset: int = 17,
    timestamp_ms: int | None = 1_700_000_000_000,
) -> Record:
    if raw is _ABSENT:
        doc = {} if value is _ABSENT else value
        try:
            raw = orjson.dumps(doc)
        except TypeError:  # ints beyond 64 bits, nesting deeper than orjson writes
            raw = json.dumps(doc).encode()
    return Record(topic, partition, offset, key, raw, timestamp_ms, headers)  # type: ignore[arg-type]


def col(type_: str, **kw: Any) -> Mapper:
    return Mapper({"c": ColumnSpec(type=type_, **kw)})


def one(type_: str, value: Any, **kw: Any) -> Any:
    row, _ = col(type_, **kw).map(rec({"c": value}))
    assert len(row) == 1
    return row[0]


def fail(type_: str, value: Any, **kw: Any) -> InvalidRecord:
    with pytest.raises(InvalidRecord) as info:
        col(type_, **kw).map(rec({"c": value}))
    return info.value


# --------------------------------------------------------------------------- construction


def test_column_order_and_types() -> None:
    m = Mapper(
        {
            "b": ColumnSpec(type="int8"),
            "a": ColumnSpec(type="NUMERIC(12, 2)"),
            "c": ColumnSpec(type="character varying(5)"),
        }
    )
    assert m.column_names == ("b", "a", "c")
    assert m.column_types == ("bigint", "numeric(12,2)", "varchar(5)")
    row, _ = m.map(rec({"a": "1.50", "b": 2, "c": "x"}))
    assert row == (2, Decimal("1.50"), "x")


def test_unsupported_type_is_value_error() -> None:
    with pytest.raises(ValueError, match="money"):
        col("money")
    with pytest.raises(ValueError):
        col("integer(3)")


def test_invalid_default_is_value_error() -> None:
    with pytest.raises(ValueError, match="default"):
        col("integer", default="abc")
    with pytest.raises(ValueError, match="default"):
        col("smallint", default=70000)


def test_defaults_are_coerced_once() -> None:
    m = Mapper(
        {
            "d": ColumnSpec(type="date", default="2024-02-29"),
            "n": ColumnSpec(type="numeric", default="1.10"),
            "j": ColumnSpec(type="jsonb", default={"a": [1, 2]}),
            "t": ColumnSpec(type="text"),
        }
    )
    row, _ = m.map(rec({}))
    assert row == (date(2024, 2, 29), Decimal("1.10"), '{"a":[1,2]}', None)
    # JSON null counts as missing: the default applies.
    row, _ = m.map(rec({"d": None, "n": None, "j": None, "t": None}))
    assert row == (date(2024, 2, 29), Decimal("1.10"), '{"a":[1,2]}', None)
    # A present value wins.
    row, _ = m.map(rec({"d": "2020-01-01"}))
    assert row[0] == date(2020, 1, 1)


# --------------------------------------------------------------------------- decode stage


@pytest.mark.parametrize(
    ("raw", "stage", "error_class"),
    [
        (None, "decode", "tombstone"),
        (b"\xff\xfe{}", "decode", "invalid_utf8"),
        (b'{"c": "\xed\xa0\x80"}', "decode", "invalid_utf8"),  # UTF-8-encoded surrogate (CESU)
        (b'{"c": "caf\xe9"}', "decode", "invalid_utf8"),  # latin-1
        (b"{", "decode", "invalid_json"),
        (b"", "decode", "invalid_json"),
        (b'{"c": NaN}', "decode", "invalid_json"),
        (b'{"c": 1e400}', "decode", "invalid_json"),
        (b'{"c": "\\ud800"}', "decode", "invalid_json"),  # lone surrogate escape
        (b'{"c": 1} trailing', "decode", "invalid_json"),
        (b"[1, 2]", "map", "not_an_object"),
        (b'"text"', "map", "not_an_object"),
        (b"42", "map", "not_an_object"),
        (b"null", "map", "not_an_object"),
        (b"true", "map", "not_an_object"),
    ],
)
def test_decode_errors(raw: bytes | None, stage: str, error_class: str) -> None:
    with pytest.raises(InvalidRecord) as info:
        col("text").map(rec(raw=raw))
    assert (info.value.stage, info.value.error_class) == (stage, error_class)
    assert info.value.message


def test_value_not_decoded_without_json_paths() -> None:
    m = Mapper({"k": ColumnSpec(type="text", source="@key"), "o": ColumnSpec(type="bigint", source="@offset")})
    assert m.map(rec(raw=b"\xff not json", key=b"abc")) == (("abc", 17), b"abc")
    with pytest.raises(InvalidRecord) as info:
        m.map(rec(raw=None))
    assert info.value.error_class == "tombstone"


def test_whole_value_path_accepts_any_json() -> None:
    m = col("jsonb", source="$")
    assert m.map(rec(raw=b"[1, 2, {\"a\": null}]"))[0] == ('[1,2,{"a":null}]',)
    assert m.map(rec(raw=b' "s" '))[0] == ('"s"',)
    assert m.map(rec(raw=b"null"))[0] == (None,)


def test_top_level_index_path() -> None:
    m = col("integer", source="$[1]")
    assert m.map(rec(raw=b"[10, 20]"))[0] == (20,)
    assert m.map(rec(raw=b'{"a": 1}'))[0] == (None,)  # no object required: just missing


# --------------------------------------------------------------------------- paths, required, missing


def test_paths() -> None:
    m = Mapper(
        {
            "deep": ColumnSpec(type="text", source="$.a.b.c"),
            "first": ColumnSpec(type="integer", source="$.items[0]"),
            "mixed": ColumnSpec(type="text", source="$.items[1].name"),
            "gone": ColumnSpec(type="integer", source="$.items[9]"),
            "through_scalar": ColumnSpec(type="text", source="$.x.y"),
            "index_on_dict": ColumnSpec(type="text", source="$.a[0]"),
            "key_on_list": ColumnSpec(type="text", source="$.items.0"),
            "odd key": ColumnSpec(type="text", source="$.odd key"),
        }
    )
    value = {"a": {"b": {"c": "deep"}}, "items": [5, {"name": "n"}], "x": 1, "odd key": "ok"}
    row, _ = m.map(rec(value))
    assert row == ("deep", 5, "n", None, None, None, None, "ok")


def test_required_missing_and_null() -> None:
    m = Mapper({"id": ColumnSpec(type="bigint", required=True), "v": ColumnSpec(type="text", source="$.a.b")})
    for value in ({}, {"id": None}):
        with pytest.raises(InvalidRecord) as info:
            m.map(rec(value))
        err = info.value
        assert (err.stage, err.error_class) == ("map", "missing_field")
        assert "'id'" in err.message and "$.id" in err.message
    m2 = Mapper({"v": ColumnSpec(type="text", source="$.a.b", required=True, default="x")})
    with pytest.raises(InvalidRecord) as info:
        m2.map(rec({"a": {}}))
    assert info.value.error_class == "missing_field" and "$.a.b" in info.value.message


def test_error_message_names_column_and_source() -> None:
    m = Mapper({"qty": ColumnSpec(type="integer", source="$.order.qty")})
    with pytest.raises(InvalidRecord) as info:
        m.map(rec({"order": {"qty": "many"}}))
    assert info.value.error_class == "invalid_value"
    assert "'qty'" in info.value.message and "$.order.qty" in info.value.message


# --------------------------------------------------------------------------- coercions: happy paths

HAPPY: list[tuple[str, Any, Any]] = [
    ("smallint", 32767, 32767),
    ("smallint", -32768, -32768),
    ("integer", 42, 42),
    ("integer", "42", 42),
    ("integer", "-007", -7),
    ("integer", 3.0, 3),
    ("integer", -0.0, 0),
    ("bigint", 2**63 - 1, 2**63 - 1),
    ("bigint", -(2**63), -(2**63)),
    ("bigint", "9223372036854775807", 2**63 - 1),
    ("numeric", 1, Decimal(1)),
    ("numeric", 0.1, Decimal("0.1")),
    ("numeric", 1e16, Decimal("1E+16")),
    ("numeric", "-12.3400", Decimal("-12.3400")),
    ("numeric", "1e5", Decimal("1E+5")),
    ("numeric", ".5", Decimal("0.5")),
    ("numeric(12,2)", "123456789012345678901234567890", Decimal("123456789012345678901234567890")),
    ("real", 1.5, 1.5),
    ("real", 2, 2.0),
    ("double precision", "1e-3", 0.001),
    ("double precision", 1e308, 1e308),
    ("float8", -3, -3.0),
    ("text", "héllo ☃ 𝄞", "héllo ☃ 𝄞"),
    ("text", "", ""),
    ("text", 12, "12"),
    ("text", 1.5, "1.5"),
    ("text", True, "true"),
    ("text", False, "false"),
    ("text", "\\u0000", "\\u0000"),  # the six characters, not a NUL
    ("varchar(3)", "toolong", "toolong"),  # length is the database's business
    ("boolean", True, True),
    ("boolean", False, False),
    ("boolean", "TRUE", True),
    ("boolean", "t", True),
    ("boolean", "F", False),
    ("boolean", "1", True),
    ("boolean", "0", False),
    ("boolean", 1, True),
    ("boolean", 0, False),
    ("timestamptz", "2024-05-01T10:00:00Z", datetime(2024, 5, 1, 10, tzinfo=UTC)),
    ("timestamptz", "2024-05-01T10:00:00.123456+02:00", datetime(2024, 5, 1, 8, 0, 0, 123456, tzinfo=UTC)),
    ("timestamptz", "2024-05-01 10:00:00", datetime(2024, 5, 1, 10, tzinfo=UTC)),
    ("timestamptz", "2024-05-01", datetime(2024, 5, 1, tzinfo=UTC)),
    ("timestamptz", 1_700_000_000_123, datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)),
    ("timestamptz", 1_700_000_000_123.5, datetime(2023, 11, 14, 22, 13, 20, 123500, tzinfo=UTC)),
    ("timestamptz", -1000, datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ("timestamp", "2024-05-01T10:00:00+02:00", datetime(2024, 5, 1, 8)),
    ("timestamp", "2024-05-01T10:00:00", datetime(2024, 5, 1, 10)),
    ("timestamp", 0, datetime(1970, 1, 1)),
    ("date", "2024-02-29", date(2024, 2, 29)),
    ("date", "2024-05-01T23:30:00-05:00", date(2024, 5, 1)),
    ("date", "0001-01-01", date(1, 1, 1)),
    ("json", {"b": [1, 2.5, None, True], "a": "x"}, '{"b":[1,2.5,null,true],"a":"x"}'),
    ("jsonb", "just a string", '"just a string"'),
    ("jsonb", 7, "7"),
    ("jsonb", {"k": "\\u0000"}, '{"k":"\\\\u0000"}'),  # escaped backslash: not a NUL
    ("uuid", "12345678-1234-5678-1234-567812345678", uuid.UUID("12345678-1234-5678-1234-567812345678")),
    ("uuid", "12345678123456781234567812345678", uuid.UUID("12345678-1234-5678-1234-567812345678")),
    ("bytea", "aGVsbG8=", b"hello"),
    ("bytea", "", b""),
]


@pytest.mark.parametrize(("type_", "value", "expected"), HAPPY)
def test_coercion_happy(type_: str, value: Any, expected: Any) -> None:
    got = one(type_, value)
    assert got == expected
    assert type(got) is type(expected)
    if isinstance(expected, datetime):
        assert (got.tzinfo is None) == (expected.tzinfo is None)


# --------------------------------------------------------------------------- coercions: errors

ERRORS: list[tuple[str, Any, str]] = [
    ("integer", {"a": 1}, "wrong_type"),
    ("integer", [1], "wrong_type"),
    ("integer", True, "wrong_type"),
    ("integer", "4.5", "invalid_value"),
    ("integer", "42abc", "invalid_value"),
    ("integer", " 42", "invalid_value"),
    ("integer", "1_000", "invalid_value"),
    ("integer", "４２", "invalid_value"),  # full-width digits
    ("integer", 4.5, "invalid_value"),
    ("smallint", 32768, "out_of_range"),
    ("smallint", "-32769", "out_of_range"),
    ("integer", 2**31, "out_of_range"),
    ("bigint", 2**63, "out_of_range"),
    ("bigint", -(2**63) - 1, "out_of_range"),
    ("bigint", "1" + "0" * 5000, "out_of_range"),
    ("bigint", 1e30, "out_of_range"),
    ("numeric", "NaN", "invalid_value"),
    ("numeric", "Infinity", "invalid_value"),
    ("numeric", "-inf", "invalid_value"),
    ("numeric", "1.2.3", "invalid_value"),
    ("numeric", "", "invalid_value"),
    ("numeric", "1e999999999", "out_of_range"),
    ("numeric", "1e-999999", "out_of_range"),
    ("numeric", True, "wrong_type"),
    ("numeric", {"v": 1}, "wrong_type"),
    ("real", True, "wrong_type"),
    ("real", "abc", "invalid_value"),
    ("real", "nan", "invalid_value"),
    ("real", 1e39, "out_of_range"),
    ("double precision", "1e400", "out_of_range"),
    ("double precision", [1.0], "wrong_type"),
    ("text", {"a": 1}, "wrong_type"),
    ("text", [], "wrong_type"),
    ("text", "a\x00b", "invalid_value"),
    ("boolean", "yes", "invalid_value"),
    ("boolean", 2, "invalid_value"),
    ("boolean", 1.0, "wrong_type"),
    ("boolean", {}, "wrong_type"),
    ("timestamptz", "yesterday", "invalid_value"),
    ("timestamptz", "2024-13-01T00:00:00Z", "invalid_value"),
    ("timestamptz", "0000-01-01T00:00:00Z", "invalid_value"),
    ("timestamptz", "10000-01-01T00:00:00Z", "invalid_value"),
    ("timestamptz", "2024-01-01T00:00:00Z" + " " * 100, "invalid_value"),
    ("timestamptz", 10**18, "invalid_value"),
    ("timestamptz", -(10**18), "invalid_value"),
    ("timestamptz", 1e300, "invalid_value"),
    ("timestamptz", True, "wrong_type"),
    ("timestamptz", {"t": 1}, "wrong_type"),
    ("timestamp", "9999-12-31T23:00:00-05:00", "invalid_value"),  # year 10000 in UTC
    ("timestamp", "0001-01-01T00:30:00+01:00", "invalid_value"),  # year 0 in UTC
    ("timestamp", 2**62, "invalid_value"),
    ("timestamp", [], "wrong_type"),
    ("date", "2023-02-29", "invalid_value"),
    ("date", "01/02/2024", "invalid_value"),
    ("date", "", "invalid_value"),
    ("date", 20240101, "wrong_type"),
    ("json", {"a": "x\x00"}, "invalid_value"),
    ("jsonb", ["ok", {"k\x00": 1}], "invalid_value"),
    ("jsonb", "\x00", "invalid_value"),
    ("jsonb", {"k": "\\\x00"}, "invalid_value"),  # backslash then a real NUL
    ("uuid", "not-a-uuid", "invalid_value"),
    ("uuid", "٠" * 32, "invalid_value"),  # non-ASCII digits
    ("uuid", 12345, "wrong_type"),
    ("uuid", {"u": 1}, "wrong_type"),
    ("bytea", "not base64!", "invalid_value"),
    ("bytea", "aGVsbG8", "invalid_value"),  # bad padding
    ("bytea", "aGVs\nbG8=", "invalid_value"),
    ("bytea", "é", "invalid_value"),
    ("bytea", 5, "wrong_type"),
]


@pytest.mark.parametrize(("type_", "value", "error_class"), ERRORS)
def test_coercion_errors(type_: str, value: Any, error_class: str) -> None:
    err = fail(type_, value)
    assert (err.stage, err.error_class) == ("map", error_class)
    assert "'c'" in err.message and "$.c" in err.message
    assert len(err.message) < 500


def test_deep_json_for_jsonb_is_invalid_value_not_crash() -> None:
    deep: Any = "x"
    for _ in range(600):
        deep = [deep]
    err = fail("jsonb", deep)
    assert err.error_class == "invalid_value"


# --------------------------------------------------------------------------- metadata sources


def test_metadata_sources() -> None:
    m = Mapper(
        {
            "k_text": ColumnSpec(type="text", source="@key"),
            "k_raw": ColumnSpec(type="bytea", source="@key"),
            "k_int": ColumnSpec(type="bigint", source="@key"),
            "topic": ColumnSpec(type="text", source="@topic"),
            "part": ColumnSpec(type="integer", source="@partition"),
            "off": ColumnSpec(type="bigint", source="@offset"),
            "ts_ms": ColumnSpec(type="bigint", source="@timestamp"),
            "ts": ColumnSpec(type="timestamptz", source="@timestamp"),
            "h": ColumnSpec(type="text", source="@header.trace-id"),
            "h_raw": ColumnSpec(type="bytea", source="@header.blob"),
            "h_missing": ColumnSpec(type="text", source="@header.nope", default="dflt"),
            "h_null": ColumnSpec(type="text", source="@header.empty"),
        }
    )
    headers = (("blob", b"\x00\xff"), ("trace-id", b"abc"), ("trace-id", b"second"), ("empty", None))
    row, key = m.map(rec(raw=b"ignored", key=b"42", headers=headers))
    assert row == (
        "42",
        b"42",
        42,
        "orders",
        3,
        17,
        1_700_000_000_000,
        datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC),
        "abc",
        b"\x00\xff",
        "dflt",
        None,
    )
    assert key == b"42"


def test_metadata_missing_and_bad_utf8() -> None:
    m = Mapper({"k": ColumnSpec(type="text", source="@key"), "ts": ColumnSpec(type="timestamp", source="@timestamp")})
    assert m.map(rec(key=None, timestamp_ms=None))[0] == (None, None)
    with pytest.raises(InvalidRecord) as info:
        m.map(rec(key=b"\xff"))
    assert (info.value.stage, info.value.error_class) == ("map", "invalid_value")
    assert "@key" in info.value.message
    req = Mapper({"k": ColumnSpec(type="text", source="@key", required=True)})
    with pytest.raises(InvalidRecord) as info:
        req.map(rec(key=None))
    assert info.value.error_class == "missing_field"
    nul = Mapper({"h": ColumnSpec(type="text", source="@header.h")})
    with pytest.raises(InvalidRecord) as info:
        nul.map(rec(headers=(("h", b"a\x00"),)))
    assert info.value.error_class == "invalid_value"


# --------------------------------------------------------------------------- ordering key


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"id": "abc"}, b"abc"),
        ({"id": "ключ"}, "ключ".encode()),
        ({"id": 42}, b"42"),
        ({"id": -(2**63)}, str(-(2**63)).encode()),
        ({"id": True}, b"true"),
        ({"id": 1.5}, b"1.5"),
        ({"id": {"b": 1, "a": [2]}}, b'{"b":1,"a":[2]}'),
        ({"id": None}, None),
        ({}, None),
    ],
)
def test_key_from_json_path(value: dict[str, Any], expected: bytes | None) -> None:
    m = Mapper({"c": ColumnSpec(type="text")}, key_path="$.id")
    assert m.map(rec(value, key=b"kafka-key"))[1] == expected


def test_key_defaults_to_kafka_key() -> None:
    m = col("text")
    assert m.map(rec({}, key=b"\x00raw"))[1] == b"\x00raw"
    assert m.map(rec({}, key=None))[1] is None


def test_key_from_metadata() -> None:
    assert Mapper({"c": ColumnSpec(type="text")}, key_path="@header.k").map(
        rec(headers=(("k", b"\xffbin"),))
    )[1] == b"\xffbin"
    assert Mapper({"c": ColumnSpec(type="text")}, key_path="@partition").map(rec())[1] == b"3"
    assert Mapper({"c": ColumnSpec(type="text")}, key_path="@topic").map(rec())[1] == b"orders"


def test_key_path_alone_triggers_decoding() -> None:
    m = Mapper({"o": ColumnSpec(type="bigint", source="@offset")}, key_path="$.user.id")
    assert m.map(rec({"user": {"id": 7}})) == ((17,), b"7")
    for raw, cls in ((b"[1]", "not_an_object"), (b"{", "invalid_json")):
        with pytest.raises(InvalidRecord) as info:
            m.map(rec(raw=raw))
        assert info.value.error_class == cls


def test_key_too_deep_is_invalid_record() -> None:
    deep: Any = 1
    for _ in range(600):
        deep = [deep]
    m = Mapper({"c": ColumnSpec(type="text")}, key_path="$.id")
    with pytest.raises(InvalidRecord) as info:
        m.map(rec({"id": deep}))
    assert info.value.stage == "map" and "ordering key" in info.value.message


def test_invalid_key_path_is_value_error() -> None:
    with pytest.raises(ValueError):
        Mapper({"c": ColumnSpec(type="text")}, key_path="$.a..b")
    with pytest.raises(ValueError):
        Mapper({"c": ColumnSpec(type="text")}, key_path="@nothing")


# --------------------------------------------------------------------------- hostile input (property tests)

#: One column of every supported type, each reading a field of the same name.
EVERY_TYPE: dict[str, type] = {
    "smallint": int,
    "integer": int,
    "bigint": int,
    "numeric": Decimal,
    "real": float,
    "double precision": float,
    "text": str,
    "varchar": str,
    "boolean": bool,
    "timestamptz": datetime,
    "timestamp": datetime,
    "date": date,
    "json": str,
    "jsonb": str,
    "uuid": uuid.UUID,
    "bytea": bytes,
}
FIELDS = [t.replace(" ", "_") for t in EVERY_TYPE]
HOSTILE = Mapper(
    {field: ColumnSpec(type=t) for field, t in zip(FIELDS, EVERY_TYPE)}
    | {
        "nested": ColumnSpec(type="text", source="$.obj.a[0]"),
        "key_text": ColumnSpec(type="text", source="@key"),
        "key_uuid": ColumnSpec(type="uuid", source="@key"),
        "hdr": ColumnSpec(type="timestamptz", source="@header.h"),
    },
    key_path="$.id",
)
HOSTILE_TYPES = list(EVERY_TYPE.values()) + [str, str, uuid.UUID, datetime]
#: The same columns one at a time, so that success paths see hostile values too.
SINGLES = [(Mapper({field: ColumnSpec(type=t)}), [EVERY_TYPE[t]]) for field, t in zip(FIELDS, EVERY_TYPE)]
WHOLE = Mapper({"all": ColumnSpec(type="jsonb", source="$"), "first": ColumnSpec(type="text", source="$[0]")})

ERROR_CLASSES = {
    "decode": {"tombstone", "invalid_utf8", "invalid_json"},
    "map": {"not_an_object", "missing_field", "wrong_type", "out_of_range", "invalid_value"},
}
_TX = Transformer()


def check(mapper: Mapper, record: Record, types: list[type]) -> None:
    """map() returns a well-typed, psycopg-dumpable row or raises a well-formed InvalidRecord."""
    try:
        row, key = mapper.map(record)
    except InvalidRecord as err:
        assert err.stage in ERROR_CLASSES, err.stage
        assert err.error_class in ERROR_CLASSES[err.stage], err.error_class
        assert isinstance(err.message, str) and err.message
        assert "internal mapping error" not in err.message, err.message  # the catch-all never fired
        return
    assert len(row) == len(mapper.column_names)
    assert key is None or type(key) is bytes
    for value, expected in zip(row, types):
        if value is None:
            continue
        assert type(value) is expected, (value, expected)
        for fmt in (PyFormat.TEXT, PyFormat.BINARY):
            _TX.get_dumper(value, fmt).dump(value)


_INTERESTING = st.sampled_from(
    [
        "", "0", "1", "-1", "42", "007", "1.5", "-0", ".5", "1e5", "1E-5", "1e400", "-1e400", "1e999999999",
        "1e-99999", "9" * 30, "NaN", "nan", "Infinity", "-inf", "0x10", "1_000", " 42", "４２", "true", "F", "yes",
        "2024-01-01", "2024-02-30", "20240101", "2024-W01-1", "2024-01-01T00:00:00Z",
        "2024-01-01T00:00:00.123456789+05:30", "9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+01:00",
        "0001-01-01", "9999-12-31", "00000000-0000-0000-0000-000000000000", "{12345678-1234-5678-1234-567812345678}",
        "٠" * 32, "AAAA", "AAA", "aGVsbG8=", "a\x00b", "\x00", "\\u0000", "\\\\u0000",
    ]
)
_ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # includes surrogates
_CLEAN_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _INTERESTING
    | st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
)
#: Scalars orjson (or PostgreSQL) may choke on: ints beyond 64 bits, NaN/Infinity literals, lone surrogates.
_POISON_SCALARS = (
    st.integers(min_value=-(10**400), max_value=10**400)
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, -(2**64), 10**400, 253402300800000, -62135596800001])
    | st.floats(allow_nan=True, allow_infinity=True)
    | _ANY_TEXT
)
CLEAN_JSON = st.recursive(
    _CLEAN_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)
JSON_VALUES = st.recursive(
    _CLEAN_SCALARS | _POISON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_ANY_TEXT | _INTERESTING, children, max_size=4),
    max_leaves=16,
)
#: Mostly well-formed JSON (so that coercers see the values), sometimes poisoned.
_FIELD_VALUES = st.one_of(_CLEAN_SCALARS, _INTERESTING, CLEAN_JSON, JSON_VALUES)


def encode(value: Any, ascii_only: bool) -> bytes:
    """Permissive JSON encoder: big ints, NaN/Infinity literals and lone surrogates all go through."""
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


_HOSTILE_DOCS = st.one_of(
    st.fixed_dictionaries({}, optional={name: _FIELD_VALUES for name in [*FIELDS, "id", "obj"]}),
    JSON_VALUES,
)
_HEADERS = st.lists(
    st.tuples(st.sampled_from(["h", "x"]), st.none() | st.binary(max_size=30) | _INTERESTING.map(str.encode)),
    max_size=3,
).map(tuple)
_KEYS = st.none() | st.binary(max_size=40) | _INTERESTING.map(lambda s: s.encode("utf-8", "surrogatepass"))
_PROPERTY = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(doc=_HOSTILE_DOCS, ascii_only=st.booleans(), key=_KEYS, headers=_HEADERS)
def test_hostile_json(doc: Any, ascii_only: bool, key: bytes | None, headers: Any) -> None:
    raw = encode(doc, ascii_only)
    check(HOSTILE, rec(raw=raw, key=key, headers=headers), HOSTILE_TYPES)
    check(WHOLE, rec(raw=raw), [str, str])
    for mapper, types in SINGLES:
        check(mapper, rec(raw=raw), types)


@_PROPERTY
@given(raw=st.binary(max_size=200), key=_KEYS)
def test_hostile_bytes(raw: bytes, key: bytes | None) -> None:
    check(HOSTILE, rec(raw=raw, key=key), HOSTILE_TYPES)
    check(WHOLE, rec(raw=raw), [str, str])


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.fixed_dictionaries({}, optional={name: _FIELD_VALUES for name in FIELDS}), data=st.data())
def test_hostile_json_corrupted(doc: dict[str, Any], data: st.DataObject) -> None:
    """Valid-looking documents with a few bytes flipped, truncated or spliced."""
    raw = bytearray(encode(doc, ascii_only=False))
    for _ in range(data.draw(st.integers(0, 3))):
        if raw:
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    check(HOSTILE, rec(raw=bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)), HOSTILE_TYPES)


@pytest.mark.parametrize("depth", [10, 200, 300, 1000, 1030, 5000])
@pytest.mark.parametrize("container", ["[", '{"a":'])
def test_hostile_deep_nesting(depth: int, container: str) -> None:
    closer = "]" if container == "[" else "}"
    inner = container * depth + "1" + closer * depth
    for raw in (inner.encode(), ('{"jsonb": ' + inner + ', "id": ' + inner + ', "text": ' + inner + "}").encode()):
        check(HOSTILE, rec(raw=raw), HOSTILE_TYPES)
        check(WHOLE, rec(raw=raw), [str, str])


@pytest.mark.parametrize(
    "piece",
    ["x" * 1_000_000, "\x00" * 10_000, "9" * 100_000, "1e" + "9" * 10_000, "é" * 300_000, "2024-01-01" * 10_000],
)
def test_hostile_long_strings(piece: str) -> None:
    doc = {name: piece for name in [*FIELDS, "id"]}
    check(HOSTILE, rec(raw=orjson.dumps(doc), key=piece.encode()[:100_000]), HOSTILE_TYPES)


def test_huge_integer_literals() -> None:
    for digits in (25, 400, 5000):
        number = "-1" + "0" * digits
        raw = ("{" + ", ".join(f'"{name}": {number}' for name in [*FIELDS, "id"]) + "}").encode()
        check(HOSTILE, rec(raw=raw), HOSTILE_TYPES)


# --------------------------------------------------------------------------- round-trip properties


@_PROPERTY
@given(n=st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_bigint_roundtrip(n: int) -> None:
    assert one("bigint", n) == n
    assert one("bigint", str(n)) == n
    assert one("numeric", n) == Decimal(n)


@_PROPERTY
@given(s=st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00")))
def test_text_roundtrip(s: str) -> None:
    assert one("text", s) == s
    assert json.loads(one("jsonb", {"s": s})) == {"s": s}


@_PROPERTY
@given(
    dt=st.datetimes(
        min_value=datetime(1, 1, 2),
        max_value=datetime(9999, 12, 30),
        timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]),
    )
)
def test_timestamptz_roundtrip(dt: datetime) -> None:
    got = one("timestamptz", dt.isoformat())
    assert got == dt and got.tzinfo is not None
    assert one("timestamp", dt.isoformat()) == dt.astimezone(UTC).replace(tzinfo=None)
    assert one("date", dt.isoformat()) == dt.date()


@_PROPERTY
@given(f=st.floats(allow_nan=False, allow_infinity=False))
def test_float_roundtrip(f: float) -> None:
    assert one("double precision", f) == f
    # the same Decimal as repr's text: sign, digits and exponent (so numeric keeps the same scale)
    assert one("numeric", f).as_tuple() == Decimal(repr(f)).as_tuple()
    assert float(one("numeric", f)) == f


@settings(max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(f=st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.integers(0, 2**64 - 1).map(lambda bits: struct.unpack("<d", struct.pack("<Q", bits))[0])
                   .filter(math.isfinite),
                   st.decimals(places=2, min_value=-10**12, max_value=10**12).map(float)))
def test_float_decimal_is_the_decimal_of_repr(f: float) -> None:
    """common.float_decimal (orjson's float text) is exactly ``Decimal(repr(f))``: sign, digits, exponent.

    An orjson release that wrote floats differently (another notation threshold, another shortest
    digit string) would change numeric values' scale; this fails first.
    """
    assert float_decimal(f).as_tuple() == Decimal(repr(f)).as_tuple()


@_PROPERTY
@given(b=st.binary(max_size=100), u=st.uuids())
def test_bytea_uuid_roundtrip(b: bytes, u: uuid.UUID) -> None:
    import base64

    assert one("bytea", base64.b64encode(b).decode()) == b
    assert one("uuid", str(u)) == u
    assert one("uuid", u.hex.upper()) == u


# --------------------------------------------------------------------------- compiled fast path


def outcome(fn: Any, record: Record) -> tuple[str, Any]:
    """What ``fn(record)`` did, comparable across calls: ("ok", repr of the result) or ("error", its fields)."""
    try:
        return "ok", repr(fn(record))
    except InvalidRecord as err:
        return "error", (err.stage, err.error_class, err.message)


def assert_fast_path_agrees(mapper: Mapper, record: Record) -> None:
    assert outcome(mapper.map, record) == outcome(mapper.map_generic, record)


@_PROPERTY
@given(doc=_HOSTILE_DOCS, ascii_only=st.booleans(), key=_KEYS, headers=_HEADERS)
def test_fast_path_agrees_with_generic_loop(doc: Any, ascii_only: bool, key: bytes | None, headers: Any) -> None:
    record = rec(raw=encode(doc, ascii_only), key=key, headers=headers)
    for mapper in [HOSTILE, WHOLE, *(m for m, _ in SINGLES)]:
        assert_fast_path_agrees(mapper, record)


@pytest.mark.parametrize("value", [0, -(2**63), 2**63 - 1, 2**63, -(2**63) - 1, 2**31, True, 1.0, "7", None])
def test_fast_path_int_bounds_agree(value: Any) -> None:
    """The inline int check uses each type's own range; out-of-range values reach the coercer's error."""
    for type_ in ("smallint", "integer", "bigint"):
        for required in (True, False):
            mapper = Mapper({"n": ColumnSpec(type=type_, required=required)})
            assert_fast_path_agrees(mapper, rec({"n": value}))


def test_fast_path_text_with_nul_is_rejected_like_the_generic_loop() -> None:
    mapper = Mapper({"t": ColumnSpec(type="text")})
    record = rec(raw=orjson.dumps({"t": "a\x00b"}))
    assert_fast_path_agrees(mapper, record)
    with pytest.raises(InvalidRecord, match="NUL"):
        mapper.map(record)


def test_fast_path_source_names_are_data_not_code() -> None:
    """Hostile JSON keys in sources become string literals in the generated function."""
    nasty = "a' + exit(3) + '\\\n\"#"
    mapper = Mapper({"c": ColumnSpec(type="text", source=f"$.{nasty}")})
    assert mapper.map(rec(raw=orjson.dumps({nasty: "ok"})))[0] == ("ok",)


_MS_MIN = (datetime.min - datetime(1970, 1, 1)) // timedelta(milliseconds=1)
_MS_MAX = (datetime.max - datetime(1970, 1, 1)) // timedelta(milliseconds=1)


@pytest.mark.parametrize("raw", [
    b"1.25", b"-0.0", b"0.1", b"1e300", b"-1.7976931348623157e308", b"5e-324", b"12", b"-18446744073709551616",
    b"18446744073709551616", b"true", b'"1.5"', b"null", b"[1.5]",
])
def test_fast_path_numeric_agrees(raw: bytes) -> None:
    """The inline finite-float branch gives what _numeric gives; everything else reaches the coercer."""
    for required in (True, False):
        mapper = Mapper({"n": ColumnSpec(type="numeric(12,2)", required=required)})
        assert_fast_path_agrees(mapper, rec(raw=b'{"n": ' + raw + b"}"))


@pytest.mark.parametrize("value", [
    0, -1, 1764460800123, _MS_MIN, _MS_MAX, _MS_MIN - 1, _MS_MAX + 1, 2**63, 1.5, True, "2025-11-30T00:00:00Z",
])
def test_fast_path_epoch_ms_agrees(value: Any) -> None:
    """The inline epoch-milliseconds branch matches the coercers, at the datetime range's edges too."""
    for type_ in ("timestamptz", "timestamp"):
        mapper = Mapper({"t": ColumnSpec(type=type_)})
        assert_fast_path_agrees(mapper, rec({"t": value}))


def test_fast_path_takes_the_inline_numeric_and_epoch_branches() -> None:
    """A float amount and an epoch-ms timestamp are mapped by the compiled function itself, not the fallback."""
    mapper = Mapper({"a": ColumnSpec(type="numeric"), "t": ColumnSpec(type="timestamptz"),
                     "u": ColumnSpec(type="timestamp")})
    row, _ = mapper._fast(rec({"a": 12.34, "t": 1764460800123, "u": -1}))
    assert row == (Decimal("12.34"), datetime(2025, 11, 30, 0, 0, 0, 123000, tzinfo=timezone.utc),
                   datetime(1969, 12, 31, 23, 59, 59, 999000))


@settings(max_examples=2000, deadline=None)
@given(ms=st.one_of(st.integers(min_value=0, max_value=EXACT_FROMTIMESTAMP_MS - 1),
                    st.integers(min_value=-(2**45), max_value=2**45),
                    st.sampled_from([0, 1, 999, 1000, EXACT_FROMTIMESTAMP_MS - 1, EXACT_FROMTIMESTAMP_MS, -1])))
def test_fast_path_epoch_milliseconds_agree(ms: int) -> None:
    """The inline ``fromtimestamp`` branch for timestamptz gives exactly the generic loop's datetime."""
    for type_ in ("timestamptz", "timestamp"):
        mapper = Mapper({"t": ColumnSpec(type=type_)})
        record = rec({"t": ms})
        assert_fast_path_agrees(mapper, record)
        assert mapper.map(record)[0][0] == mapper.map_generic(record)[0][0]
        assert mapper.fast_misses == 0, "an in-range int takes the fast path"


def test_fast_misses_count_the_records_the_fast_path_declines() -> None:
    mapper = Mapper({"n": ColumnSpec(type="bigint", required=True), "t": ColumnSpec(type="text")})
    mapper.map(rec({"n": 1, "t": "a"}))
    assert mapper.fast_misses == 0
    mapper.map(rec({"n": "2", "t": "b"}))  # a numeric string: the fast path hands it to the coercer, a hit
    assert mapper.fast_misses == 0
    with pytest.raises(InvalidRecord):
        mapper.map(rec({"t": "c"}))  # poison: the generic loop decides
    with pytest.raises(InvalidRecord):
        mapper.map_document(rec(), {"n": "x"})
    assert mapper.fast_misses == 2


#: Kafka's legal topic names
_TOPICS = st.from_regex(r"[a-zA-Z0-9._-]{1,12}", fullmatch=True)
#: Every metadata source the fast path reads inline (fastmap.INLINE_METADATA), into a column of each kind.
METADATA = Mapper({
    "topic": ColumnSpec(type="text", source="@topic"),
    "partition": ColumnSpec(type="integer", source="@partition"),
    "offset": ColumnSpec(type="bigint", source="@offset"),
    "stream": ColumnSpec(type="bigint", source="@stream"),
    "stream_text": ColumnSpec(type="text", source="@stream"),
    "at": ColumnSpec(type="timestamptz", source="@timestamp"),
    "at_ms": ColumnSpec(type="bigint", source="@timestamp", required=True),
    "n": ColumnSpec(type="bigint"),
})


@_PROPERTY
@given(topic=_TOPICS, partition=st.integers(0, 2**31 - 1), offset=st.integers(0, 2**63 - 1),
       timestamp_ms=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
       origin=st.one_of(st.none(), st.tuples(_TOPICS, st.integers(0, 2**31 - 1),
                                            st.integers(0, 2**63 - 1))))
def test_fast_path_metadata_reads_agree(topic: str, partition: int, offset: int, timestamp_ms: int | None,
                                        origin: tuple[str, int, int] | None) -> None:
    """The inlined @topic/@partition/@offset/@stream/@timestamp reads (a republished record: its origin's)."""
    record = msgspec.structs.replace(rec({"n": 1}, topic=topic, partition=partition, offset=offset,
                                     timestamp_ms=timestamp_ms), origin=origin)
    assert_fast_path_agrees(METADATA, record)
    if timestamp_ms is not None and 0 <= timestamp_ms < 2**40:
        row, _ = METADATA.map(record)
        source = origin or (topic, partition, offset)
        assert row[:4] == (source[0], source[1], source[2], stream_id(source[0], source[1]))


def test_fast_path_stream_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """More (topic, partition) pairs than the memo holds: it starts over (an evicted pair is digested
    again), a pair still held is not, and every id stays right -- inside a mapper too."""
    monkeypatch.setattr(fastmap, "STREAM_MEMO_SIZE", 4)
    digested: list[tuple[str, int]] = []

    def counting(topic: str, partition: int) -> int:
        digested.append((topic, partition))
        return stream_id(topic, partition)

    stream = fastmap.memoised_stream_id(counting)
    assert [stream("t", p) for p in (0, 1, 0)] == [stream_id("t", 0), stream_id("t", 1), stream_id("t", 0)]
    assert digested == [("t", 0), ("t", 1)]  # the repeat came from the memo
    for p in range(2, 6):  # the memo fills at 4 and starts over
        stream("t", p)
    digested.clear()
    assert stream("t", 0) == stream_id("t", 0) and digested == [("t", 0)]  # evicted: digested again
    mapper = Mapper({"s": ColumnSpec(type="bigint", source="@stream")})
    for _ in range(3):
        for p in range(10):
            assert mapper.map(rec({}, partition=p))[0] == (stream_id("orders", p),)
