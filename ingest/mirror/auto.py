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
- ``version``, only with the sink's ``version:`` or a ``tables:`` entry's ``version_column``: the
  record's version -- the sink's (``@source.lsn``, ...), or its table's own column's as
  :class:`TableVersion` holds it (0 for a table without either) -- collapse keeps the highest, and the
  sink never applies an older one (PostgreSQL: the upsert's guard; ClickHouse: the table's
  ``ReplacingMergeTree`` version). The sink writes :func:`version_value` of it.

A delete is a :class:`~ingest.types.DeleteRow` carrier whose ``values`` is None (its key and source
only): a soft delete that collapse merges with an earlier upsert takes that upsert's values, which
carry their own shape.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any

import orjson

from ingest.cdc.debezium import _PAYLOAD_KEY, _SCHEMA_HEAD, SchemaParts, unwrap, unwrap_key
from ingest.core.dialects import ch_version_refusal
from ingest.core.mapping.common import _Bad
from ingest.core.routing import stream_id
from ingest.errors import IngestError, InvalidRecord, NoChange
from ingest.formats import wire
from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.names import CLICKHOUSE, check_column
from ingest.mirror.shape import Column, Shape, shape_from_avro, shape_from_connect, shape_from_json_schema, shape_from_protobuf
from ingest.types import DeleteRow, Record

__all__ = ["AutoMapper", "CARRIER_KEY", "RowShape", "ShapedValues", "TableRules", "carrier_columns", "carrier_values",
           "TableVersion", "override_for", "table_override", "version_value"]

#: The carrier columns (see the module docstring); the sink adds its hidden source columns after them.
CARRIER_KEY, CARRIER_SHAPE, CARRIER_VALUES = "_ingest_key", "_ingest_shape", "_ingest_values"
#: The carrier's version (``version:`` of the sink), after the source columns when there is one.
CARRIER_VERSION = "_ingest_version"
KEY_AT, SHAPE_AT, VALUES_AT, STREAM_AT, OFFSET_AT, VERSION_AT = 0, 1, 2, 3, 4, 5
#: The formats whose schemas it reads: Connect JSON with schema parts, and the registry's.
FORMATS = ("json", "avro", "json_schema", "protobuf")
#: The types a table's own version column may have (PostgreSQL and ClickHouse spellings): ordered values.
_ORDERABLE = re.compile(r"(?i)^(smallint|integer|bigint|numeric|decimal|real|double precision|timestamptz|timestamp"
                        r"|date|text|varchar|character varying|u?int\d+|float\d+|decimal\d*|datetime\d*|date\d*"
                        r"|string|fixedstring)\b")
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
    positions. Compared by identity: one object per distinct schema (the mapper's cache).

    ``given``: the columns whose values a ``tables:`` entry sources (:class:`TableRules`), in the order
    of the values :meth:`values` is handed (already coerced); ``version``: the table's own version
    column (a ``tables:`` entry's ``version_column``), or None."""

    __slots__ = ("shape", "names", "_plan", "key_positions", "version_position")

    def __init__(self, shape: Shape, coercer: Callable[[str, bool], Any], given: Sequence[str] = (),
                 version: str | None = None) -> None:
        """``coercer(type, nullable) -> (coerce, required)``: the mapper's coercer of a column type."""
        self.shape = shape
        self.names = shape.names
        self._plan = tuple((c.name, c.from_key, *coercer(c.type, c.nullable),
                            given.index(c.name) if c.name in given else -1) for c in shape.columns)
        self.key_positions = tuple(self.names.index(k) for k in shape.key)
        self.version_position = self.names.index(version) if version is not None else None

    def values(self, image: Any, key_doc: Any, given: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """The values of ``image`` (a row image, a dict) in column order; key columns the value lacks from
        ``key_doc``; sourced columns from ``given``. Raises InvalidRecord naming the column."""
        if type(image) is not dict:
            raise InvalidRecord("map", "not_an_object", f"the row image is not a record: {str(image)[:80]}")
        out = []
        name = ""
        try:
            for name, from_key, coerce, required, given_at in self._plan:
                if given_at >= 0:
                    raw = given[given_at]
                    if raw is None and required:
                        raise _Bad("missing_field", "required value is missing or null")
                    out.append(raw)
                    continue
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

    def key_values(self, image: Any, key_doc: Any, given: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """The key columns' values of a delete's image (or of the record key), in key order."""
        return tuple(self.value_at(position, image, key_doc, given, "a delete without key column")
                     for position in self.key_positions)

    def value_at(self, position: int, image: Any, key_doc: Any, given: tuple[Any, ...], lacking: str) -> Any:
        """One column's value of a delete's image (or of the record key, or ``given``); raises
        InvalidRecord (``missing_field``: ``lacking`` and the column's name) when there is none."""
        name, from_key, coerce, _required, given_at = self._plan[position]
        if given_at >= 0:
            raw = given[given_at] if given_at < len(given) else None
            if raw is None:
                raise InvalidRecord("map", "missing_field", f"{lacking} {name!r}")
            return raw
        source = key_doc if from_key or type(image) is not dict else image
        raw = source.get(name) if type(source) is dict else None
        if raw is None and type(key_doc) is dict:
            raw = key_doc.get(name)
        if raw is None:
            raise InvalidRecord("map", "missing_field", f"{lacking} {name!r}")
        try:
            return coerce(raw)
        except _Bad as exc:
            raise InvalidRecord("map", exc.error_class, f"column {name!r}: {exc.detail}") from None
        except Exception as exc:  # noqa: BLE001
            raise InvalidRecord("map", "invalid_value", f"column {name!r}: {type(exc).__name__}: {exc}"[:300]) from None


class TableRules:
    """A ``tables:`` entry as the mapper applies it (:func:`override_for` finds it for a table): the
    sourced columns' mapper, the table's own version column, the soft-delete column its fields may not
    take."""

    __slots__ = ("pattern", "override", "sourced", "_mapper", "_reads_source", "version", "soft_column")

    def __init__(self, pattern: str, override: Any, soft_column: str | None,
                 sourced_mapper: Callable[[dict[str, tuple[str, str]]], Any]) -> None:
        """``soft_column``: the pipeline's (None: hard deletes or none); ``sourced_mapper({column:
        (type, source)})``: a row mapper of those columns (``$`` paths read the document it is handed)."""
        self.pattern = pattern
        self.override = override
        columns = getattr(override, "columns", {}) or {}
        self.sourced = tuple(name for name, c in columns.items() if getattr(c, "source", None))
        specs = {name: (columns[name].type, _doc_source(columns[name].source)) for name in self.sourced}
        self._mapper = sourced_mapper(specs) if specs else None
        self._reads_source = any(c.source.startswith("@source.") for n, c in columns.items() if n in self.sourced)
        self.version = getattr(override, "version_column", None)
        deletes = getattr(override, "deletes", None)
        self.soft_column = soft_column if deletes is None else (deletes.soft_column if deletes.mode == "soft" else None)

    def given(self, record: Record, image: Any, source: Any) -> tuple[Any, ...]:
        """The sourced columns' values of ``record`` (its row image ``image``, a change's source block
        ``source``), coerced; raises InvalidRecord naming the column."""
        if self._mapper is None:
            return ()
        if self._reads_source:
            doc = {**(image if type(image) is dict else {}), "@source": source}
        else:
            doc = image if image is not None else {}
        return self._mapper.map_document(record, doc)[0]


@functools.total_ordering
class TableVersion:
    """A table's own version value in the carrier's version slot: ``value`` is what the sink writes (as
    the row mapper coerced it), ``key`` what collapse compares -- ``(rank, value)``, so that values of one
    column that two schemas typed differently (a number, a timestamp) still compare (collapse sorts them
    before the sink sees that the schemas disagree), and a naive timestamp compares as UTC."""

    __slots__ = ("key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        if isinstance(value, datetime):
            self.key: tuple[int, Any] = (1, value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc))
        elif isinstance(value, date):
            self.key = (2, value)
        elif isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
            self.key = (0, value)
        else:
            self.key = (3, value)  # text (_ORDERABLE admits no other type)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TableVersion) and self.key == other.key

    def __lt__(self, other: TableVersion) -> bool:
        return self.key < other.key

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TableVersion({self.value!r})"


def version_value(version: Any) -> Any:
    """What the sink writes of a carrier's version: a table's own version's value (:class:`TableVersion`),
    else the sink's ``version:`` value as it is."""
    return version.value if type(version) is TableVersion else version


def table_override(table: str, overrides: Sequence[tuple[str, Any]]) -> Any:
    """The ``tables:`` entry of ``table`` (:func:`override_for`'s entry alone), or None."""
    found = override_for(table, overrides) if overrides else None
    return found[1] if found is not None else None


def override_for(table: str, overrides: Sequence[tuple[str, Any]]) -> tuple[str, Any] | None:
    """The ``tables:`` entry of ``table`` among ``(name or glob, entry)``: the one named exactly as the
    table, else the first glob (in the order written) that matches it; None when none does."""
    return next(((p, o) for p, o in overrides if p == table), None) or \
        next(((p, o) for p, o in overrides if fnmatch.fnmatchcase(table, p)), None)


def _doc_source(source: str) -> str:
    """A sourced column's source as the row mapper reads it from :meth:`TableRules.given`'s document:
    ``@source.PATH`` becomes the document's ``@source`` entry; ``$`` paths and metadata stay."""
    return "$." + source if source.startswith("@source.") else source


@dataclass(frozen=True, slots=True, eq=False)
class ShapedValues:
    """A record's values with the shape they are ordered by."""

    shape: RowShape
    values: tuple[Any, ...]


class AutoMapper:
    """Records → carrier rows (see the module docstring). One thread (the pipeline's, or replay's)."""

    def __init__(self, *, dialect: str, envelope: str, fmt: str, decoder: Any, key_decoder: Any,
                 coercer: Callable[[str, bool], Any], tombstones: str, truncate: str,
                 reserved_columns: tuple[str, ...] = (), soft_column: str | None = None, version: Any = None,
                 router: Any = None, overrides: Sequence[tuple[str, Any]] = (),
                 sourced_mapper: Callable[[dict[str, tuple[str, str]]], Any] | None = None) -> None:
        """``fmt``: ``json`` (Kafka Connect schema parts) or ``avro`` (the registry's writer schemas);
        ``decoder`` / ``key_decoder``: the pipeline's value and key decoders (None: JSON);
        ``tombstones`` / ``truncate``: the pipeline's settings of those names; ``reserved_columns``: names
        no field may take (besides ``soft_column``, the pipeline's soft-delete column, which a table's
        entry may change); ``version``: a ``map_document(record, {"@source": source block}) -> ((version,),
        _)`` mapper of the sink's ``version:``, or None. ``router``: the pipeline's
        :class:`~ingest.mirror.router.TableRouter` (the table is appended to each carrier); ``overrides``:
        ``(name or glob, TableOverride)`` of the sink's ``tables:`` (:func:`override_for`), whose sourced
        columns ``sourced_mapper`` maps (see :class:`TableRules`). The carriers have a version when
        ``version`` is given or an entry names a ``version_column``: a table without one gets 0 there."""
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
        self._soft = soft_column
        self._shapes: dict[Any, RowShape] = {}
        self._version = version
        #: Connect JSON change events: each distinct schema part parsed once (ingest.cdc.debezium)
        self._parts = SchemaParts(orjson.loads) if fmt == "json" and self._debezium and decoder is None else None
        self.router = router
        self._overrides = tuple(overrides)
        self._sourced_mapper = sourced_mapper
        self._rules: dict[str, TableRules] = {}  # by pattern
        self._rules_of: dict[str, TableRules | None] = {}  # by table
        #: the carriers' version slot: the sink's version:, or a table's own version_column (others: 0)
        self._versioned = version is not None or any(getattr(o, "version_column", None) for _, o in self._overrides)
        self.column_names = [CARRIER_KEY, CARRIER_SHAPE, CARRIER_VALUES, "_ingest_stream", "_ingest_offset",
                             *([CARRIER_VERSION] if self._versioned else []),
                             *(["_ingest_table"] if router is not None else [])]
        self.column_types = ["text", "text", "text", "bigint", "bigint", *(["bigint"] if self._versioned else []),
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
        rules = self._rules_for(table) if self._overrides and table is not None else None
        if rules is not None:
            cache_key = (*cache_key, rules.pattern)
        shape = self._shapes.get(cache_key)
        if shape is None:
            if schema is None:  # the fast path's schema part, with a key or override not seen with it yet
                schema = orjson.loads(record.value)["schema"]  # type: ignore[arg-type]
            shape = self._shape(cache_key, schema, key_token, rules)
        position = record.source_position
        stream, offset = stream_id(position[0], position[1]), position[2]
        source = change.source if change is not None else None
        deletes = change is not None and change.op == "d"
        row_image = (change.before if deletes else change.after) if change is not None else image
        if deletes and not shape.key_positions:
            raise NoChange("a delete in a table without a key: nothing to delete by")
        given = rules.given(record, row_image, source) if rules is not None and rules.sourced else ()
        if deletes:
            values = None
            key = shape.key_values(row_image, key_doc, given)
        else:
            values = shape.values(row_image, key_doc, given)
            key = self._key_of(shape, values, stream, offset)
        tail: tuple[Any, ...] = (stream, offset)
        if shape.version_position is not None:  # the table's own version column
            version = values[shape.version_position] if values is not None else \
                shape.value_at(shape.version_position, row_image, key_doc, given, "a delete without version column")
            if version is None:
                raise InvalidRecord("map", "missing_field", f"version column {shape.names[shape.version_position]!r}: "
                                    "required value is missing or null")
            tail += (TableVersion(version),)
        elif self._version is not None:
            tail += self._version.map_document(record, {"@source": source} if source is not None else {})[0]
        elif self._versioned:
            tail += (0,)  # a table without a version among tables with one: the last record wins
        if table is not None:
            tail += (table,)
        if values is None:
            return DeleteRow((key, shape, None, *tail)), record.key
        return (key, shape, ShapedValues(shape, values), *tail), record.key

    def table_shape(self, table: str, value_ref: Any, key_ref: Any = None) -> Shape:
        """The shape ``table`` gets from the registry schema ``value_ref`` (its latest version, say) keyed
        by ``key_ref`` (a registry key schema; None: no key), its ``tables:`` override applied -- what
        ``ingest migrate`` and ``ingest check`` plan from. Registry formats only (ValueError for json);
        raises SchemaIncompatible like a record of that schema."""
        if self._fmt == "json":
            raise ValueError("Kafka Connect JSON carries its schema in each record")
        value = (value_ref, (0,) if self._fmt == "protobuf" else ())
        key = ("registry", (key_ref, (0,) if self._key_protobuf else ())) if key_ref is not None else None
        rules = self._rules_for(table) if self._overrides else None
        return self._shape(("plan", value, key, rules.pattern if rules else None), value, key, rules).shape

    def _rules_for(self, table: str) -> TableRules | None:
        """The ``tables:`` entry of ``table`` as :class:`TableRules` (None: the table has none)."""
        if table in self._rules_of:
            return self._rules_of[table]
        found = override_for(table, self._overrides)
        rules = None
        if found is not None:
            rules = self._rules.get(found[0])
            if rules is None:
                rules = self._rules[found[0]] = TableRules(found[0], found[1], self._soft, self._make_sourced)
        self._rules_of[table] = rules
        return rules

    def _make_sourced(self, specs: dict[str, tuple[str, str]]) -> Any:
        if self._sourced_mapper is None:
            raise ValueError("tables: sourced columns need the pipeline's mapper of them")
        return self._sourced_mapper(specs)

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

    def _shape(self, cache_key: Any, schema: Any, key_token: Any, rules: TableRules | None = None) -> RowShape:
        soft = rules.soft_column if rules is not None else self._soft
        try:
            shape = self._read_shape(schema, key_token, (*self._reserved, *([soft] if soft else [])))
            if key_token is not None and key_token[0] == "names":
                shape = _keyed_by(shape, key_token[1])
            if rules is not None:
                shape = _overridden(shape, rules)
        except SchemaIncompatible:
            raise
        except Exception as exc:  # noqa: BLE001 - a malformed schema is the record's fault
            raise SchemaIncompatible("unsupported_schema",
                                     f"its schema cannot be read: {type(exc).__name__}: {exc}"[:300]) from None
        if len(self._shapes) >= SHAPE_CACHE_SIZE:
            self._shapes.clear()
        row_shape = self._shapes[cache_key] = RowShape(shape, self._coercer, rules.sourced if rules else (),
                                                       rules.version if rules and shape.key else None)
        return row_shape

    def _read_shape(self, schema: Any, key_token: Any, reserved: tuple[str, ...]) -> Shape:
        """The shape of the value schema ``schema`` (a Connect schema part, or the registry ref of the
        value) keyed by the key schema ``key_token`` names; no field may be named as one of ``reserved``."""
        dialect, envelope = self._dialect, self._debezium
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


def _overridden(shape: Shape, rules: TableRules) -> Shape:
    """``shape`` as a ``tables:`` entry says: column types replaced, sourced columns the schema lacks
    added (nullable), the key replaced (``conflict_key``) or removed (``on_conflict: none``: append-only).
    Raises SchemaIncompatible for a key or version column the table would not have."""
    override = rules.override
    columns = [dataclasses.replace(c, type=override.columns[c.name].type) if c.name in override.columns
               else c for c in shape.columns]
    have = {c.name for c in columns}
    columns += [Column(check_column(name, shape.dialect), override.columns[name].type, True)
                for name in rules.sourced if name not in have]
    shape = Shape(shape.dialect, tuple(columns), shape.key)
    if override.on_conflict == "none":
        return Shape(shape.dialect, shape.columns, ())
    if override.conflict_key:
        shape = _keyed_by(Shape(shape.dialect, shape.columns, ()), tuple(override.conflict_key))
    version = shape.column(rules.version) if rules.version is not None and shape.key else None
    if rules.version is not None and shape.key and version is None:
        raise SchemaIncompatible("version_unknown", f"the version column {rules.version!r} is neither a field of "
                                 "the schema nor a sourced column")
    if version is not None and (not _ORDERABLE.match(version.type) or "[" in version.type):
        raise SchemaIncompatible("version_type", f"the version column {rules.version!r} is {version.type}: a "
                                 "version is a number, a timestamp, a date or text")
    if version is not None and shape.dialect == CLICKHOUSE:
        shape = _clickhouse_version(shape, version)
    return shape


def _clickhouse_version(shape: Shape, version: Column) -> Shape:
    """``shape`` with its own version column ``version`` as a ClickHouse table takes it: the table's
    ``ReplacingMergeTree`` version, so NOT NULL (a record without a version is poison anyway, and
    ReplacingMergeTree refuses a Nullable one) and of a type ReplacingMergeTree takes -- else
    SchemaIncompatible ``version_type`` (the records are dead-lettered; ``tables.NAME.columns`` can give
    the column such a type)."""
    refusal = ch_version_refusal(version.type)
    if refusal is not None:
        raise SchemaIncompatible("version_type", f"the version column {version.name!r} is {version.type}: "
                                 f"{refusal} (give it such a type in tables.NAME.columns)")
    return Shape(shape.dialect, tuple(dataclasses.replace(c, nullable=False) if c is version else c
                                      for c in shape.columns), shape.key)


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
