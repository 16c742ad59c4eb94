"""Records in the Schema Registry wire format, made by confluent-kafka's own serializers.

The tests produce what real producers produce: each helper registers the schema through the
real client (against :mod:`harness.schema_registry`'s stand-in) and returns the serialized bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext


def client(url: str, conf: Mapping[str, Any] | None = None) -> SchemaRegistryClient:
    """The real client for ``url`` (``conf``: more client settings, e.g. ``basic.auth.user.info``)."""
    return SchemaRegistryClient({"url": url, **dict(conf or {})})


def avro_values(url: str, topic: str, schema: str, docs: Iterable[Mapping[str, Any]], *,
                conf: Mapping[str, Any] | None = None, field: str = "value",
                client_conf: Mapping[str, Any] | None = None) -> list[bytes]:
    """``docs`` encoded with ``AvroSerializer(schema)`` for ``topic``'s value (or key) subject."""
    from confluent_kafka.schema_registry.avro import AvroSerializer

    serializer = AvroSerializer(client(url, client_conf), schema, conf=dict(conf or {}))
    ctx = SerializationContext(topic, MessageField.VALUE if field == "value" else MessageField.KEY)
    return [serializer(dict(doc), ctx) for doc in docs]


def avro_values_with_id_headers(url: str, topic: str, schema: str, docs: Iterable[Mapping[str, Any]], *,
                                conf: Mapping[str, Any] | None = None) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    """``docs`` encoded with the schema's GUID in a ``__value_schema_id`` header (confluent-kafka's
    ``header_schema_id_serializer``): ``(bare Avro value, headers)`` pairs."""
    from confluent_kafka.schema_registry import header_schema_id_serializer
    from confluent_kafka.schema_registry.avro import AvroSerializer

    serializer = AvroSerializer(client(url, conf), schema, conf={"schema.id.serializer": header_schema_id_serializer})
    out = []
    for doc in docs:
        headers: list[tuple[str, bytes]] = []
        value = serializer(dict(doc), SerializationContext(topic, MessageField.VALUE, headers))
        out.append((value, headers))
    return out


def json_schema_values(url: str, topic: str, schema: str, docs: Iterable[Mapping[str, Any]], *,
                       conf: Mapping[str, Any] | None = None) -> list[bytes]:
    """``docs`` encoded with ``JSONSerializer(schema)`` (validated against it) for ``topic``'s values."""
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    serializer = JSONSerializer(schema, client(url), conf=dict(conf or {}))
    ctx = SerializationContext(topic, MessageField.VALUE)
    return [serializer(dict(doc), ctx) for doc in docs]


def protobuf_values(url: str, topic: str, messages: Iterable[Any], *,
                    conf: Mapping[str, Any] | None = None) -> list[bytes]:
    """Protobuf ``messages`` (all of one class) encoded with ``ProtobufSerializer`` for ``topic``'s values."""
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    messages = list(messages)
    serializer = ProtobufSerializer(type(messages[0]), client(url), conf={"use.deprecated.format": False,
                                                                          **dict(conf or {})})
    ctx = SerializationContext(topic, MessageField.VALUE)
    return [serializer(m, ctx) for m in messages]


def avro_varint(n: int) -> bytes:
    """Avro's zig-zag varint of ``n`` (a long's encoding; datums and lengths written by hand)."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
