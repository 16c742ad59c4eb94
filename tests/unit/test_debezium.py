"""ingest.cdc.debezium: Debezium envelopes (JSON converter, with and without the schema part) → Change.

Events come from harness.debezium (the PostgreSQL connector's JSON shape), go through orjson.loads as
the record value would, and through unwrap; converted values are checked against the real coercers.
"""

from __future__ import annotations

import base64
import copy
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal

import orjson
import pytest
from harness.debezium import Field, decimal_base64, encode_event, encode_key
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.cdc import debezium
from ingest.cdc.debezium import Change, unwrap, unwrap_key
from ingest.core.dialects import ch_type
from ingest.core.mapping.coerce_ch import _ch_coercer
from ingest.core.mapping.coerce_pg import _coercer_for
from ingest.errors import InvalidRecord

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

FIELDS = (
    Field("id", "int64", optional=False),
    Field("name", "string"),
    Field("price", "decimal(12,2)"),
    Field("big", "decimal(38,10)"),
    Field("created_at", "micro_timestamp"),
    Field("updated_at", "zoned_timestamp"),
    Field("day", "date"),
    Field("active", "boolean"),
)
KEY = (Field("id", "int64"),)

ROW = {
    "id": 7,
    "name": "widget",
    "price": Decimal("-12.34"),
    "big": Decimal("-1234567890123456789012345678.0123456789"),
    "created_at": datetime(1969, 7, 20, 20, 17, 40, 123456, tzinfo=UTC),
    "updated_at": datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=UTC),
    "day": date(1901, 2, 3),
    "active": True,
}


def event(op: str, before: dict | None, after: dict | None, *, schemas: bool = True, fields=FIELDS,
          lsn: int = 1000) -> dict:
    return orjson.loads(encode_event(op, before, after, fields=fields, lsn=lsn, ts_ms=1_700_000_000_000,
                                     schemas=schemas))


def expected(row: dict) -> dict:
    """What unwrap returns for ``row`` with the schema part: ZonedTimestamp stays ISO text."""
    out = dict(row)
    out["updated_at"] = row["updated_at"].isoformat().replace("+00:00", "Z")
    return out


def single(kind: str, value, *, schemas: bool = True):
    """``value`` in a one-column (plus id) table of ``kind``, round-tripped through unwrap."""
    fields = (Field("id", "int64", optional=False), Field("v", kind))
    change = unwrap(event("c", None, {"id": 1, "v": value}, fields=fields, schemas=schemas))
    return change.after["v"]


def raises(doc, error_class: str) -> InvalidRecord:
    with pytest.raises(InvalidRecord) as info:
        unwrap(doc)
    assert info.value.stage == "map"
    assert info.value.error_class == error_class
    return info.value


# --------------------------------------------------------------------------- shape of the encoder's output


def test_schema_form_has_debeziums_shape():
    doc = event("c", None, ROW)
    assert set(doc) == {"schema", "payload"}
    schema = doc["schema"]
    assert schema["name"] == "dbserver1.public.items.Envelope"
    names = [f["field"] for f in schema["fields"]]
    assert names[:3] == ["before", "after", "source"] and "op" in names and "ts_ms" in names
    after = schema["fields"][1]
    assert after["name"] == "dbserver1.public.items.Value" and after["optional"] is True
    price = next(f for f in after["fields"] if f["field"] == "price")
    assert price == {"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
                     "version": 1, "parameters": {"scale": "2", "connect.decimal.precision": "12"},
                     "field": "price"}
    assert schema["fields"][2]["name"] == "io.debezium.connector.postgresql.Source"
    payload = doc["payload"]
    assert payload["after"]["price"] == base64.b64encode((-1234).to_bytes(2, "big", signed=True)).decode()
    assert payload["after"]["created_at"] == (ROW["created_at"] - EPOCH) // timedelta(microseconds=1)
    assert payload["after"]["updated_at"] == "2024-01-02T03:04:05.123456Z"
    assert payload["after"]["day"] == (date(1901, 2, 3) - date(1970, 1, 1)).days
    source = payload["source"]
    for key in ("version", "connector", "name", "ts_ms", "db", "schema", "table", "lsn", "txId"):
        assert key in source
    assert source["connector"] == "postgresql" and source["lsn"] == 1000 and source["table"] == "items"


def test_decimal_base64_matches_java_biginteger():
    # BigInteger.toByteArray(): minimal two's complement, zero is one 0x00 byte.
    assert decimal_base64(Decimal("0"), 2) == "AA=="
    assert decimal_base64(Decimal("1.28"), 2) == base64.b64encode(b"\x00\x80").decode()
    assert decimal_base64(Decimal("-1.28"), 2) == base64.b64encode(b"\x80").decode()
    assert decimal_base64(Decimal("-1.29"), 2) == base64.b64encode(b"\xff\x7f").decode()
    with pytest.raises(ValueError):
        decimal_base64(Decimal("1.234"), 2)


# --------------------------------------------------------------------------- conversions (schema form)


def test_schema_form_converts_every_logical_type():
    change = unwrap(event("c", None, ROW))
    assert change.op == "c" and change.before is None
    assert change.after == expected(ROW)
    assert type(change.after["price"]) is Decimal and str(change.after["price"]) == "-12.34"
    assert change.after["created_at"].tzinfo is not None
    assert change.source["lsn"] == 1000 and change.source["connector"] == "postgresql"


def test_schemaless_form_passes_values_unchanged():
    doc = event("c", None, ROW, schemas=False)
    change = unwrap(doc)
    assert change.after == doc["after"]
    # Debezium's defaults: base64 decimals and µs integers, which nothing can tell from plain values.
    assert change.after["price"] == decimal_base64(ROW["price"], 2)
    assert type(change.after["created_at"]) is int and type(change.after["day"]) is int


def test_fastavro_like_envelope_passes_through():
    doc = {"before": None, "after": {"id": 1, "price": Decimal("1.50"), "day": date(2024, 1, 1),
                                     "at": datetime(2024, 1, 1, tzinfo=UTC)},
           "source": {"lsn": 5}, "op": "r", "ts_ms": 1, "transaction": None}
    change = unwrap(doc)
    assert change == Change("r", None, doc["after"], {"lsn": 5})


@given(st.integers(-(10**38) + 1, 10**38 - 1), st.sampled_from([0, 2, 10, 38]))
@settings(max_examples=300, deadline=None)
def test_decimal_round_trip(unscaled, scale):
    value = Decimal(f"{unscaled}E-{scale}")  # exact (scaleb would round to the context's 28 digits)
    out = single(f"decimal(38,{scale})", value)
    assert type(out) is Decimal and out == value
    assert out.as_tuple().exponent == -scale  # the column's scale, as PostgreSQL numeric(38,S) has it


@given(st.decimals(allow_nan=False, allow_infinity=False, places=2, min_value=Decimal("-9999999999.99"),
                   max_value=Decimal("9999999999.99")))
@settings(max_examples=200, deadline=None)
def test_decimal_12_2_round_trip(value):
    assert single("decimal(12,2)", value) == value


@pytest.mark.parametrize("value", ["0", "-0.01", "0.01", "-1.28", "1.28", "-9999999999.99", "9999999999.99"])
def test_decimal_edges(value):
    out = single("decimal(12,2)", Decimal(value))
    assert out == Decimal(value) and str(out) == str(Decimal(value).quantize(Decimal("0.01")))


@given(st.decimals(allow_nan=False, allow_infinity=False, places=5,
                   min_value=Decimal("-1e30"), max_value=Decimal("1e30")))
@settings(max_examples=100, deadline=None)
def test_variable_scale_decimal_round_trip(value):
    assert single("variable_decimal", value) == value


def test_variable_scale_decimal_real_example():
    # From a real Debezium event: numeric(2,1) rating 9.3 without a fixed scale in the schema.
    doc = event("c", None, {"id": 1, "v": Decimal("9.3")},
                fields=(Field("id", "int64"), Field("v", "variable_decimal")))
    assert doc["payload"]["after"]["v"] == {"scale": 1, "value": "XQ=="}
    assert unwrap(doc).after["v"] == Decimal("9.3")


@given(st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999),
                    timezones=st.just(UTC)))
@settings(max_examples=300, deadline=None)
def test_micro_timestamp_round_trip(dt):
    out = single("micro_timestamp", dt)
    assert out == dt and out.tzinfo is not None and out.microsecond == dt.microsecond


@pytest.mark.parametrize("dt", [datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
                                datetime(1900, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
                                datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)])
def test_micro_timestamp_before_1970_exact(dt):
    assert single("micro_timestamp", dt) == dt


@given(st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)))
@settings(max_examples=100, deadline=None)
def test_timestamp_ms_round_trip(dt):
    dt = dt.replace(microsecond=dt.microsecond // 1000 * 1000)
    assert single("timestamp_ms", dt) == dt


@given(st.dates())
@settings(max_examples=200, deadline=None)
def test_date_round_trip(d):
    out = single("date", d)
    assert out == d and type(out) is date


@given(st.times())
@settings(max_examples=100, deadline=None)
def test_micro_time_round_trip(t):
    assert single("micro_time", t) == t


@given(st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)))
@settings(max_examples=100, deadline=None)
def test_zoned_timestamp_stays_iso_text(dt):
    out = single("zoned_timestamp", dt)
    assert type(out) is str and out.endswith("Z")
    assert datetime.fromisoformat(out) == dt


def test_zoned_timestamp_fraction_like_java():
    assert single("zoned_timestamp", datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2024-01-02T03:04:05Z"
    assert single("zoned_timestamp", datetime(2024, 1, 2, 3, 4, 5, 120000, tzinfo=UTC)) == "2024-01-02T03:04:05.12Z"


def _handmade(fields: list[dict], after: dict, op: str = "c") -> dict:
    return {"schema": {"type": "struct", "fields": [
        {"type": "struct", "fields": fields, "optional": True, "name": "s.public.t.Value", "field": "before"},
        {"type": "struct", "fields": fields, "optional": True, "name": "s.public.t.Value", "field": "after"},
        {"type": "string", "optional": False, "field": "op"}], "name": "s.public.t.Envelope"},
        "payload": {"before": None, "after": after, "source": None, "op": op}}


def test_other_time_encodings():
    fields = [
        {"type": "int64", "name": "io.debezium.time.NanoTimestamp", "field": "ns"},
        {"type": "int64", "name": "io.debezium.time.NanoTimestamp", "field": "ns_neg"},
        {"type": "int64", "name": "io.debezium.time.Timestamp", "field": "ms"},
        {"type": "int32", "name": "org.apache.kafka.connect.data.Date", "field": "d"},
        {"type": "int32", "name": "org.apache.kafka.connect.data.Time", "field": "t_ms"},
        {"type": "int32", "name": "io.debezium.time.Time", "field": "t_ms2"},
        {"type": "int64", "name": "io.debezium.time.MicroTime", "field": "t_us"},
        {"type": "string", "name": "io.debezium.data.Json", "field": "j"},
    ]
    after = {"ns": 1_700_000_000_123_456_789, "ns_neg": -1_500, "ms": -1, "d": -1, "t_ms": 45_296_789,
             "t_ms2": 0, "t_us": 86_399_999_999, "j": '{"a": 1}'}
    out = unwrap(_handmade(fields, after)).after
    assert out["ns"] == datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=UTC)
    assert out["ns_neg"] == datetime(1969, 12, 31, 23, 59, 59, 999998, tzinfo=UTC)  # floored to the µs
    assert out["ms"] == datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    assert out["d"] == date(1969, 12, 31)
    assert out["t_ms"] == time(12, 34, 56, 789000) and out["t_ms2"] == time(0)
    assert out["t_us"] == time(23, 59, 59, 999999)
    assert out["j"] == '{"a": 1}'


def test_decimal_numeric_format_and_nulls():
    fields = [{"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "2"},
               "field": "a"},
              {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "2"},
               "field": "b"},
              {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "2"},
               "field": "c"}]
    out = unwrap(_handmade(fields, {"a": 12.34, "b": 7, "c": None})).after  # decimal.format=NUMERIC
    assert out == {"a": Decimal("12.34"), "b": Decimal(7), "c": None}


def test_nested_struct_and_array():
    dec = {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "1"}}
    fields = [
        {"type": "struct", "optional": True, "field": "inner",
         "fields": [{**dec, "field": "x"}, {"type": "string", "field": "s"}]},
        {"type": "array", "optional": True, "field": "days",
         "items": {"type": "int32", "name": "io.debezium.time.Date"}},
        {"type": "array", "optional": True, "field": "tags", "items": {"type": "string"}},
    ]
    after = {"inner": {"x": decimal_base64(Decimal("-0.5"), 1), "s": "k"}, "days": [0, None, 1],
             "tags": ["a"]}
    out = unwrap(_handmade(fields, after)).after
    assert out == {"inner": {"x": Decimal("-0.5"), "s": "k"}, "days": [date(1970, 1, 1), None, date(1970, 1, 2)],
                   "tags": ["a"]}


def test_input_is_not_mutated():
    doc = event("u", ROW, ROW)
    snapshot = copy.deepcopy(doc)
    unwrap(doc)
    assert doc == snapshot


def test_image_without_logical_types_is_returned_as_is():
    fields = (Field("id", "int64"), Field("name", "string"))
    doc = event("c", None, {"id": 1, "name": "a"}, fields=fields)
    assert unwrap(doc).after is doc["payload"]["after"]


# --------------------------------------------------------------------------- ops


@pytest.mark.parametrize("schemas", [True, False])
def test_every_op(schemas):
    changed = {**ROW, "name": "renamed", "price": Decimal("99.99")}
    conv = (lambda r: expected(r)) if schemas else (lambda r: r)

    for op in ("c", "r"):
        change = unwrap(event(op, None, ROW, schemas=schemas))
        assert change.op == op and change.before is None
        if schemas:
            assert change.after == conv(ROW)

    # update with REPLICA IDENTITY FULL (before present) and DEFAULT (before null)
    change = unwrap(event("u", ROW, changed, schemas=schemas))
    assert change.op == "u"
    if schemas:
        assert change.before == conv(ROW) and change.after == conv(changed)
    change = unwrap(event("u", None, changed, schemas=schemas))
    assert change.before is None and change.after is not None

    # delete: DEFAULT identity gives the key columns (others null); before may also be null
    change = unwrap(event("d", {"id": 7}, None, schemas=schemas))
    assert change.op == "d" and change.after is None
    assert change.before["id"] == 7 and change.before["price"] is None
    change = unwrap(event("d", None, None, schemas=schemas))
    assert change == Change("d", None, None, change.source) and change.source["lsn"] == 1000

    change = unwrap(event("t", None, None, schemas=schemas))
    assert change.op == "t" and change.before is None and change.after is None


def test_delete_with_full_before_converts():
    change = unwrap(event("d", ROW, None))
    assert change.before == expected(ROW)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("doc", [None, [1, 2], "text", 12, b"{}"])
def test_not_a_dict(doc):
    raises(doc, "not_a_change_event")


def test_schema_form_with_null_payload():
    assert "tombstone" in str(raises({"schema": {"type": "struct"}, "payload": None}, "not_a_change_event"))


def test_no_op():
    doc = event("c", None, ROW)
    del doc["payload"]["op"]
    assert "op" in str(raises(doc, "not_a_change_event"))
    raises({"after": {"id": 1}}, "not_a_change_event")
    raises({}, "not_a_change_event")


@pytest.mark.parametrize("op", ["m", "x", "C", "", 1, ["c"], {"c": 1}])
def test_unknown_op(op):
    doc = event("c", None, ROW, schemas=False)
    doc["op"] = op
    raises(doc, "not_a_change_event")


@pytest.mark.parametrize("op", ["c", "r", "u"])
def test_upsert_without_after(op):
    for schemas in (True, False):
        raises(event(op, None, None, schemas=schemas), "not_a_change_event")
    doc = event(op, None, ROW, schemas=False)
    doc["after"] = [1]
    raises(doc, "not_a_change_event")


def test_delete_with_bad_before():
    doc = event("d", {"id": 1}, None, schemas=False)
    doc["before"] = "id=1"
    raises(doc, "not_a_change_event")


def test_bad_base64_names_the_field():
    doc = event("c", None, ROW)
    doc["payload"]["after"]["price"] = "not base64!"
    err = raises(doc, "invalid_value")
    assert "price" in err.message and "Decimal" in err.message


@pytest.mark.parametrize("field,value", [("created_at", "2024-01-01"), ("created_at", 2**63 - 1),
                                         ("day", 10**9), ("big", "@@@@"), ("big", "AAA"), ("day", 1.5)])
def test_undecodable_values(field, value):
    doc = event("c", None, ROW)
    doc["payload"]["after"][field] = value
    err = raises(doc, "invalid_value")
    assert field in err.message


def test_malformed_schema_part():
    doc = event("c", None, ROW)
    doc["schema"]["fields"][1]["fields"] = 5
    raises(doc, "not_a_change_event")
    doc = event("c", None, ROW)
    doc["schema"]["fields"] = None
    raises(doc, "not_a_change_event")


# --------------------------------------------------------------------------- keys


def test_unwrap_key_both_forms():
    assert unwrap_key(orjson.loads(encode_key({"id": 7}, fields=KEY, schemas=True))) == {"id": 7}
    assert unwrap_key(orjson.loads(encode_key({"id": 7}, fields=KEY, schemas=False))) == {"id": 7}
    key_fields = (Field("id", "int64"), Field("day", "date"), Field("amount", "decimal(10,3)"))
    key = {"id": 1, "day": date(2020, 2, 29), "amount": Decimal("-1.005")}
    doc = orjson.loads(encode_key(key, fields=key_fields, schemas=True))
    assert doc["schema"]["name"] == "dbserver1.public.items.Key"
    assert all(f["optional"] is False for f in doc["schema"]["fields"])
    assert unwrap_key(doc) == key
    schemaless = orjson.loads(encode_key(key, fields=key_fields, schemas=False))
    assert unwrap_key(schemaless) is schemaless


def test_unwrap_key_other_values():
    assert unwrap_key("plain") == "plain"
    assert unwrap_key(None) is None
    assert unwrap_key(42) == 42
    assert unwrap_key({"schema": {"type": "string"}, "payload": "k1"}) == "k1"
    assert unwrap_key({"schema": None, "payload": {"id": 1}}) == {"id": 1}
    primitive = {"schema": {"type": "int32", "name": "io.debezium.time.Date"}, "payload": 1}
    assert unwrap_key(primitive) == date(1970, 1, 2)
    with pytest.raises(InvalidRecord) as info:
        unwrap_key({"schema": {"type": "struct", "fields": [
            {"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "0"},
             "field": "id"}]}, "payload": {"id": "%%%"}})
    assert (info.value.stage, info.value.error_class) == ("map", "invalid_value")


# --------------------------------------------------------------------------- the converter cache


def test_converter_cache_is_reused_and_bounded():
    debezium._PLANS.clear()
    unwrap(event("c", None, ROW))
    unwrap(event("u", ROW, ROW, lsn=2000))
    assert len(debezium._PLANS) == 1  # one row schema → one compiled converter, shared by before/after
    for i in range(debezium.CACHE_SIZE * 2 + 10):
        fields = (Field("id", "int64"), Field(f"amount_{i}", "decimal(12,2)"))
        change = unwrap(event("c", None, {"id": i, f"amount_{i}": Decimal("1.25")}, fields=fields))
        assert change.after[f"amount_{i}"] == Decimal("1.25")
        assert len(debezium._PLANS) <= debezium.CACHE_SIZE
    assert len(debezium._PLANS) >= 1


def test_signature_distinguishes_scale():
    a = (Field("id", "int64"), Field("v", "decimal(12,2)"))
    b = (Field("id", "int64"), Field("v", "decimal(12,4)"))
    raw = decimal_base64(Decimal("12.34"), 2)
    doc_a = event("c", None, {"id": 1, "v": Decimal("12.34")}, fields=a)
    doc_b = event("c", None, {"id": 1, "v": Decimal("0.1234")}, fields=b)
    assert doc_a["payload"]["after"]["v"] == doc_b["payload"]["after"]["v"] == raw
    assert unwrap(doc_a).after["v"] == Decimal("12.34")
    assert unwrap(doc_b).after["v"] == Decimal("0.1234")


# --------------------------------------------------------------------------- through the real coercers


def test_values_pass_the_postgresql_coercers():
    out = unwrap(event("c", None, ROW)).after
    numeric, timestamptz, timestamp, date_, time_ = (
        _coercer_for(t) for t in ("numeric", "timestamptz", "timestamp", "date", "time"))
    assert numeric(out["price"]) == ROW["price"] and numeric(out["big"]) == ROW["big"]
    assert timestamptz(out["created_at"]) == ROW["created_at"]
    assert timestamptz(out["updated_at"]) == ROW["updated_at"]  # ZonedTimestamp: ISO text
    assert timestamp(out["created_at"]) == ROW["created_at"].replace(tzinfo=None)
    assert date_(out["day"]) == ROW["day"]
    assert time_(single("micro_time", time(1, 2, 3, 4))) == time(1, 2, 3, 4)


def test_values_pass_the_clickhouse_coercers():
    row = {**ROW, "day": date(2024, 2, 29), "created_at": datetime(1950, 5, 6, 7, 8, 9, 654321, tzinfo=UTC)}
    out = unwrap(event("c", None, row)).after
    dec, dt64, day = (_ch_coercer(ch_type(t)) for t in ("Decimal(12, 2)", "DateTime64(6)", "Date"))
    assert dec(out["price"]) == row["price"]
    assert dt64(out["created_at"]) == (row["created_at"] - EPOCH) // timedelta(microseconds=1)
    assert dt64(out["updated_at"]) == (row["updated_at"] - EPOCH) // timedelta(microseconds=1)
    assert day(out["day"]) == row["day"]
    big = _ch_coercer(ch_type("Decimal(38, 10)"))
    assert big(out["big"]) == row["big"]


@given(st.integers(-(10**10) + 1, 10**10 - 1))
@settings(max_examples=100, deadline=None)
def test_decimal_coercers_keep_converted_values(unscaled):
    value = Decimal(f"{unscaled}E-2")
    out = single("decimal(12,2)", value)
    assert _coercer_for("numeric")(out) == value
    assert _ch_coercer(ch_type("Decimal(12, 2)"))(out) == value
