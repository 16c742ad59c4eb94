"""The Confluent wire format: where a record's schema id is, and where its payload starts.

Three ways a producer says which schema wrote a record, all decoded here:

- magic byte ``0`` + a 4-byte big-endian schema id, then the payload (the classic format, by far
  the most common: parsed inline, with no allocation but the payload view);
- magic byte ``1`` + a 16-byte schema GUID, then the payload;
- a ``__value_schema_id`` / ``__key_schema_id`` header holding either of the above prefixes, with
  the whole value as payload.

Those two newer ways are parsed by confluent-kafka's own ``dual_schema_id_deserializer``.
Protobuf payloads also carry message indexes after the id (:func:`message_indexes`).

Errors are poison (:class:`~ingest.errors.InvalidRecord`, stage ``decode``): ``bad_magic_byte``
for a payload that starts with neither magic byte (a plain JSON or Avro record on a registry
topic, say) or is too short to hold its id.
"""

from __future__ import annotations

import io
import operator
from collections.abc import Sequence
from typing import Literal

from ingest.errors import InvalidRecord
from ingest.types import Record

#: The header a producer may carry a value's (or key's) schema id in, instead of the payload prefix.
VALUE_SCHEMA_ID_HEADER = "__value_schema_id"
KEY_SCHEMA_ID_HEADER = "__key_schema_id"

Field = Literal["value", "key"]


#: A schema as a record names it: its integer id, or its GUID as text (``magic byte 1``).
SchemaRef = int | str


def ref_text(ref: SchemaRef) -> str:
    """``schema id 7`` or ``schema guid 0f1e...``, as messages name a schema."""
    return f"schema id {ref}" if type(ref) is int else f"schema guid {ref}"


def bad_magic(field: Field, data: bytes) -> InvalidRecord:
    """Why ``data`` (a record's value or key) is not in the wire format: poison, ``bad_magic_byte``."""
    if not data:
        how = "it is empty: no magic byte"
    elif data[0] in (0, 1):
        how = (f"it is {len(data)} bytes long, too short for magic byte {data[0]} and its "
               f"{'4-byte schema id' if data[0] == 0 else '16-byte GUID'}")
    else:
        how = f"it starts with 0x{data[:1].hex()}, not the magic byte 0 (+ 4-byte schema id) or 1 (+ 16-byte GUID)"
    return InvalidRecord("decode", "bad_magic_byte", f"record {field} is not in the Schema Registry wire format: "
                                                     f"{how}; no {field} schema id header names its schema either")


def split(record: Record, field: Field = "value") -> tuple[SchemaRef, memoryview]:
    """``(the schema that wrote it, the payload)`` of ``record``'s value (or key).

    Raises InvalidRecord ``bad_magic_byte`` when neither the bytes nor a header name a schema.
    """
    data = record.value if field == "value" else record.key
    assert data is not None, "tombstones never reach a decoder"
    if not record.headers and len(data) >= 5 and data[0] == 0:  # the common case, inline
        return int.from_bytes(data[1:5], "big"), memoryview(data)[5:]
    header = _header(record, field) if record.headers else None
    if header is not None:
        return _prefix_ref(header, field, header), memoryview(data)
    ref = _prefix_ref(data, field, data)
    return ref, memoryview(data)[5 if type(ref) is int else 17:]


def _prefix_ref(prefix: bytes, field: Field, shown: bytes) -> SchemaRef:
    if len(prefix) >= 5 and prefix[0] == 0:
        return int.from_bytes(prefix[1:5], "big")
    if len(prefix) >= 17 and prefix[0] == 1:
        from confluent_kafka.schema_registry.common.serde import SchemaId

        schema_id = SchemaId("AVRO")  # the type only matters for Protobuf's message indexes, read apart
        schema_id.from_bytes(io.BytesIO(prefix[:17]))
        return str(schema_id.guid)
    raise bad_magic(field, shown)


def split_protobuf(record: Record, field: Field = "value") -> tuple[SchemaRef, list[int], memoryview]:
    """``(schema, message indexes, message bytes)`` of a Protobuf record. The indexes follow the schema
    id wherever it is: in the payload, or in the schema id header (then the whole value is the message)."""
    data = record.value if field == "value" else record.key
    assert data is not None, "tombstones never reach a decoder"
    header = _header(record, field) if record.headers else None
    if header is not None:
        ref = _prefix_ref(header, field, header)
        indexes, _ = message_indexes(memoryview(header)[5 if type(ref) is int else 17:])
        return ref, indexes, memoryview(data)
    ref, payload = split(record, field)
    indexes, message = message_indexes(payload)
    return ref, indexes, message


def _header(record: Record, field: Field) -> bytes | None:
    name = VALUE_SCHEMA_ID_HEADER if field == "value" else KEY_SCHEMA_ID_HEADER
    return next((v for k, v in record.headers if k == name and v is not None), None)


def message_indexes(payload: memoryview) -> tuple[list[int], memoryview]:
    """Protobuf: the message indexes after the schema id (which message of the schema's file wrote
    the record; ``[0]`` for the first) and the message bytes after them. Zig-zag varints, as
    confluent-kafka writes them. Raises InvalidRecord ``schema_mismatch`` when they are malformed."""
    if payload[:1] == b"\x00":  # the common case: one zero byte, the file's first message
        return [0], payload[1:]
    from confluent_kafka.schema_registry.common.serde import SchemaId

    buf = io.BytesIO(payload)
    try:
        indexes = SchemaId._read_index_array(buf, zigzag=True)
    except Exception as exc:  # noqa: BLE001 - EOFError, SerializationError: the bytes are broken
        raise InvalidRecord("decode", "schema_mismatch", f"protobuf message indexes are malformed: {exc}") from None
    return indexes, payload[buf.tell():]


def describe(record: Record, field: Field = "value") -> str | None:
    """``value schema id 7``: the schema ``record``'s value (or key) names, None when it names none."""
    if (record.value if field == "value" else record.key) is None:
        return None
    try:
        return f"{field} {ref_text(split(record, field)[0])}"
    except InvalidRecord:
        return None


_VALUE, _HEADERS = operator.attrgetter("value"), operator.attrgetter("headers")


def inline_groups(records: Sequence[Record], head: int) -> tuple[list[bytes | None], dict[bytes, list[int]], list[int]]:
    """For a batch decoder of values: each record's value, the positions of the records in the classic
    inline format grouped by the value's first ``head`` bytes (magic byte ``0``, the 4-byte schema id,
    and for Protobuf (``head`` 6) the one-zero-byte message indexes ``[0]``), and the positions of every
    other record (a header, another prefix, a tombstone: the decoder's own per-record path decides).
    One writer schema's batch -- the common one -- is grouped without a loop per record."""
    values: list[bytes | None] = list(map(_VALUE, records))
    groups: dict[bytes, list[int]] = {}
    slow: list[int] = []
    heads = {v[:head] for v in values} if None not in values else None
    if heads is not None and len(heads) == 1 and not any(map(_HEADERS, records)):
        prefix = heads.pop()
        if _inline(prefix, head):
            groups[prefix] = list(range(len(values)))
        else:
            slow = list(range(len(values)))
        return values, groups, slow
    for i, (record, value) in enumerate(zip(records, values)):
        if not record.headers and value is not None and _inline(value[:head], head):
            groups.setdefault(value[:head], []).append(i)
        else:
            slow.append(i)
    return values, groups, slow


def _inline(prefix: bytes, head: int) -> bool:
    """``prefix`` (a value's first ``head`` bytes) is the classic inline format's."""
    return len(prefix) == head and prefix[0] == 0 and (head == 5 or prefix[5] == 0)
