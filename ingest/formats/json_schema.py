"""``format: json_schema``: JSON values in the Schema Registry wire format (Confluent's
``JSONSerializer``): the magic byte and schema id (:mod:`ingest.formats.wire`), then UTF-8 JSON.

The payload is parsed with orjson, exactly as ``format: json`` parses a value, and mapped the same
way. The schema id must be one the registry knows (else ``unknown_schema``); the schema itself is
what ``ingest check`` compares the configured columns with. Records are *not* validated against
their JSON Schema on the way in -- the column types are the contract, checked per value as for
plain JSON (full JSON Schema validation would cost far more per record than everything else ingest
does); the producer's serializer has validated them already.

Poison (stage ``decode``): ``bad_magic_byte``, ``unknown_schema``, ``schema_mismatch`` (the id names
a schema that is not a JSON Schema), ``invalid_utf8`` / ``invalid_json`` for the payload.

On the columnar tier the plan reads the payloads as JSON values (:meth:`JsonSchemaDecoder.columnar_payloads`):
the prefix is stripped where the decoder would accept it, and every other record is left to the row
mapper, which decides.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from typing import Any

import orjson

from ingest.errors import InvalidRecord
from ingest.formats import wire
from ingest.formats.json import decode_error
from ingest.formats.registered import RegistryDecoder
from ingest.formats.schemas import SchemaStore
from ingest.types import Record


def parse_json_schema(schema: Any, store: SchemaStore | None = None) -> Any:
    """A registry ``Schema`` of type JSON, as a dict. Raises ValueError for another type or bad JSON."""
    if (schema.schema_type or "AVRO") != "JSON":
        raise ValueError(f"it is a {schema.schema_type or 'AVRO'} schema, not a JSON Schema")
    try:
        parsed = json.loads(schema.schema_str)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError("a JSON Schema is an object or a boolean")
    return parsed


class JsonSchemaDecoder(RegistryDecoder):
    """JSON Schema values (or keys) whose schemas live in the registry."""

    name = "json_schema"
    document = "a JSON object"
    parse = staticmethod(parse_json_schema)
    has_path = staticmethod(lambda schema, steps: has_path(schema, steps))

    def decode(self, record: Record) -> Any:
        ref, payload = wire.split(record, self._field)
        self._store.prepared(ref)  # type: ignore[union-attr]  # unknown_schema (poison), schema_mismatch
        try:
            return orjson.loads(payload)
        except Exception as exc:  # noqa: BLE001 - JSONDecodeError
            raise decode_error(bytes(payload), exc, self._field) from None

    def columnar_payloads(self, records: Sequence[Record], values: Sequence[bytes]) -> list[bytes | None]:
        """For the columnar plan (:class:`~ingest.core.mapping.columnar.ColumnarPlan`, ``payloads``): per
        record of ``records`` (``values``: their values, none a tombstone), the JSON text :meth:`decode`
        would parse -- the bytes after the wire-format prefix -- or None where :meth:`decode` would
        refuse the prefix or its schema (``bad_magic_byte``, ``unknown_schema``, ``schema_mismatch``), or
        the store does not hold the schema yet: such a record is the row mapper's, which decides. A
        schema is vouched for only when the store already holds it as a parsed JSON Schema (the chunk
        was prepared); each distinct 5-byte prefix is looked up once, nothing is fetched, and nothing
        raises for any record content. Records whose schema a header names, or a GUID (magic byte 1),
        are split one by one, as :meth:`decode` splits them."""
        known = self._store.parsed  # type: ignore[union-attr]  # read without its lock: it only grows
        vouched = {prefix: len(prefix) == 5 and prefix[0] == 0 and int.from_bytes(prefix[1:], "big") in known
                   for prefix in set(map(_prefix, values))}
        payloads = [v[5:] if vouched[v[:5]] else None for v in values]
        if any(map(_headers, records)) or any(prefix[:1] == b"\x01" for prefix in vouched):
            for i, record in enumerate(records):
                if record.headers or values[i][:1] == b"\x01":
                    payloads[i] = self._vouched_payload(record, known)
        return payloads

    def _vouched_payload(self, record: Record, known: dict[wire.SchemaRef, Any]) -> bytes | None:
        """The JSON text of one record split as :meth:`decode` splits it, None unless its schema is in
        ``known``."""
        try:
            ref, payload = wire.split(record, self._field)
        except InvalidRecord:
            return None
        return bytes(payload) if ref in known else None


#: a value's wire-format prefix: magic byte 0 and the 4-byte schema id (shorter for a value too short)
_prefix = operator.itemgetter(slice(0, 5))
_headers = operator.attrgetter("headers")


def has_path(schema: Any, steps: Sequence[tuple[bool, str | int]]) -> bool:
    """Whether a document valid for the JSON Schema ``schema`` can hold a value at ``steps``. Follows
    ``properties``, ``additionalProperties``/``patternProperties``, ``items``/``prefixItems``, local
    ``$ref``s and ``anyOf``/``oneOf``/``allOf``. A field an object schema does not list among its
    ``properties`` is missing (even where ``additionalProperties`` would allow it: ``check`` asks
    whether the schema describes the field); a schema that says nothing of a place allows it."""
    root = schema

    def resolve(node: Any) -> Any:
        seen = 0
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") \
                and seen < 32:
            target: Any = root
            for part in node["$ref"].lstrip("#").strip("/").split("/"):
                if not part:
                    continue
                target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            node, seen = target, seen + 1
        return node

    def walk(node: Any, i: int) -> bool:
        node = resolve(node)
        if i == len(steps):
            return node is not False
        if node is True or node is None or node == {}:
            return True
        if node is False or not isinstance(node, dict):
            return False
        for combinator in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(combinator), list) and any(walk(branch, i) for branch in node[combinator]):
                return True
        is_key, step = steps[i]
        if is_key:
            props = node.get("properties") or {}
            if step in props:
                return walk(props[step], i + 1)
            if node.get("patternProperties"):
                return True
            extra = node.get("additionalProperties", True)
            if extra is False or "properties" in node:
                return False  # the schema lists its fields and this is not one of them
            return walk(extra, i + 1)
        items = node.get("prefixItems")
        if isinstance(items, list) and isinstance(step, int) and step < len(items):
            return walk(items[step], i + 1)
        return walk(node.get("items", True), i + 1)

    return walk(schema, 0)
