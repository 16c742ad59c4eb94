"""A table's shape -- its ordered columns and its key -- from a record schema, and the union of a batch's.

Schemas read
------------
- **Avro** (:func:`shape_from_avro`): a record schema, as JSON text, a dict, or fastavro's parsed form
  (named types referenced by name are resolved); each top-level field is a column. With
  ``envelope=True`` (a Debezium change event written by the Avro converter) the columns are the
  fields of the ``after`` record.
- **Protobuf** (:func:`shape_from_protobuf`): a message descriptor (``ProtoSchema.descriptor()``);
  each field is a column.
- **JSON Schema** (:func:`shape_from_json_schema`): an object schema; each of its ``properties`` is a
  column (local ``$ref`` s resolved); a property not in ``required`` is nullable.
- **Kafka Connect** (:func:`shape_from_connect`): the ``schema`` part Debezium's JSON converter writes
  with ``schemas.enable=true``; with ``envelope=True`` (the default) the columns are the fields of the
  envelope's ``after`` struct, else of the struct itself.

Each field's type goes through :mod:`ingest.mirror.types` (the documented type map); a field name goes
through :func:`ingest.mirror.names.check_column` (refused names raise
:class:`~ingest.mirror.errors.SchemaIncompatible`). Columns keep the schema's field order.

The key
-------
``key_schema`` (same format; for Debezium, the record key's schema part) names the key: its fields
are the key columns, in its order. A key field the value also has takes the value's column, made
NOT NULL; one it lacks is added in front, from the key schema, marked ``from_key`` (its value is the
record key's). **Key columns are never nullable.** No key schema, or a key schema that is not a
record / struct (a bare string key names no column): no key -- the table is append-only.

The union
---------
:func:`union` gives the one shape a batch's table must have when the batch holds records of several
schemas: every column of any of them, in order of first appearance; a column some schema lacks, or
that one of them allows null in, is nullable; a column whose types differ takes the type that holds
both (``integer`` and ``bigint`` → ``bigint``, see :func:`ingest.mirror.types.accepts`), and two types
neither of which holds the other (``bigint`` and ``text``) raise ``SchemaIncompatible`` (reason
``batch_types_differ``), as do two different keys (``key_changed``). A table is decided from a
batch's union, never from one record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.names import CLICKHOUSE, POSTGRES, check_column
from ingest.mirror.types import Logical, accepts, ch_nullable, column_type

__all__ = [
    "Column", "FieldType", "Shape", "build_shape", "shape_from_avro", "shape_from_connect",
    "shape_from_json_schema", "shape_from_protobuf", "union",
]


@dataclass(frozen=True, slots=True)
class Column:
    """One column: ``type`` is the dialect type *without* ClickHouse's ``Nullable``, spelled as a
    config's column ``type`` (from the type map: ClickHouse ``JSON``; from a catalog: as
    :func:`ingest.mirror.types.normalize_type` spells it, ``String``), ``nullable`` says whether it
    holds NULL, ``default`` is a SQL default expression or None, ``from_key`` marks a key column the
    value lacks (its value is read from the record key)."""

    name: str
    type: str
    nullable: bool
    default: str | None = None
    from_key: bool = False


@dataclass(frozen=True, slots=True)
class FieldType:
    """A schema field read by a format reader: its name, Logical type and whether it may be null."""

    name: str
    logical: Logical
    nullable: bool


@dataclass(frozen=True)
class Shape:
    """A table's columns (in order) and key (column names, in order; empty: append-only) in one dialect.

    Invariants, checked at construction (ValueError): column names are unique, every key column is a
    column and is NOT NULL.
    """

    dialect: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()
    _by_name: dict[str, Column] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dialect not in (POSTGRES, CLICKHOUSE):
            raise ValueError(f"unknown dialect {self.dialect!r}")
        for c in self.columns:
            if c.name in self._by_name:
                raise ValueError(f"column {c.name!r} twice")
            self._by_name[c.name] = c
        for k in self.key:
            c = self._by_name.get(k)
            if c is None:
                raise ValueError(f"key column {k!r} is not a column")
            if c.nullable:
                raise ValueError(f"key column {k!r} is nullable")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column | None:
        return self._by_name.get(name)

    def ddl_type(self, column: Column) -> str:
        """The column's type as DDL writes it: ClickHouse wraps a nullable column in ``Nullable``."""
        if self.dialect == CLICKHOUSE and column.nullable:
            return ch_nullable(column.type)
        return column.type

    def with_columns(self, extra: Iterable[Column]) -> Shape:
        """This shape with ``extra`` columns appended (those it already has are left as they are)."""
        add = [c for c in extra if c.name not in self._by_name]
        return Shape(self.dialect, self.columns + tuple(add), self.key) if add else self


def build_shape(fields: Sequence[FieldType], dialect: str, *, key_fields: Sequence[FieldType] | None = None,
                reserved_columns: Iterable[str] = ()) -> Shape:
    """The shape of ``fields`` (and the key ``key_fields``; None or empty: no key) in ``dialect``. Raises
    :class:`SchemaIncompatible` for a field name that cannot be a column or two fields of one name."""
    reserved = tuple(reserved_columns)
    key_names = [f.name for f in key_fields or ()]
    by_name = {f.name: f for f in fields}
    columns: list[Column] = []
    seen: set[str] = set()

    def add(f: FieldType, *, key: bool, from_key: bool) -> None:
        name = check_column(f.name, dialect, reserved=reserved)
        if name in seen:
            raise SchemaIncompatible("bad_column_name", f"field {name!r} appears twice")
        seen.add(name)
        columns.append(_column(name, f.logical, f.nullable and not key, dialect, from_key=from_key))

    for kf in key_fields or ():
        if kf.name not in by_name:
            add(kf, key=True, from_key=True)
    for f in fields:
        add(f, key=f.name in key_names, from_key=False)
    return Shape(dialect, tuple(columns), tuple(key_names))


def _column(name: str, logical: Logical, nullable: bool, dialect: str, *, from_key: bool) -> Column:
    t = column_type(logical, dialect)
    if dialect == CLICKHOUSE and t.startswith("Array("):
        return Column(name, t, False, "[]" if nullable else None, from_key)
    return Column(name, t, nullable, None, from_key)


# --------------------------------------------------------------------------- union


def union(shapes: Sequence[Shape]) -> Shape:
    """The one shape for a batch of records of ``shapes`` (see the module docstring). ValueError for no
    shapes or shapes of two dialects; :class:`SchemaIncompatible` when they cannot be one table."""
    if not shapes:
        raise ValueError("union of no shapes")
    dialect = shapes[0].dialect
    if any(s.dialect != dialect for s in shapes):
        raise ValueError("union of shapes of different dialects")
    keys = {frozenset(s.key) for s in shapes}
    if len(keys) > 1:
        raise SchemaIncompatible("key_changed", "the batch's schemas name different keys: "
                                 + " / ".join(sorted(repr(list(s.key)) for s in {s.key: s for s in shapes}.values())))
    merged: dict[str, Column] = {}
    for s in shapes:
        for c in s.columns:
            have = merged.get(c.name)
            if have is None:
                merged[c.name] = c
                continue
            if accepts(have.type, c.type, dialect):
                t = have.type
            elif accepts(c.type, have.type, dialect):
                t = c.type
            else:
                raise SchemaIncompatible("batch_types_differ", f"column {c.name!r} is {have.type} in one schema of "
                                                               f"the batch and {c.type} in another")
            merged[c.name] = Column(c.name, t, have.nullable or c.nullable, have.default or c.default,
                                    have.from_key and c.from_key)
    everywhere = set.intersection(*(set(s.names) for s in shapes))
    key = shapes[0].key
    columns = []
    for c in merged.values():
        nullable = c.nullable or (c.name not in everywhere and c.name not in key)
        if nullable and dialect == CLICKHOUSE and c.type.startswith("Array("):
            columns.append(Column(c.name, c.type, False, c.default or "[]", c.from_key))
        else:
            columns.append(Column(c.name, c.type, nullable, c.default, c.from_key))
    return Shape(dialect, tuple(columns), key)


# --------------------------------------------------------------------------- Avro

_AVRO_PRIMITIVES = {
    "boolean": Logical("boolean"), "int": Logical("int32"), "long": Logical("int64"), "float": Logical("float32"),
    "double": Logical("float64"), "bytes": Logical("bytes"), "string": Logical("string"),
}
_AVRO_TIMESTAMPS = {
    "timestamp-millis": ("timestamptz", 3), "timestamp-micros": ("timestamptz", 6),
    "timestamp-nanos": ("timestamptz", 9), "local-timestamp-millis": ("timestamp", 3),
    "local-timestamp-micros": ("timestamp", 6), "local-timestamp-nanos": ("timestamp", 9),
}


class _Avro:
    """Walks one Avro schema, remembering named types (by full and short name) as it meets them."""

    def __init__(self) -> None:
        self.named: dict[str, Any] = {}
        self.walked: set[int] = set()  # records whose fields were walked (recursive types end here)

    def register(self, node: dict[str, Any], namespace: str | None) -> str | None:
        name = node.get("name")
        if not isinstance(name, str):
            return namespace
        ns = node.get("namespace", namespace)
        full = name if "." in name or not ns else f"{ns}.{name}"
        self.named[full] = node
        self.named.setdefault(full.rpartition(".")[2], node)
        return full.rpartition(".")[0] or None

    def lookup(self, name: str, namespace: str | None) -> Any:
        for candidate in (name, f"{namespace}.{name}" if namespace else None, name.rpartition(".")[2]):
            if candidate and candidate in self.named:
                return self.named[candidate]
        raise SchemaIncompatible("unsupported_schema", f"Avro type {name!r} is not defined in the schema")

    def type_of(self, t: Any, namespace: str | None) -> tuple[Logical, bool]:
        """(Logical, nullable) of an Avro type."""
        if isinstance(t, list):
            branches = [b for b in t if b != "null"]
            nullable = len(branches) < len(t)
            if len(branches) == 1:
                logical, inner_nullable = self.type_of(branches[0], namespace)
                return logical, nullable or inner_nullable
            for b in branches:  # register the named types the branches define
                self.type_of(b, namespace)
            if not branches:
                return Logical("string"), True  # only null
            return Logical("json"), nullable  # several branches: the value as JSON
        if isinstance(t, str):
            if t == "null":
                return Logical("string"), True
            if t in _AVRO_PRIMITIVES:
                return _AVRO_PRIMITIVES[t], False
            return self.type_of(self.lookup(t, namespace), namespace)
        if not isinstance(t, dict):
            raise SchemaIncompatible("unsupported_schema", f"not an Avro type: {t!r}")
        typ = t.get("type")
        if isinstance(typ, (list, dict)):
            return self.type_of(typ, namespace)
        logical = t.get("logicalType")
        if typ in ("record", "error", "enum", "fixed"):
            namespace_inner = self.register(t, namespace)
            if typ in ("record", "error") and id(t) not in self.walked:
                self.walked.add(id(t))
                for f in t.get("fields", ()):
                    self.type_of(f["type"], namespace_inner)
        if logical == "decimal" and typ in ("bytes", "fixed"):
            return Logical("decimal", int(t.get("precision", 0)) or None, int(t.get("scale", 0))), False
        if logical == "uuid" and typ in ("string", "fixed"):
            return Logical("uuid"), False
        if logical == "date" and typ == "int":
            return Logical("date"), False
        if logical in ("time-millis", "time-micros") and typ in ("int", "long"):
            return Logical("time"), False
        if logical in _AVRO_TIMESTAMPS and typ == "long":
            kind, precision = _AVRO_TIMESTAMPS[logical]
            return Logical(kind, precision), False
        if typ in ("record", "error", "map"):
            return Logical("json"), False
        if typ == "enum":
            return Logical("enum"), False
        if typ == "fixed":
            return Logical("bytes"), False
        if typ == "array":
            item, item_nullable = self.type_of(t.get("items"), namespace)
            return Logical("array", item=item, item_nullable=item_nullable), False
        if isinstance(typ, str):
            return self.type_of(typ, namespace)
        raise SchemaIncompatible("unsupported_schema", f"not an Avro type: {t!r}")

    def record_fields(self, t: Any, namespace: str | None = None) -> list[FieldType] | None:
        """The fields of a record schema (after resolving names and a union with null), or None."""
        if isinstance(t, list):
            branches = [b for b in t if b != "null"]
            return self.record_fields(branches[0], namespace) if len(branches) == 1 else None
        if isinstance(t, str):
            if t in _AVRO_PRIMITIVES or t == "null":
                return None
            return self.record_fields(self.lookup(t, namespace), namespace)
        if not isinstance(t, dict) or t.get("type") not in ("record", "error"):
            return None
        inner_ns = self.register(t, namespace)
        self.walked.add(id(t))
        out = []
        for f in t.get("fields", ()):
            logical, nullable = self.type_of(f["type"], inner_ns)
            out.append(FieldType(f["name"], logical, nullable))
        return out

    def field_schema(self, record: dict[str, Any], name: str) -> Any:
        for f in record.get("fields", ()):
            if f.get("name") == name:
                return f["type"]
        return None


def _avro_json(schema: Any) -> Any:
    """Schema text parsed, a bare type name (``"string"``) kept, anything else as it is."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except ValueError:
        return schema


def shape_from_avro(schema: Any, dialect: str, *, key_schema: Any = None, envelope: bool = False,
                    reserved_columns: Iterable[str] = ()) -> Shape:
    """The shape of an Avro record schema (see the module docstring); ``envelope``: a Debezium change
    event's schema, whose ``after`` record gives the columns. Raises :class:`SchemaIncompatible`
    (reason ``unsupported_schema``) for a schema that is not a record (or an envelope without ``after``)."""
    walker = _Avro()
    root = _avro_json(schema)
    if envelope:
        if not isinstance(root, dict) or root.get("type") not in ("record", "error"):
            raise SchemaIncompatible("unsupported_schema", "a change event's Avro schema must be a record")
        walker.record_fields(root)  # registers the row record, defined in 'before'
        root = walker.field_schema(root, "after")
    fields = walker.record_fields(root)
    if fields is None:
        raise SchemaIncompatible("unsupported_schema", "the Avro schema is not a record (or has no 'after' record)")
    key_fields = _Avro().record_fields(_avro_json(key_schema)) if key_schema is not None else None
    return build_shape(fields, dialect, key_fields=key_fields, reserved_columns=reserved_columns)


# --------------------------------------------------------------------------- Protobuf

_PROTO_WRAPPERS = {
    "google.protobuf.DoubleValue": Logical("float64"), "google.protobuf.FloatValue": Logical("float32"),
    "google.protobuf.Int64Value": Logical("int64"), "google.protobuf.UInt64Value": Logical("uint64"),
    "google.protobuf.Int32Value": Logical("int32"), "google.protobuf.UInt32Value": Logical("uint32"),
    "google.protobuf.BoolValue": Logical("boolean"), "google.protobuf.StringValue": Logical("string"),
    "google.protobuf.BytesValue": Logical("bytes"),
}
_PROTO_MESSAGES = {
    "google.protobuf.Timestamp": Logical("timestamptz", 6), "google.protobuf.Duration": Logical("interval"),
    "google.protobuf.Struct": Logical("json"), "google.protobuf.Value": Logical("json"),
    "google.protobuf.ListValue": Logical("json"),
}


def _proto_scalar(f: Any) -> Logical:
    from google.protobuf.descriptor import FieldDescriptor as FD

    t = f.type
    if t == FD.TYPE_MESSAGE or t == FD.TYPE_GROUP:
        name = f.message_type.full_name
        return _PROTO_WRAPPERS.get(name) or _PROTO_MESSAGES.get(name) or Logical("json")
    table = {
        FD.TYPE_DOUBLE: "float64", FD.TYPE_FLOAT: "float32", FD.TYPE_INT64: "int64", FD.TYPE_SINT64: "int64",
        FD.TYPE_SFIXED64: "int64", FD.TYPE_UINT64: "uint64", FD.TYPE_FIXED64: "uint64", FD.TYPE_INT32: "int32",
        FD.TYPE_SINT32: "int32", FD.TYPE_SFIXED32: "int32", FD.TYPE_UINT32: "uint32", FD.TYPE_FIXED32: "uint32",
        FD.TYPE_BOOL: "boolean", FD.TYPE_STRING: "string", FD.TYPE_BYTES: "bytes", FD.TYPE_ENUM: "enum",
    }
    return Logical(table[t])


def _proto_fields(descriptor: Any) -> list[FieldType]:
    from google.protobuf.descriptor import FieldDescriptor as FD

    out = []
    for f in descriptor.fields:
        repeated = getattr(f, "is_repeated", None)
        if repeated is None:  # protobuf before 5.x
            repeated = f.label == FD.LABEL_REPEATED
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out.append(FieldType(f.name, Logical("json"), False))  # a map: {} when empty
        elif repeated:
            out.append(FieldType(f.name, Logical("array", item=_proto_scalar(f)), False))
        else:
            # presence: optional scalars, messages (wrappers too), oneof members; a proto3 scalar
            # without it is always there (its zero value)
            out.append(FieldType(f.name, _proto_scalar(f), bool(f.has_presence)))
    return out


def shape_from_protobuf(descriptor: Any, dialect: str, *, key_descriptor: Any = None,
                        reserved_columns: Iterable[str] = ()) -> Shape:
    """The shape of a Protobuf message (see the module docstring and the type map)."""
    key_fields = _proto_fields(key_descriptor) if key_descriptor is not None else None
    return build_shape(_proto_fields(descriptor), dialect, key_fields=key_fields, reserved_columns=reserved_columns)


# --------------------------------------------------------------------------- JSON Schema

_JS_FORMATS = {"date-time": Logical("timestamptz", 6), "date": Logical("date"), "time": Logical("time"),
               "uuid": Logical("uuid")}
_CONNECT_INTS = {"int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64"}


class _JsonSchema:
    def __init__(self, root: Any) -> None:
        self.root = root

    def resolve(self, node: Any) -> Any:
        seen = 0
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            seen += 1
            if seen > 32:
                raise SchemaIncompatible("unsupported_schema", "JSON Schema $ref chain too deep (a cycle?)")
            target: Any = self.root
            for part in node["$ref"].lstrip("#").strip("/").split("/"):
                if part:
                    key = part.replace("~1", "/").replace("~0", "~")
                    target = target.get(key) if isinstance(target, dict) else None
            node = target
        return node

    def type_of(self, node: Any) -> tuple[Logical, bool]:
        node = self.resolve(node)
        if node is True or node is None or node == {}:
            return Logical("json"), True
        if not isinstance(node, dict):
            return Logical("json"), True
        for combinator in ("anyOf", "oneOf"):
            branches = node.get(combinator)
            if isinstance(branches, list):
                real = [b for b in branches if self.resolve(b) not in ({"type": "null"},)]
                nullable = len(real) < len(branches)
                if len(real) == 1:
                    logical, inner = self.type_of(real[0])
                    return logical, nullable or inner
                return Logical("json"), True
        t = node.get("type")
        nullable = False
        if isinstance(t, list):
            real_types = [x for x in t if x != "null"]
            nullable = len(real_types) < len(t)
            if len(real_types) != 1:
                return Logical("json" if real_types else "string"), True
            t = real_types[0]
        if t is None and isinstance(node.get("enum"), list) and all(isinstance(v, str) for v in node["enum"]):
            return Logical("enum"), nullable
        connect = node.get("connect.type")
        if t == "integer":
            return Logical(_CONNECT_INTS.get(connect, "int64")), nullable
        if t == "number":
            return Logical("float32" if connect == "float32" else "float64"), nullable
        if t == "string":
            if connect == "bytes" or node.get("contentEncoding") == "base64":
                return Logical("bytes"), nullable
            if node.get("format") in _JS_FORMATS:
                return _JS_FORMATS[node["format"]], nullable
            return Logical("enum" if isinstance(node.get("enum"), list) else "string"), nullable
        if t == "boolean":
            return Logical("boolean"), nullable
        if t == "null":
            return Logical("string"), True
        if t == "array":
            items = node.get("items")
            if isinstance(items, dict):
                item, item_nullable = self.type_of(items)
                return Logical("array", item=item, item_nullable=item_nullable), nullable
            return Logical("array", item=Logical("json"), item_nullable=True), nullable
        return Logical("json"), nullable  # object, or no type

    def fields(self, node: Any) -> list[FieldType]:
        node = self.resolve(node)
        if not isinstance(node, dict) or not isinstance(node.get("properties"), dict):
            raise SchemaIncompatible("unsupported_schema", "the JSON Schema is not an object with properties")
        required = set(node.get("required") or ())
        out = []
        for name, prop in node["properties"].items():
            logical, nullable = self.type_of(prop)
            out.append(FieldType(name, logical, nullable or name not in required))
        return out


def shape_from_json_schema(schema: Any, dialect: str, *, key_schema: Any = None,
                           reserved_columns: Iterable[str] = ()) -> Shape:
    """The shape of a JSON Schema object (JSON text or a dict). Confluent's ``connect.type`` hints
    (``int32``, ``float32``, ``bytes``, ...) are honoured."""
    root = json.loads(schema) if isinstance(schema, str) else schema
    key_fields = None
    if key_schema is not None:
        key_root = json.loads(key_schema) if isinstance(key_schema, str) else key_schema
        try:
            key_fields = _JsonSchema(key_root).fields(key_root)
        except SchemaIncompatible:
            key_fields = None  # a scalar key names no column
    return build_shape(_JsonSchema(root).fields(root), dialect, key_fields=key_fields,
                       reserved_columns=reserved_columns)


# --------------------------------------------------------------------------- Kafka Connect (Debezium JSON)

_DECIMAL = "org.apache.kafka.connect.data.Decimal"
_CONNECT_NAMES: dict[str, Logical] = {
    "io.debezium.data.VariableScaleDecimal": Logical("decimal"),
    "org.apache.kafka.connect.data.Date": Logical("date"), "io.debezium.time.Date": Logical("date"),
    "org.apache.kafka.connect.data.Time": Logical("time"), "io.debezium.time.Time": Logical("time"),
    "io.debezium.time.MicroTime": Logical("time"),
    "io.debezium.time.NanoTime": Logical("int64"),  # ns since midnight, not converted by ingest.cdc.debezium
    "org.apache.kafka.connect.data.Timestamp": Logical("timestamp", 3),
    "io.debezium.time.Timestamp": Logical("timestamp", 3),
    "io.debezium.time.MicroTimestamp": Logical("timestamp", 6),
    "io.debezium.time.NanoTimestamp": Logical("timestamp", 6),  # decoded to the microsecond
    "io.debezium.time.ZonedTimestamp": Logical("timestamptz", 6),
    "io.debezium.time.ZonedTime": Logical("string"),
    "io.debezium.data.Json": Logical("string"),  # JSON text, kept as text (see the type map)
    "io.debezium.data.Uuid": Logical("uuid"),
    "io.debezium.data.Enum": Logical("enum"), "io.debezium.data.EnumSet": Logical("enum"),
    "io.debezium.data.Bits": Logical("bytes"),
    "io.debezium.data.Xml": Logical("string"),
}
_CONNECT_TYPES = {
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "float32": "float32",
    "float64": "float64", "boolean": "boolean", "string": "string", "bytes": "bytes", "struct": "json",
    "map": "json",
}


def _connect_type(s: Mapping[str, Any]) -> Logical:
    name = s.get("name")
    if name == _DECIMAL:
        params = s.get("parameters") or {}
        scale = int(params.get("scale", 0))
        precision = params.get("connect.decimal.precision")
        return Logical("decimal", int(precision) if precision is not None else None, scale)
    if isinstance(name, str):
        if name in _CONNECT_NAMES:
            return _CONNECT_NAMES[name]
        if name.startswith("io.debezium.data.geometry."):
            return Logical("json")  # {wkb: base64, srid}
    t = s.get("type")
    if t == "array":
        items = s.get("items")
        if not isinstance(items, Mapping):
            return Logical("array", item=Logical("json"), item_nullable=True)
        return Logical("array", item=_connect_type(items), item_nullable=bool(items.get("optional", False)))
    if t in _CONNECT_TYPES:
        return Logical(_CONNECT_TYPES[t])
    raise SchemaIncompatible("unsupported_schema", f"Kafka Connect type {t!r} is not one of int8..int64, "
                                                   "float32/64, boolean, string, bytes, struct, array, map")


def _connect_fields(struct: Any) -> list[FieldType]:
    if not isinstance(struct, Mapping) or struct.get("type") != "struct" or not isinstance(struct.get("fields"), list):
        raise SchemaIncompatible("unsupported_schema", "the Kafka Connect schema is not a struct with fields")
    return [FieldType(f["field"], _connect_type(f), bool(f.get("optional", False))) for f in struct["fields"]]


def shape_from_connect(schema: Mapping[str, Any], dialect: str, *, key_schema: Mapping[str, Any] | None = None,
                       envelope: bool = True, reserved_columns: Iterable[str] = ()) -> Shape:
    """The shape of a Kafka Connect schema part (Debezium's JSON converter, ``schemas.enable=true``):
    with ``envelope`` the ``after`` struct of a change event's envelope. ``key_schema``: the record key's
    schema part (a struct: the primary key)."""
    struct: Any = schema
    if envelope:
        fields = schema.get("fields") if isinstance(schema, Mapping) else None
        struct = next((f for f in fields or () if isinstance(f, Mapping) and f.get("field") == "after"), None)
        if struct is None:
            raise SchemaIncompatible("unsupported_schema", "the change event's schema has no 'after' struct")
    key_fields = None
    if isinstance(key_schema, Mapping) and key_schema.get("type") == "struct":
        key_fields = _connect_fields(key_schema)
    return build_shape(_connect_fields(struct), dialect, key_fields=key_fields, reserved_columns=reserved_columns)
