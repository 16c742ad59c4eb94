"""``columns: auto``: each record's row from the schema it was written with (issue #36).

A pipeline whose ``sink.columns`` is ``auto`` has no column list: each record names its table's
columns and key by its schema --

- Debezium's JSON converter with ``schemas.enable=true`` (``format: json``): the ``schema`` part of
  the value (the envelope's ``after`` struct, or the struct itself without ``envelope: debezium``)
  and of the key;
- Avro, JSON Schema and Protobuf through the Schema Registry: the value's writer schema (the
  envelope's ``after`` record / object / message with ``envelope: debezium``) and, with a registry
  ``key_format``, the key's;
- a plain JSON object key (no schema part): its fields name the key columns, typed by the value's schema.

:class:`AutoMapper` keeps the mapper's contract (``map(record) -> (row, ordering_key)``, raising
:class:`~ingest.errors.InvalidRecord` for poison and :class:`~ingest.errors.NoChange` for records
without a row). Its rows are *carriers* of a fixed width, so everything that works on rows (collapse
by key, lanes, isolation, replay, exactly-once) works unchanged; only the sink opens them
(:mod:`ingest.sinks.postgres.auto`)::

    (key, shape, values, stream, offset[, version], table)

- ``key``: the values of the record's key columns, a tuple (a table without a key: the record's
  position, so no two records collapse);
- ``shape``: the :class:`RowShape` of the record's schema -- the table shape it wants (the sink
  creates or evolves the table from the union of a batch's shapes, :mod:`.evolve`);
- ``values``: :class:`ShapedValues` -- the values in the order of their own shape's columns, each
  coerced by the column type's coercer (the row mapper's, so a value is poison here exactly when it
  would be with a hand-written column list); None for a delete;
- ``stream``, ``offset``: where the record was read (the hidden source columns: the order guard);
- ``version``, only with the sink's ``version:``: the record's version (``@source.lsn``, ...), the
  same for every table -- collapse keeps the highest, and the upsert's guard never applies an older one.

A delete is a :class:`~ingest.types.DeleteRow` carrier whose ``values`` is None (its key and source
only): a soft delete that collapse merges with an earlier upsert takes that upsert's values, which
carry their own shape.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ingest.cdc.debezium import _PAYLOAD_KEY, _SCHEMA_HEAD, SchemaParts, unwrap, unwrap_key
from ingest.core.mapping.common import _Bad
from ingest.core.routing import stream_id
from ingest.errors import IngestError, InvalidRecord, NoChange
from ingest.formats import wire
from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.shape import Shape, shape_from_avro, shape_from_connect, shape_from_json_schema, shape_from_protobuf
from ingest.types import DeleteRow, Record

__all__ = ["AutoMapper", "CARRIER_KEY", "RowShape", "ShapedValues", "carrier_columns", "carrier_values"]

#: The carrier columns (see the module docstring); the sink adds its hidden source columns after them.
CARRIER_KEY, CARRIER_SHAPE, CARRIER_VALUES = "_ingest_key", "_ingest_shape", "_ingest_values"
#: The carrier's version (``version:`` of the sink), after the source columns when there is one.
CARRIER_VERSION = "_ingest_version"
KEY_AT, SHAPE_AT, VALUES_AT, STREAM_AT, OFFSET_AT, VERSION_AT = 0, 1, 2, 3, 4, 5
#: The formats whose schemas it reads: Connect JSON with schema parts, and the registry's.
FORMATS = ("json", "avro", "json_schema", "protobuf")
#: Shapes remembered per mapper (schemas seen); cleared when full.
SHAPE_CACHE_SIZE = 1024


def carrier_values(row: tuple[Any, ...]) -> dict[str, Any]:
    """What a carrier writes, by column: an upsert's values, a delete's key (``ingest preview``)."""
    shaped = row[VALUES_AT]
    if shaped is not None:
        return dict(zip(shaped.shape.names, shaped.values, strict=True))
    return dict(zip(row[SHAPE_AT].shape.key, row[KEY_AT], strict=True))


def carrier_columns() -> dict[str, dict[str, str]]:
    """The sink settings' columns of a ``columns: auto`` pipeline (raw, as a config would give them)."""
    return {CARRIER_KEY: {"type": "text"}, CARRIER_SHAPE: {"type": "text"}, CARRIER_VALUES: {"type": "text"}}


class RowShape:
    """A schema's table shape and how its records become values: the columns' coercers, the key's
    positions. Compared by identity: one object per distinct schema (the mapper's cache)."""

    __slots__ = ("shape", "names", "_plan", "key_positions")

    def __init__(self, shape: Shape, coercer: Callable[[str, bool], Any]) -> None:
        """``coercer(type, nullable) -> (coerce, required)``: the mapper's coercer of a column type."""
        self.shape = shape
        self.names = shape.names
        self._plan = tuple((c.name, c.from_key, *coercer(c.type, c.nullable)) for c in shape.columns)
        self.key_positions = tuple(self.names.index(k) for k in shape.key)

    def values(self, image: Any, key_doc: Any) -> tuple[Any, ...]:
        """The values of ``image`` (a row image, a dict) in column order; key columns the value lacks from
        ``key_doc``. Raises InvalidRecord naming the column."""
        if type(image) is not dict:
            raise InvalidRecord("map", "not_an_object", f"the row image is not a record: {str(image)[:80]}")
        out = []
        name = ""
        try:
            for name, from_key, coerce, required in self._plan:
                raw = (key_doc.get(name) if type(key_doc) is dict else None) if from_key else image.get(name)
                if raw is None:
                    if required:
                        raise _Bad("missing_field", "required value is missing or null")
                    out.append(None)
                else:
                    out.append(coerce(raw))
        except _Bad as exc:
            raise InvalidRecord("map", exc.error_class, f"column {name!r}: {exc.detail}") from None
        except Exception as exc:  # noqa: BLE001 - never let a record crash the pipeline
            raise InvalidRecord("map", "invalid_value", f"column {name!r}: {type(exc).__name__}: {exc}"[:300]) from None
        return tuple(out)

    def key_values(self, image: Any, key_doc: Any) -> tuple[Any, ...]:
        """The key columns' values of a delete's image (or of the record key), in key order."""
        values = []
        for position in self.key_positions:
            name, from_key, coerce, _required = self._plan[position]
            source = key_doc if from_key or type(image) is not dict else image
            raw = source.get(name) if type(source) is dict else None
            if raw is None and type(key_doc) is dict:
                raw = key_doc.get(name)
            if raw is None:
                raise InvalidRecord("map", "missing_field", f"a delete without key column {name!r}")
            try:
                values.append(coerce(raw))
            except _Bad as exc:
                raise InvalidRecord("map", exc.error_class, f"column {name!r}: {exc.detail}") from None
        return tuple(values)


@dataclass(frozen=True, slots=True, eq=False)
class ShapedValues:
    """A record's values with the shape they are ordered by."""

    shape: RowShape
    values: tuple[Any, ...]


class AutoMapper:
    """Records → carrier rows (see the module docstring). One thread (the pipeline's, or replay's)."""

    def __init__(self, *, dialect: str, envelope: str, fmt: str, decoder: Any, key_decoder: Any,
                 coercer: Callable[[str, bool], Any], tombstones: str, truncate: str,
                 reserved_columns: tuple[str, ...] = (), version: Any = None, router: Any = None,
                 overrides: Sequence[tuple[str, Any]] = ()) -> None:
        """``fmt``: ``json`` (Kafka Connect schema parts) or ``avro`` (the registry's writer schemas);
        ``decoder`` / ``key_decoder``: the pipeline's value and key decoders (None: JSON);
        ``tombstones`` / ``truncate``: the pipeline's settings of those names; ``version``: a
        ``map_document(record, {"@source": source block}) -> ((version,), _)`` mapper of the sink's
        ``version:``, or None. ``router``: the pipeline's :class:`~ingest.mirror.router.TableRouter` (the
        table is appended to each carrier); ``overrides``: ``(name or glob, TableOverride)`` of the
        sink's ``tables:``, the first that matches a table applies to it."""
        if fmt not in FORMATS:
            raise ValueError(f"columns: auto reads schemas of formats {', '.join(FORMATS)}, not {fmt!r}")
        self._dialect = dialect
        self._debezium = envelope == "debezium"
        self._fmt = fmt
        self._key_protobuf = getattr(key_decoder, "name", "") == "protobuf"
        self._decoder = decoder
        self._key_decoder = key_decoder
        self._coercer = coercer
        self._tombstones = tombstones
        self._truncate = truncate
        self._reserved = reserved_columns
        self._shapes: dict[Any, RowShape] = {}
        self._version = version
        #: Connect JSON change events: each distinct schema part parsed once (ingest.cdc.debezium)
        self._parts = SchemaParts(orjson.loads) if fmt == "json" and self._debezium and decoder is None else None
        self.router = router
        self._overrides = tuple(overrides)
        self._override_of: dict[str, tuple[str, Any] | None] = {}
        self.column_names = [CARRIER_KEY, CARRIER_SHAPE, CARRIER_VALUES, "_ingest_stream", "_ingest_offset",
                             *([CARRIER_VERSION] if version is not None else []),
                             *(["_ingest_table"] if router is not None else [])]
        self.column_types = ["text", "text", "text", "bigint", "bigint", *(["bigint"] if version is not None else []),
                             *(["text"] if router is not None else [])]

    #: the mapper interface the runner reads (no fast or typed tiers here)
    fast_misses = 0
    typed_misses = 0

    def review_typed(self, offered: int) -> None:
        """Nothing to review: no typed tier."""

    @property
    def skips_tombstones(self) -> bool:
        """Every tombstone is a NoChange (Debezium's follow their delete event; ``tombstones: skip``)."""
        return self._debezium or self._tombstones == "skip"

    def columnar_plan(self, key_index: Any, version_index: Any = None) -> None:
        return None

    def columnar_refusal(self, key_index: Any, version_index: Any = None) -> str:
        return "columns: auto maps each record by its own schema"

    # -- mapping ---------------------------------------------------------------------------------
    def map(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        if record.value is None:
            if self.skips_tombstones:
                raise NoChange("tombstone")
            raise InvalidRecord("decode", "tombstone", "record value is null (tombstone)")
        key_doc, key_token = self._key(record)
        change = self._parts.change(record.value) if self._parts is not None else None
        if change is not None:  # a Connect JSON event whose schema part was seen: only the payload parsed
            value = record.value
            schema: Any = None  # read again below only for a shape not cached
            cache_key: Any = (value[:value.find(_PAYLOAD_KEY)], _hashable(key_token))
            image: Any = None
        else:
            doc = self._decode(record)
            if self._fmt == "json":
                if type(doc) is not dict or set(doc) != {"schema", "payload"}:
                    raise InvalidRecord("map", "no_schema", "columns: auto needs the value's schema part "
                                        "(Kafka Connect JSON with schemas.enable=true)")
                schema = doc["schema"]  # keyed by its bytes as the fast path keys it, when they stand alone
                cache_key = (_connect_head(record.value) or orjson.dumps(schema, option=orjson.OPT_SORT_KEYS),  # type: ignore[arg-type]
                             _hashable(key_token))
                if self._debezium:
                    image = None
                else:  # the struct's values converted by its schema (Connect Decimal, Date, ...) as keys are
                    image = unwrap_key(doc)
                if self._parts is not None:
                    self._parts.remember(record.value, doc)  # type: ignore[arg-type]
            else:
                schema = _schema_ref(record, protobuf=self._fmt == "protobuf")
                cache_key = (schema, _hashable(key_token))
                image = doc
            if self._debezium:
                change = unwrap(doc)
        if change is not None and change.op == "t":
            if self._truncate == "ignore":
                raise NoChange("truncate ignored")
            raise InvalidRecord("map", "truncate", "a truncate event (op t) cannot be applied by key; "
                                "it is dead-lettered (truncate: dlq)")
        table = self.router.table(record, change.source if change is not None else None) \
            if self.router is not None else None
        override = self._override(table) if self._overrides and table is not None else None
        if override is not None:
            cache_key = (*cache_key, override[0])
        shape = self._shapes.get(cache_key)
        if shape is None:
            if schema is None:  # the fast path's schema part, with a key or override not seen with it yet
                schema = orjson.loads(record.value)["schema"]  # type: ignore[arg-type]
            shape = self._shape(cache_key, schema, key_token, override[1] if override is not None else None)
        position = record.source_position
        stream, offset = stream_id(position[0], position[1]), position[2]
        tail: tuple[Any, ...] = (stream, offset)
        if self._version is not None:
            tail += self._version.map_document(record, {"@source": change.source} if change is not None else {})[0]
        if table is not None:
            tail += (table,)
        if change is None or change.op != "d":
            values = shape.values(image if change is None else change.after, key_doc)
            return (self._key_of(shape, values, stream, offset), shape, ShapedValues(shape, values), *tail), record.key
        if not shape.key_positions:
            raise NoChange("a delete in a table without a key: nothing to delete by")
        key = shape.key_values(change.before, key_doc)
        return DeleteRow((key, shape, None, *tail)), record.key

    def table_shape(self, table: str, value_ref: Any, key_ref: Any = None) -> Shape:
        """The shape ``table`` gets from the registry schema ``value_ref`` (its latest version, say) keyed
        by ``key_ref`` (a registry key schema; None: no key), its ``tables:`` override applied -- what
        ``ingest migrate`` and ``ingest check`` plan from. Registry formats only (ValueError for json);
        raises SchemaIncompatible like a record of that schema."""
        if self._fmt == "json":
            raise ValueError("Kafka Connect JSON carries its schema in each record")
        value = (value_ref, (0,) if self._fmt == "protobuf" else ())
        key = ("registry", (key_ref, (0,) if self._key_protobuf else ())) if key_ref is not None else None
        override = self._override(table) if self._overrides else None
        return self._shape(("plan", value, key, override[0] if override else None), value, key,
                           override[1] if override is not None else None).shape

    def _override(self, table: str) -> tuple[str, Any] | None:
        """The ``tables:`` entry of ``table``: its exact name, else the first glob that matches."""
        if table in self._override_of:
            return self._override_of[table]
        found = next(((p, o) for p, o in self._overrides if p == table), None) or \
            next(((p, o) for p, o in self._overrides if fnmatch.fnmatchcase(table, p)), None)
        self._override_of[table] = found
        return found

    @staticmethod
    def _key_of(shape: RowShape, values: tuple[Any, ...], stream: int, offset: int) -> tuple[Any, ...]:
        if not shape.key_positions:
            return ("", stream, offset)  # append-only: every record its own row
        return tuple(values[i] for i in shape.key_positions)

    def _decode(self, record: Record) -> Any:
        if self._decoder is None:
            try:
                return orjson.loads(record.value)  # type: ignore[arg-type]
            except orjson.JSONDecodeError as exc:
                raise InvalidRecord("decode", "invalid_json", f"record value is not JSON: {exc}"[:300]) from None
        try:
            return self._decoder.decode(record)
        except IngestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a decoder's bug must not crash the pipeline
            raise InvalidRecord("decode", "undecodable", f"record value could not be decoded: {exc}"[:300]) from None

    def _key(self, record: Record) -> tuple[Any, Any]:
        """``(the key's fields, what names its schema)``: ``("registry", ref)`` for a key in the registry
        wire format read by the key decoder, ``("connect", schema part)`` for JSON with a schema part,
        ``("names", field names)`` for a plain JSON object (its fields are value columns), and
        ``(None, None)`` for no key or one that names no columns (an append-only table)."""
        if record.key is None:
            return None, None
        if self._key_decoder is not None and getattr(self._key_decoder, "store", None) is not None:
            try:
                doc = self._key_decoder.decode(record)
                ref = _schema_ref(record, "key", protobuf=self._key_protobuf)
            except IngestError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise InvalidRecord("decode", "undecodable", f"record key could not be decoded: {exc}"[:300]) from None
            return doc, ("registry", ref)
        if record.key[:1] == b"\x00" and self._fmt != "json":
            raise InvalidRecord("decode", "key_format", "the record key is in the schema registry's wire format: "
                                "set key_format to its format (columns: auto takes the table's key from it)")
        try:
            doc = orjson.loads(record.key)
        except orjson.JSONDecodeError:
            return None, None  # a key that is not JSON names no columns
        if type(doc) is dict and set(doc) == {"schema", "payload"}:
            head = _connect_head(record.key)  # the schema part's bytes: its cache key, when they stand alone
            return unwrap_key(doc), ("connect", doc["schema"], head)
        if type(doc) is dict and doc:  # its fields in one order, whatever order a producer wrote them in
            return doc, ("names", tuple(sorted(doc)))
        return None, None

    def _shape(self, cache_key: Any, schema: Any, key_token: Any, override: Any = None) -> RowShape:
        try:
            shape = self._read_shape(schema, key_token)
            if key_token is not None and key_token[0] == "names":
                shape = _keyed_by(shape, key_token[1])
            if override is not None:
                shape = _overridden(shape, override)
        except SchemaIncompatible:
            raise
        except Exception as exc:  # noqa: BLE001 - a malformed schema is the record's fault
            raise SchemaIncompatible("unsupported_schema",
                                     f"its schema cannot be read: {type(exc).__name__}: {exc}"[:300]) from None
        if len(self._shapes) >= SHAPE_CACHE_SIZE:
            self._shapes.clear()
        row_shape = self._shapes[cache_key] = RowShape(shape, self._coercer)
        return row_shape

    def _read_shape(self, schema: Any, key_token: Any) -> Shape:
        """The shape of the value schema ``schema`` (a Connect schema part, or the registry ref of the
        value) keyed by the key schema ``key_token`` names."""
        dialect, reserved, envelope = self._dialect, self._reserved, self._debezium
        registry_key = key_token[1] if key_token is not None and key_token[0] == "registry" else None
        if self._fmt == "json":
            connect_key = key_token[1] if key_token is not None and key_token[0] == "connect" else None
            return shape_from_connect(schema, dialect, key_schema=connect_key, envelope=envelope,
                                      reserved_columns=reserved)
        parsed = self._decoder.store.prepared(schema[0])
        key_parsed = self._key_decoder.store.prepared(registry_key[0]) if registry_key is not None else None
        if self._fmt == "avro":
            return shape_from_avro(parsed, dialect, key_schema=key_parsed, envelope=envelope, reserved_columns=reserved)
        if self._fmt == "json_schema":
            root = _json_schema_after(parsed) if envelope else parsed
            return shape_from_json_schema(root, dialect, key_schema=key_parsed, reserved_columns=reserved)
        descriptor = parsed.descriptor(schema[1])
        if envelope:
            after = descriptor.fields_by_name.get("after")
            if after is None or after.message_type is None:
                raise SchemaIncompatible("unsupported_schema", "the change event's message has no 'after' message")
            descriptor = after.message_type
        key_descriptor = key_parsed.descriptor(registry_key[1]) if key_parsed is not None else None
        return shape_from_protobuf(descriptor, dialect, key_descriptor=key_descriptor, reserved_columns=reserved)


def _hashable(key_token: Any) -> Any:
    """A key token as (part of) a shape's cache key: a Connect schema part by its bytes."""
    if key_token is not None and key_token[0] == "connect":
        return ("connect", key_token[2] or orjson.dumps(key_token[1], option=orjson.OPT_SORT_KEYS))
    return key_token


def _connect_head(data: bytes) -> bytes | None:
    """The bytes of ``{"schema":...`` before ``,"payload":`` in a compact Connect JSON document, when they
    are the whole schema part (checked by parsing them alone), else None."""
    if not data.startswith(_SCHEMA_HEAD):
        return None
    cut = data.find(_PAYLOAD_KEY)
    if cut <= 0:
        return None
    head = data[:cut]
    try:
        return head if type(orjson.loads(head + b"}")) is dict else None
    except orjson.JSONDecodeError:
        return None


def _keyed_by(shape: Shape, names: tuple[str, ...]) -> Shape:
    """``shape`` keyed by the value columns ``names`` (a plain JSON key's fields), made NOT NULL."""
    missing = [n for n in names if shape.column(n) is None]
    if missing:
        raise SchemaIncompatible("key_unknown", f"the key's columns {missing} are not fields of the value")
    columns = tuple(dataclasses.replace(c, nullable=False) if c.name in names else c for c in shape.columns)
    return Shape(shape.dialect, columns, names)


def _overridden(shape: Shape, override: Any) -> Shape:
    """``shape`` as a ``tables:`` entry says: column types replaced, the key replaced (``conflict_key``)
    or removed (``on_conflict: none``: append-only). Raises SchemaIncompatible for a key column the
    schema does not have."""
    columns = tuple(dataclasses.replace(c, type=override.columns[c.name].type) if c.name in override.columns
                    else c for c in shape.columns)
    shape = Shape(shape.dialect, columns, shape.key)
    if override.on_conflict == "none":
        return Shape(shape.dialect, shape.columns, ())
    if override.conflict_key:
        return _keyed_by(Shape(shape.dialect, shape.columns, ()), tuple(override.conflict_key))
    return shape


def _json_schema_after(root: Any) -> Any:
    """A change event's JSON Schema → the schema of its ``after`` object (its definitions kept)."""
    node = (root.get("properties") or {}).get("after") if isinstance(root, dict) else None
    seen = 0
    while isinstance(node, dict) and seen < 16:
        seen += 1
        if "$ref" in node and node["$ref"].startswith("#/"):
            target: Any = root
            for step in node["$ref"][2:].split("/"):
                target = target.get(step) if isinstance(target, dict) else None
            node = target
            continue
        branches = node.get("oneOf") or node.get("anyOf")
        if branches:
            node = next((b for b in branches if isinstance(b, dict) and b.get("type") != "null"), None)
            continue
        break
    if not isinstance(node, dict) or node.get("type") not in ("object", None) or "properties" not in node:
        raise SchemaIncompatible("unsupported_schema", "the change event's JSON Schema has no 'after' object")
    kept = {k: v for k, v in root.items() if k in ("definitions", "$defs")}
    return {**kept, **node}


def _schema_ref(record: Record, field: str = "value", *, protobuf: bool = False) -> tuple[Any, tuple[int, ...]]:
    """``(schema ref, message indexes)`` of a registry-format value (or key); the indexes are ``()``
    except for Protobuf."""
    if protobuf:
        ref, indexes, _ = wire.split_protobuf(record, field)  # type: ignore[arg-type]
        return ref, tuple(indexes)
    return wire.split(record, field)[0], ()  # type: ignore[arg-type]
