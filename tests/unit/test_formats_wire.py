"""The Confluent wire format (ingest/formats/wire.py): where a record's schema id is and where its payload
starts -- magic byte 0 + 4-byte id, magic byte 1 + 16-byte GUID, the schema id headers -- and the
Protobuf message indexes after the id. Pure logic: bytes in, (ref, payload) out."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka.schema_registry.common.serde import SchemaId

from ingest.errors import InvalidRecord
from ingest.formats import wire
from ingest.types import Record

GUID = uuid.UUID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")


def rec(value: bytes | None, key: bytes | None = b"k", headers: Any = ()) -> Record:
    return Record("t", 0, 7, key, value, None, tuple(headers))


def id_prefix(schema_id: int) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big")


def guid_prefix(guid: uuid.UUID) -> bytes:
    return b"\x01" + guid.bytes


# -- magic byte 0: a 4-byte big-endian schema id --------------------------------------------------

@pytest.mark.parametrize("schema_id", [0, 1, 7, 256, 65_537, 2**31 - 1, 2**32 - 1])
def test_magic_byte_0_gives_the_big_endian_id_and_the_payload_after_5_bytes(schema_id: int) -> None:
    ref, payload = wire.split(rec(id_prefix(schema_id) + b"payload"))
    assert type(ref) is int and ref == schema_id
    assert isinstance(payload, memoryview)
    assert bytes(payload) == b"payload"


def test_the_id_is_big_endian_not_little_endian() -> None:
    ref, _ = wire.split(rec(b"\x00\x00\x00\x01\x02rest"))
    assert ref == 0x0102  # little-endian would be 0x02010000


def test_magic_byte_0_with_an_empty_payload() -> None:
    ref, payload = wire.split(rec(id_prefix(42)))
    assert ref == 42 and bytes(payload) == b""


def test_the_payload_is_a_view_of_the_value_not_a_copy() -> None:
    value = id_prefix(3) + b"abcdef"
    _, payload = wire.split(rec(value))
    assert payload.obj is value  # no allocation but the view
    assert bytes(payload) == value[5:]


def test_an_unrelated_header_does_not_change_the_inline_id() -> None:
    ref, payload = wire.split(rec(id_prefix(9) + b"xyz", headers=[("trace-id", b"abc"), ("n", None)]))
    assert ref == 9 and bytes(payload) == b"xyz"


# -- magic byte 1: a 16-byte GUID ----------------------------------------------------------------

def test_magic_byte_1_gives_the_guid_as_text_and_the_payload_after_17_bytes() -> None:
    ref, payload = wire.split(rec(guid_prefix(GUID) + b"payload"))
    assert type(ref) is str
    assert ref == str(GUID) == "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    assert bytes(payload) == b"payload"


def test_magic_byte_1_matches_confluent_kafkas_own_guid_bytes() -> None:
    guid = str(uuid.uuid4())
    prefix = SchemaId("AVRO", guid=guid).guid_to_bytes()
    assert len(prefix) == 17
    ref, payload = wire.split(rec(prefix + b"\x02\x04"))
    assert ref == guid and bytes(payload) == b"\x02\x04"


def test_a_guid_whose_first_id_bytes_look_like_an_int_is_still_a_guid() -> None:
    guid = uuid.UUID(bytes=b"\x00" * 15 + b"\x05")
    ref, payload = wire.split(rec(guid_prefix(guid) + b"p"))
    assert ref == str(guid) and bytes(payload) == b"p"


# -- the schema id headers ----------------------------------------------------------------------

@pytest.mark.parametrize("prefix,expected", [(id_prefix(77), 77), (guid_prefix(GUID), str(GUID))])
def test_a_value_schema_id_header_makes_the_whole_value_the_payload(prefix: bytes, expected: Any) -> None:
    # The value starts with 0x00 followed by 4 bytes: it would parse as an inline id were the header ignored.
    value = b"\x00\x00\x00\x00\x09avro-bytes"
    ref, payload = wire.split(rec(value, headers=[("other", b"x"), (wire.VALUE_SCHEMA_ID_HEADER, prefix)]))
    assert ref == expected and type(ref) is type(expected)
    assert bytes(payload) == value


def test_the_value_header_prefix_matches_confluent_kafkas_header_serializer() -> None:
    guid = str(uuid.uuid4())
    header = SchemaId("AVRO", guid=guid).guid_to_bytes()
    ref, payload = wire.split(rec(b"\x02\x04", headers=[("__value_schema_id", header)]))
    assert ref == guid and bytes(payload) == b"\x02\x04"


def test_a_header_with_a_null_value_is_ignored() -> None:
    ref, payload = wire.split(rec(id_prefix(5) + b"p", headers=[(wire.VALUE_SCHEMA_ID_HEADER, None)]))
    assert ref == 5 and bytes(payload) == b"p"


def test_the_key_uses_the_key_schema_id_header() -> None:
    record = rec(b"value-bytes", key=b"key-bytes",
                 headers=[(wire.VALUE_SCHEMA_ID_HEADER, id_prefix(1)), (wire.KEY_SCHEMA_ID_HEADER, id_prefix(2))])
    assert [(r, bytes(p)) for r, p in [wire.split(record, "key")]] == [(2, b"key-bytes")]
    assert [(r, bytes(p)) for r, p in [wire.split(record, "value")]] == [(1, b"value-bytes")]


def test_the_key_is_read_inline_and_ignores_the_value_header() -> None:
    record = rec(b"value-bytes", key=id_prefix(12) + b"kk", headers=[(wire.VALUE_SCHEMA_ID_HEADER, id_prefix(1))])
    ref, payload = wire.split(record, "key")
    assert ref == 12 and bytes(payload) == b"kk"


def test_the_key_inline_guid() -> None:
    ref, payload = wire.split(rec(b"v", key=guid_prefix(GUID) + b"kk"), "key")
    assert ref == str(GUID) and bytes(payload) == b"kk"


def test_the_header_names_are_confluent_kafkas() -> None:
    assert (wire.VALUE_SCHEMA_ID_HEADER, wire.KEY_SCHEMA_ID_HEADER) == ("__value_schema_id", "__key_schema_id")


# -- not the wire format: bad_magic_byte ----------------------------------------------------------

BAD_VALUES = [
    pytest.param(b"", id="empty"),
    pytest.param(b"{\"a\": 1}", id="plain-json"),
    pytest.param(b"\x02" + b"\x00" * 20, id="magic-2"),
    pytest.param(b"\x00", id="magic-0-only"),
    pytest.param(b"\x00\x00\x00\x01", id="magic-0-4-bytes"),
    pytest.param(b"\x01", id="magic-1-only"),
    pytest.param(b"\x01" + b"\x00" * 15, id="magic-1-16-bytes"),
]


def assert_bad_magic(exc: InvalidRecord, field: str) -> None:
    assert (exc.stage, exc.error_class) == ("decode", "bad_magic_byte")
    assert field in exc.message and "magic" in exc.message
    assert str(exc) == exc.message


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_value_not_in_the_wire_format_is_bad_magic_byte(value: bytes) -> None:
    with pytest.raises(InvalidRecord) as info:
        wire.split(rec(value))
    assert_bad_magic(info.value, "value")


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_key_not_in_the_wire_format_is_bad_magic_byte(value: bytes) -> None:
    with pytest.raises(InvalidRecord) as info:
        wire.split(rec(id_prefix(1) + b"fine", key=value), "key")
    assert_bad_magic(info.value, "key")


def test_bad_magic_names_the_first_byte() -> None:
    with pytest.raises(InvalidRecord) as info:
        wire.split(rec(b"{\"a\": 1}"))
    assert "0x7b" in info.value.message


def test_bad_magic_of_empty_bytes_does_not_crash_and_says_so() -> None:
    exc = wire.bad_magic("value", b"")
    assert (exc.stage, exc.error_class) == ("decode", "bad_magic_byte")
    assert "it is empty" in exc.message


def test_bad_magic_with_unrelated_headers_too() -> None:
    with pytest.raises(InvalidRecord) as info:
        wire.split(rec(b"\x05abcdef", headers=[("trace-id", b"abc")]))
    assert info.value.error_class == "bad_magic_byte"


@pytest.mark.parametrize("header", [b"", b"\x07\x00\x00\x00\x01", b"\x00\x00\x01", b"\x01" + b"\x00" * 8])
def test_a_malformed_schema_id_header_is_bad_magic_byte(header: bytes) -> None:
    # The value itself is a valid inline prefix: the header wins, and it is broken.
    with pytest.raises(InvalidRecord) as info:
        wire.split(rec(id_prefix(1) + b"p", headers=[(wire.VALUE_SCHEMA_ID_HEADER, header)]))
    assert (info.value.stage, info.value.error_class) == ("decode", "bad_magic_byte")


# -- ref_text -------------------------------------------------------------------------------------

def test_ref_text_names_an_id_or_a_guid() -> None:
    assert wire.ref_text(7) == "schema id 7"
    assert wire.ref_text(str(GUID)) == f"schema guid {GUID}"


def test_ref_text_of_a_numeric_looking_guid_string_is_still_a_guid() -> None:
    assert wire.ref_text("7") == "schema guid 7"


# -- Protobuf message indexes ---------------------------------------------------------------------

@pytest.mark.parametrize("indexes", [[0], [1], [0, 0], [2, 5], [1, 0, 3], [63, 64, 300], [100_000]])
def test_message_indexes_round_trip_with_confluent_kafkas_encoding(indexes: list[int]) -> None:
    prefix = SchemaId("PROTOBUF", schema_id=321, message_indexes=indexes).id_to_bytes()
    value = prefix + b"\x08\x96\x01"  # the Protobuf message bytes
    ref, payload = wire.split(rec(value))
    assert ref == 321
    got, message = wire.message_indexes(payload)
    assert got == indexes
    assert bytes(message) == b"\x08\x96\x01"
    assert isinstance(message, memoryview)


def test_message_indexes_after_a_guid() -> None:
    guid = str(uuid.uuid4())
    prefix = SchemaId("PROTOBUF", guid=guid, message_indexes=[3, 1]).guid_to_bytes()
    ref, payload = wire.split(rec(prefix + b"msg"))
    assert ref == guid
    assert [(i, bytes(m)) for i, m in [wire.message_indexes(payload)]] == [([3, 1], b"msg")]


def test_the_first_message_is_a_single_zero_byte() -> None:
    indexes, message = wire.message_indexes(memoryview(b"\x00rest"))
    assert indexes == [0] and bytes(message) == b"rest"


@pytest.mark.parametrize("payload", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x80", id="unterminated-varint"),
    pytest.param(b"\x06\x02", id="3-indexes-1-present"),
    pytest.param(b"\x01", id="negative-length"),
    pytest.param(b"\xc2\x9a\x0c", id="length-over-100000"),
])
def test_malformed_message_indexes_are_schema_mismatch(payload: bytes) -> None:
    with pytest.raises(InvalidRecord) as info:
        wire.message_indexes(memoryview(payload))
    assert (info.value.stage, info.value.error_class) == ("decode", "schema_mismatch")
    assert "message indexes" in info.value.message


# confluent-kafka's ProtobufSerializer with ``header_schema_id_serializer`` writes the message indexes
# into the ``__value_schema_id`` header, after the GUID, and the value is the bare message:
# split_protobuf reads the indexes from the header then.
def test_protobuf_message_indexes_carried_in_the_header_are_not_lost() -> None:
    guid = str(uuid.uuid4())
    header = SchemaId("PROTOBUF", guid=guid, message_indexes=[1, 2]).guid_to_bytes()
    message = b"\x08\x96\x01"  # field 1 = 150: what the serializer wrote as the value
    ref, indexes, message_bytes = wire.split_protobuf(rec(message, headers=[(wire.VALUE_SCHEMA_ID_HEADER, header)]))
    assert ref == guid
    assert (indexes, bytes(message_bytes)) == ([1, 2], message)
