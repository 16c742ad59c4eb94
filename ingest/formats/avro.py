"""``format: avro``: Avro binary values, decoded with fastavro against the writer's own schema.

Two ways to know the writer schema:

- from a Schema Registry (the default): each value is in the Confluent wire format
  (:mod:`ingest.formats.wire`) and names its schema id; schemas are fetched once per id and kept
  parsed (:mod:`ingest.formats.schemas`);
- ``avro_schema: FILE``: one writer schema for every record, values are plain Avro binary.

Records are decoded with the schema that wrote them and mapped by field name, so schema
evolution needs no reader schema and no restart: a field added later is read where present, a
removed field is missing (its column's default or NULL, or ``missing_field`` if the column is
required -- the message names the record's schema id), a widened type (int → long, float →
double) is just a number. What fastavro returns, and so what columns receive: records as dicts,
arrays as lists, maps as dicts, enums as their symbol (text), unions as the branch's value
(``null`` → missing), ``bytes``/``fixed`` as bytes, and the logical types as Python values:
``decimal`` → Decimal (its scale kept), ``uuid`` → UUID, ``date`` → date, ``time-millis``/
``time-micros`` → time, ``timestamp-millis``/``-micros`` → aware UTC datetime,
``local-timestamp-*`` → naive datetime.

Poison (stage ``decode``): ``bad_magic_byte``, ``unknown_schema``, and ``schema_mismatch`` for
bytes that do not decode with their schema -- including bytes left over after the record.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastavro import schemaless_reader

from ingest.core.avro_schema import parse_avro_text
from ingest.errors import InvalidRecord
from ingest.formats import wire
from ingest.formats.avro_batch import compile_batch, read_fields
from ingest.formats.registered import RegistryDecoder
from ingest.formats.schemas import SchemaStore
from ingest.types import Record


def parse_avro(schema: Any, store: SchemaStore | None = None) -> Any:
    """A registry ``Schema`` (or schema text) parsed for fastavro, its references fetched from
    ``store``. Raises ValueError when it is not a usable Avro schema."""
    text = schema if isinstance(schema, str) else schema.schema_str
    schema_type = "AVRO" if isinstance(schema, str) else (schema.schema_type or "AVRO")
    if schema_type != "AVRO":
        raise ValueError(f"it is a {schema_type} schema, not Avro")
    named: dict[str, Any] = {}
    for ref in [] if isinstance(schema, str) else (schema.references or []):
        if store is None:
            raise ValueError("it references other schemas, which need a registry")
        parse_schema_named(store.referenced(ref.subject, ref.version), store, named)
    return parse_avro_text(text, named)


def parse_schema_named(schema: Any, store: SchemaStore, named: dict[str, Any]) -> None:
    """Parse a referenced schema into ``named`` (its own references first)."""
    from fastavro import parse_schema

    for ref in schema.references or []:
        parse_schema_named(store.referenced(ref.subject, ref.version), store, named)
    try:
        parse_schema(json.loads(schema.schema_str), named_schemas=named)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"a referenced schema is not valid Avro: {exc}"[:300]) from None


def read(value: bytes | memoryview, schema: Any, what: str | wire.SchemaRef, start: int = 0) -> Any:
    """The Avro datum of ``schema`` in ``value[start:]``; InvalidRecord ``schema_mismatch`` when the
    bytes do not fit it (including bytes left over after it). ``what`` names the schema in errors:
    text, or the schema's id / GUID."""
    buf = io.BytesIO(value)
    if start:
        buf.seek(start)
    try:
        doc = schemaless_reader(buf, schema, None)
    except Exception as exc:  # noqa: BLE001 - EOFError, ValueError, IndexError, UnicodeDecodeError...
        raise _mismatch(what, f"{type(exc).__name__}: {_OBJECT_AT.sub('the record', str(exc))}") from None
    left = len(value) - buf.tell()
    if left:
        raise _mismatch(what, f"{left} bytes left after the record")
    return doc


#: a Python object's repr with its address (fastavro's ``cannot read double from <_io.BytesIO object at
#: 0x7f...>``): not in messages, which must say the same of the same bytes in every run
_OBJECT_AT = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _mismatch(what: str | wire.SchemaRef, why: str) -> InvalidRecord:
    name = what if isinstance(what, str) else wire.ref_text(what)
    return InvalidRecord("decode", "schema_mismatch", f"record value does not decode with {name}: {why}"[:300])


class AvroDecoder(RegistryDecoder):
    """Avro values, with their writer schema from the registry or the ``avro_schema`` file (keys: from
    the registry)."""

    name = "avro"
    document = "an Avro record"
    #: the columnar plan may read this decoder's documents (:meth:`decode_fields`: exactly what
    #: :meth:`decode` gives the row mapper): :class:`ingest.core.mapping.columnar.ColumnarPlan`
    columnar_documents = True
    #: :meth:`decode_fields` takes ``staged`` (the plan's ``documents_stage``)
    stages_logical_types = True
    parse = staticmethod(parse_avro)
    #: for ``ingest check``: can a record of a parsed schema hold a value at a path
    has_path = staticmethod(lambda schema, steps: has_path(schema, steps))

    def __init__(self, pipeline: Any, schema_registry: Any = None, field: wire.Field = "value") -> None:
        self._file_schema: Any = None
        #: batch readers of the writer schemas met so far (:mod:`ingest.formats.avro_batch`), by (schema id
        #: (None: the file schema), the fields read through (None: all)); None where a schema has none
        self._batch_readers: dict[Any, Any] = {}
        path = getattr(pipeline, "avro_schema", None) if field == "value" else None
        if path is None:
            if schema_registry is None:
                raise ValueError("format avro needs a schema_registry section (or avro_schema: FILE)")
            super().__init__(pipeline, schema_registry, field)
            return
        self._field = field
        self._store = None
        try:
            self._file_schema = parse_avro(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"avro_schema {path}: cannot read it: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"avro_schema {path}: {exc}") from None
        self._file_what = f"the avro_schema {Path(path).name}"

    @staticmethod
    def uses_schema_registry(pipeline: Any, field: str = "value") -> bool:
        """Keys always come from the registry; values unless ``avro_schema`` names their schema."""
        return field == "key" or getattr(pipeline, "avro_schema", None) is None

    @property
    def file_schema(self) -> Any:
        """The parsed ``avro_schema`` (None with a registry)."""
        return self._file_schema

    def decode(self, record: Record) -> Any:
        store = self._store
        if self._field == "key":
            assert store is not None
            ref, payload = wire.split(record, "key")
            return read(payload, store.prepared(ref), ref)
        value = record.value
        assert value is not None, "tombstones never reach a decoder"
        if store is None:
            return read(value, self._file_schema, self._file_what)
        if not record.headers and value[:1] == b"\x00" and len(value) >= 5:  # the common case, inline
            ref: wire.SchemaRef = int.from_bytes(value[1:5], "big")
            return read(value, store.prepared(ref), ref, 5)
        ref, payload = wire.split(record)
        return read(payload, store.prepared(ref), ref)

    def decode_fields(self, records: Sequence[Record], keys: Sequence[str],
                      staged: Mapping[str, type] | None = None) -> tuple[list[list[Any]], set[int]]:
        """For the columnar plan: per key of ``keys``, each record's value of that top-level field (None
        where its record lacks it), and the positions of the records whose decode fails or whose
        document is not a record (the row mapper decides them). The values are exactly what
        :meth:`decode` gives: the datums of each writer schema are read together
        (:mod:`ingest.formats.avro_batch`, every datum within its own bytes) where the schema allows,
        and every other or doubtful record is decoded by :meth:`decode`. Raises what :meth:`decode`
        raises but InvalidRecord (a registry that cannot answer).

        ``staged``: keys whose ``decimal`` and ``timestamp-*`` values the caller stages as they are, with
        the types to give them as (:func:`~ingest.formats.avro_batch.compile_batch`): the datums the batch
        reader reads give those instead of ``Decimal`` and ``datetime`` objects (the rest give
        :meth:`decode`'s values)."""
        return self._fields(records, keys, route=False, staged=staged)

    def route_fields(self, records: Sequence[Record], keys: Sequence[str]) -> tuple[list[list[Any]], set[int]]:
        """:meth:`decode_fields` for lane routing: each datum read only up to the last field of ``keys``
        (:func:`~ingest.formats.avro_batch.compile_batch`'s ``through``), so the values are exactly
        :meth:`decode`'s for every record it decodes, and may be anything for a record it refuses (a
        poison record touches no row: its lane does not matter)."""
        return self._fields(records, keys, route=True)

    def _fields(self, records: Sequence[Record], keys: Sequence[str], *, route: bool,
                staged: Mapping[str, type] | None = None) -> tuple[list[list[Any]], set[int]]:
        n = len(records)
        columns: dict[str, list[Any]] = {key: [None] * n for key in keys}
        slow: list[int] = []
        groups: dict[Any, list[int]] = {}
        offset = 5
        if self._field != "value":
            slow = list(range(n))
        elif self._store is None:
            groups[None] = list(range(n))
            offset = 0
        else:
            _, inline, slow = wire.inline_groups(records, 5)
            groups = {head[1:5]: positions for head, positions in inline.items()}
        for raw_ref, positions in groups.items():
            reader = self._batch_reader(None if raw_ref is None else int.from_bytes(raw_ref, "big"),
                                        tuple(keys) if route else None, staged)
            if reader is None:
                slow += positions
                continue
            whole = len(positions) == n
            fields, bad = read_fields(reader, [r.value for r in records] if whole else
                                      [records[i].value for i in positions], offset)
            for key in keys:
                got = fields.get(key)
                if got is None:
                    continue
                if whole:
                    columns[key] = got
                else:
                    column = columns[key]
                    for i, v in zip(positions, got):
                        column[i] = v
            if True in bad:
                slow += [i for i, b in zip(positions, bad) if b]
        rejected: set[int] = set()
        for i in sorted(slow):
            try:
                doc = self.decode(records[i])
            except InvalidRecord:
                doc = None
            if type(doc) is not dict:
                rejected.add(i)
            for key in keys:
                columns[key][i] = doc.get(key) if type(doc) is dict else None
        return [columns[key] for key in keys], rejected

    def _batch_reader(self, ref: Any, through: tuple[str, ...] | None = None,
                      staged: Mapping[str, type] | None = None) -> Any:
        """The batch reader of schema ``ref`` (None: the file schema), of every field or (``through``)
        of the fields up to the last of those, giving ``staged`` fields as those types, or None: decode
        per record (a schema it does not read, or one the registry has not given: :meth:`decode`
        decides)."""
        cache_key = (ref, through, None if not staged else tuple(sorted(staged.items(), key=lambda kv: kv[0])))
        try:
            return self._batch_readers[cache_key]
        except KeyError:
            pass
        if ref is None:
            schema = self._file_schema
        else:
            assert self._store is not None
            try:
                schema = self._store.prepared(ref)
            except Exception:  # noqa: BLE001 - unknown_schema and the like: per record, and not remembered
                return None
        reader = self._batch_readers[cache_key] = compile_batch(schema, through, staged)
        return reader

    def describe(self, record: Record | None) -> str | None:
        """Which schema wrote ``record`` (for map errors), None when it names none."""
        if self._store is None:
            return self._file_what
        return super().describe(record)

    def value_loader(self) -> Any:
        """File schema: a plain bytes → record function; registry: None (the schema id can be in a header,
        which only :meth:`decode` sees)."""
        if self._store is not None:
            return None
        schema = self._file_schema

        def load(value: bytes) -> Any:
            buf = io.BytesIO(value)
            doc = schemaless_reader(buf, schema, None)
            if buf.tell() != len(value):
                raise ValueError("bytes left over")  # decode() reports it
            return doc

        return load


def has_path(schema: Any, steps: Sequence[tuple[bool, str | int]]) -> bool:
    """Whether a record of the parsed Avro ``schema`` can hold a value at the path ``steps`` (the
    mapper's parsed ``$`` path: ``(True, name)`` a field or map key, ``(False, i)`` an array index).
    Unions may hold it in any branch; a map holds any key."""
    named = schema.get("__named_schemas", {}) if isinstance(schema, dict) else {}

    def walk(node: Any, i: int) -> bool:
        if i == len(steps):
            return True
        if isinstance(node, str):
            node = named.get(node, node)
        if isinstance(node, list):
            return any(walk(branch, i) for branch in node)
        if not isinstance(node, dict):
            return False
        is_key, step = steps[i]
        kind = node.get("type")
        if isinstance(kind, (dict, list)) or (isinstance(kind, str) and kind in named):
            return walk(kind, i)
        if kind == "record" and is_key:
            return any(f["name"] == step and walk(f["type"], i + 1) for f in node.get("fields", ()))
        if kind == "map" and is_key:
            return walk(node.get("values"), i + 1)
        if kind == "array" and not is_key:
            return walk(node.get("items"), i + 1)
        return False

    return walk(schema, 0)
