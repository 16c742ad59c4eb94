"""The typed tier of the compiled fast path (msgspec Structs instead of orjson dicts) changes nothing.

Two contracts, both differential:

* :func:`ingest.core.mapping.fastmap.typed_document`: whatever bytes it decodes, orjson decodes
  to a dict of no other keys with the same values, type for type and float bit for bit. The bytes
  come from a grammar aimed at where msgspec and orjson part ways: fields no column reads holding
  numbers beyond a double's range or invalid UTF-8 (msgspec skips unknown fields unchecked),
  integers beyond 64 bits, duplicate and escaped keys, nested values, odd whitespace, random
  byte damage.
* :class:`~ingest.core.mapping.Mapper` with the typed tier on: the same row, key and poison
  decision as its generic loop and as its orjson tier, for those bytes and for every column type
  the fast path inlines.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.config import ColumnSpec
from ingest.core.mapping import Mapper
from ingest.core.mapping import mapper as mapper_module
from ingest.core.mapping.fastmap import typed_document
from ingest.errors import InvalidRecord
from ingest.formats.json import JsonDecoder
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.types import Record

_PROPERTY = settings(deadline=None, max_examples=1500, suppress_health_check=list(HealthCheck))

#: the keys the typed document (and the mapper below) read; the grammar also writes others
READ_KEYS = ["id", "user", "kind", "amount", "ts", "flag", "é", "a b"]
OTHER_KEYS = ["x", "ID", "amount ", ""]

_NUMBER_TEXTS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: f"{f:.25e}"),
    st.sampled_from(["-0", "-0.0", "0e0", "1E2", "1e+2", "1e400", "-1e400", "1e-400", "1e0400", "1" + "0" * 320,
                     "1" + "0" * 320 + ".5", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
                     "-9223372036854775809", "18446744073709551615", "18446744073709551616", "01", "1.", ".5", "-",
                     "NaN", "Infinity", "1e", "2.5E-3"]),
)
_STRING_TEXTS = st.one_of(
    st.text(max_size=8).map(lambda s: orjson.dumps(s).decode()),
    st.sampled_from(['"\\u0000"', '"\\ud800"', '"\\ud83d\\ude00"', '"\\udc00\\ud800"', '"\\x"', '"tab\there"',
                     '"\\u00e9"', '"\x7f"', '""']),
)
_SCALAR_TEXTS = st.one_of(_NUMBER_TEXTS, _STRING_TEXTS, st.sampled_from(["true", "false", "null", "tru", "nul"]))
_VALUE_TEXTS = st.recursive(_SCALAR_TEXTS, lambda inner: st.one_of(
    st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
    st.lists(st.tuples(st.sampled_from(READ_KEYS + OTHER_KEYS), inner), max_size=3).map(
        lambda kvs: "{" + ",".join(f"{orjson.dumps(k).decode()}:{v}" for k, v in kvs) + "}")), max_leaves=6)
_KEY_TEXTS = st.one_of(st.sampled_from(READ_KEYS + OTHER_KEYS).map(lambda k: orjson.dumps(k).decode()),
                       st.sampled_from(['"\\u0069d"', '"us\\u0065r"', '"\\u00e9"', '"a\\u0020b"', '"\\u0078"']))
_SPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n", "\x0c", "\u00a0"])


_READ_KEY_TEXTS = st.one_of(st.sampled_from(READ_KEYS).map(lambda k: orjson.dumps(k).decode()),
                            st.sampled_from(['"\\u0069d"', '"us\\u0065r"', '"\\u00e9"', '"a\\u0020b"']))


@st.composite
def _any_documents(draw: Any, keys: Any = _KEY_TEXTS, values: Any = _VALUE_TEXTS) -> bytes:
    """A JSON-ish object: read and unread keys, any values, whitespace, sometimes damaged bytes."""
    pairs = draw(st.lists(st.tuples(keys, values), max_size=7))
    sp = draw(_SPACE)
    text = "{" + sp + ("," + sp).join(f"{k}{sp}:{sp}{v}" for k, v in pairs) + sp + "}"
    if draw(st.integers(0, 9)) == 0:
        text = draw(st.sampled_from(["[", " ", "\ufeff", ""])) + text + draw(st.sampled_from(["", "x", ",", "]"]))
    raw = bytearray(text.encode("utf-8", "surrogatepass"))
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, 4)) == 0 else 0):
        if raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.sampled_from([0xFF, 0xC0, 0xED, 0x80, 0x22, 0x5C, 0x00]))
    return bytes(raw)


def documents() -> Any:
    """Anything (mostly refused), or objects of read keys and scalars (mostly accepted: their values count)."""
    return st.one_of(_any_documents(), _any_documents(_READ_KEY_TEXTS, _SCALAR_TEXTS))


def _same(a: Any, b: Any) -> bool:
    """Equal in value and type; floats bit for bit (-0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


TYPED = typed_document(READ_KEYS)


@_PROPERTY
@given(raw=documents())
def test_typed_document_decodes_only_what_orjson_decodes_alike(raw: bytes) -> None:
    try:
        typed = TYPED(raw)
    except Exception:  # noqa: BLE001 - refusing is always allowed: the orjson tier takes the record
        return
    doc = orjson.loads(raw)  # must not raise: the typed tier never accepts what orjson refuses
    assert type(doc) is dict and set(doc) <= set(READ_KEYS)
    for j, key in enumerate(READ_KEYS):
        assert _same(getattr(typed, f"f{j}"), doc.get(key)), (raw, key)


def test_typed_document_refuses_what_it_would_skip_unchecked() -> None:
    """The cases that made unknown fields forbidden: msgspec would skip them without orjson's checks."""
    for raw in (b'{"id":1,"x":1e400}', b'{"id":1,"x":"\xff"}', b'{"id":1,"x":' + b"1" * 400 + b".5}",
                b'{"id":1,"x":[1e400]}', b'{"id":{"a":1}}', b'{"id":18446744073709551615}'):
        with pytest.raises(Exception):  # noqa: B017 - any refusal sends the record on to orjson
            TYPED(raw)
    assert TYPED(b'{"\\u0069d":1,"id":2}').f0 == 2  # escaped and duplicate keys as orjson reads them


# --------------------------------------------------------------------------- the mapper's typed tier

COLUMNS = {
    "id": ColumnSpec(type="bigint", source="$.id", required=True),
    "user": ColumnSpec(type="integer", source="$.user"),
    "kind": ColumnSpec(type="text", source="$.kind", default="none"),
    "amount": ColumnSpec(type="numeric(12,2)", source="$.amount"),
    "ts": ColumnSpec(type="timestamptz", source="$.ts"),
    "flag": ColumnSpec(type="boolean", source="$.flag"),
    "e": ColumnSpec(type="double precision", source="$.é"),
    "ab": ColumnSpec(type="jsonb", source="$.a b"),
    "topic": ColumnSpec(type="text", source="@topic"),
    "offset": ColumnSpec(type="bigint", source="@offset"),
    "stream": ColumnSpec(type="bigint", source="@stream"),
    "hdr": ColumnSpec(type="text", source="@header.h"),
}
MAPPERS = [Mapper(COLUMNS), Mapper(COLUMNS, key_path="$.kind"), Mapper(COLUMNS, key_path="@header.h")]


def record(raw: bytes, *, origin: tuple[str, int, int] | None = None) -> Record:
    return Record("orders", 3, 17, b"k", raw, 1_700_000_000_000, (("h", b"v"),), origin)


def outcome(fn: Any, rec: Record) -> tuple[str, Any]:
    try:
        return "ok", repr(fn(rec))
    except InvalidRecord as err:
        return "error", (err.stage, err.error_class, err.message)


def test_the_typed_tier_is_on_for_one_key_json_sources_only() -> None:
    assert all(m.typed for m in MAPPERS)
    assert not Mapper({"a": ColumnSpec(type="bigint", source="$.a.b")}).typed  # a longer path
    assert not Mapper({"a": ColumnSpec(type="jsonb", source="$")}).typed  # the whole document
    assert not Mapper({"a": ColumnSpec(type="bigint", source="$.a")}, key_path="$.k[0]").typed
    for unnameable in ('a"b', "a\\b", "a\nb"):  # keys msgspec cannot name: the orjson tier reads them
        mapper = Mapper({"a": ColumnSpec(type="text", source=f"$.{unnameable}")})
        assert not mapper.typed and mapper.map(record(orjson.dumps({unnameable: "ok"})))[0] == ("ok",)
    assert not Mapper({"a": ColumnSpec(type="bigint", source="@offset")}).typed  # nothing read from the value
    assert not Mapper({"a": ColumnSpec(type="bigint", source="$.a")}, decoder=_OtherLoader()).typed


class _OtherLoader(JsonDecoder):
    """A format whose plain loader is not orjson's (Avro with a file schema, say): no typed tier."""

    def value_loader(self) -> Any:
        return lambda value: orjson.loads(value)


@_PROPERTY
@given(raw=documents(), replayed=st.booleans())
def test_typed_tier_agrees_with_the_generic_loop_and_the_orjson_tier(raw: bytes, replayed: bool) -> None:
    rec = record(raw, origin=("src", 1, 99) if replayed else None)
    for mapper in MAPPERS:
        got = outcome(mapper.map, rec)
        assert got == outcome(mapper.map_generic, rec)
        try:
            untyped = mapper._untyped(rec)
        except Exception:  # noqa: BLE001 - declined by the orjson tier: the generic loop decided above
            continue
        assert got == ("ok", repr(untyped))


@_PROPERTY
@given(doc=st.fixed_dictionaries({}, optional={
    "id": st.integers(-(2**63), 2**63 - 1), "user": st.one_of(st.integers(-(2**31), 2**31 - 1), st.text(max_size=3)),
    "kind": st.one_of(st.text(max_size=5), st.none()), "amount": st.floats(-1e10, 1e10).filter(math.isfinite),
    "ts": st.integers(-(2**43), 2**43), "flag": st.booleans(), "é": st.floats(allow_nan=False)}))
def test_typed_tier_agrees_on_well_formed_records(doc: dict[str, Any]) -> None:
    rec = record(orjson.dumps(doc))
    for mapper in MAPPERS:
        assert outcome(mapper.map, rec) == outcome(mapper.map_generic, rec)


def test_typed_misses_are_counted_and_not_fast_misses() -> None:
    mapper = Mapper(COLUMNS)
    mapper.map(record(b'{"id":1,"x":2}'))  # a field no column reads: the orjson tier maps it
    assert mapper.typed_misses == 1 and mapper.fast_misses == 0
    mapper.map(record(b'{"id":1}'))
    assert mapper.typed_misses == 1


def test_the_typed_tier_turns_itself_off_when_it_misses_too_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapper_module, "TYPED_REVIEW_RECORDS", 100)
    extra = Mapper(COLUMNS)
    clean = Mapper(COLUMNS)
    for chunk in range(3):
        for i in range(50):
            assert extra.map(record(b'{"id":%d,"unread":true}' % i))[0][0] == i
            clean.map(record(b'{"id":%d,"kind":"a"}' % i))
        extra.review_typed(50)
        clean.review_typed(50)
        assert extra.typed is (chunk == 0)  # reviewed after 100 records: every one of them missed
        assert clean.typed
    assert extra.typed_misses == 100  # then off: no typed attempt any more
    assert extra.map(record(b'{"id":7,"unread":true}'))[0][0] == 7


def test_postgres_sink_columns_take_the_typed_tier() -> None:
    """Every PostgreSQL table's hidden source columns (@stream, @offset) are typed-tier sources too."""
    sink = PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", conflict_key=["id"],
                                columns={"id": {"type": "bigint", "source": "$.id"}})
    mapper = Mapper(sink.columns)
    assert mapper.typed
    row, _ = mapper.map(record(b'{"id":5}'))
    assert row == mapper.map_generic(record(b'{"id":5}'))[0] and mapper.typed_misses == 0
