"""Record → row mapping: decode a Kafka record once and coerce it into a typed row tuple.

Design
------
This code runs for every consumed record, so all the work that depends only on
the configuration is done once, in :class:`Mapper.__init__` ("compiling" the
pipeline's column specs):

* Each column becomes a plan entry ``(name, source, getter, coercer, default,
  required)``. The *getter* is a closure ``getter(record, doc)`` specialised for
  the column's source (``$``, a one-key path ``$.a``, a longer path, or a Kafka
  metadata field) and returns the raw value, or ``None`` for "missing"; the
  *coercer* is a closure specialised for the column's PostgreSQL base type that
  turns a raw value into the Python value psycopg 3 adapts to that type
  (``int``, ``Decimal``, ``float``, ``str``, ``bool``, ``datetime``, ``date``,
  ``UUID``, ``bytes``). The default value is coerced once up front, so a bad
  default is a configuration error (``ValueError``), not a per-record one.
* The value is decoded with :func:`orjson.loads` only if some column or the
  ordering key reads a ``$`` path, and the "top level must be an object" check
  runs once per record, not once per column.
* :meth:`Mapper.map` runs a function generated from the plan (:mod:`.fastmap`): for
  JSON whose ``$`` sources are one-key paths, its *typed tier* first (msgspec into a
  Struct of those keys), then its orjson tier, and a record either declines goes
  through :meth:`Mapper.map_generic`, which alone decides errors. The typed tier
  switches itself off (:meth:`Mapper.review_typed`) on streams it mostly misses.
* :meth:`Mapper.map_generic` is a tight loop: one ``loads``, one getter and at
  most one coercer call per column. Coercers raise a private lightweight
  exception carrying an error class; ``map`` adds the column name and source and
  re-raises it as :class:`~ingest.errors.InvalidRecord`. A final catch-all turns
  anything unexpected into ``InvalidRecord`` too, so a hostile record can never
  crash a pipeline: it is dead-lettered instead.

Null handling: a JSON ``null`` is treated exactly like a missing field (a
required column raises ``missing_field``; an optional one gets its default or
``None``). Records with a null value (tombstones) always raise
``InvalidRecord('decode', 'tombstone', ...)``, even when no column reads the
value; the pipeline decides whether to skip or dead-letter them.

Metadata sources (``@key``, ``@header.NAME``) hold bytes. A ``bytea`` column
takes them raw; any other column gets them decoded as UTF-8 text and then
coerced like a JSON string (so ``@key`` into ``bigint`` parses ``b"42"``, and
``@key`` into ``jsonb`` stores a JSON string). ``@topic`` is a string,
``@partition``/``@offset``/``@timestamp`` are integers (``@timestamp`` is epoch
milliseconds, so it can feed a ``timestamptz`` column directly); ``@stream`` is
the topic and partition as one signed 64-bit id (:func:`ingest.core.routing.stream_id`).
A record ``replay-dlq --to topic`` republished stands for its origin:
``@topic``, ``@partition``, ``@offset`` and ``@stream`` are the original record's.

Known limit: orjson parses integers outside the 64-bit range as ``float``, so a
JSON number such as ``123456789012345678901234567890`` loses precision in a
``numeric`` column. Send such values as JSON strings (``"1234..."``), which are
parsed exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ingest.config.base import ColumnSpec
from ingest.core.dialects import ch_type, pg_base_type
from ingest.core.mapping.coerce_ch import _ch_coercer, _ch_inline
from ingest.core.mapping.coerce_pg import _coercer_for, _pg_inline
from ingest.core.mapping.columnar import (
    VERSION_KINDS,
    ColumnarPlan,
    StagedColumn,
    ch_staged,
    document_fields,
    pg_staged,
)
from ingest.core.mapping.common import (
    Coercer,
    Getter,
    _Bad,
)
from ingest.core.mapping.fastmap import (
    INLINE_METADATA,
    FastColumn,
    FastMap,
    compile_fast_map,
    compile_typed_map,
    typed_keys,
    unnameable_key,
)
from ingest.core.mapping.getters import (
    _metadata_getter,
    _parse_path,
    _path_getter,
    _render_key,
)
from ingest.errors import IngestError, InvalidRecord
from ingest.formats.base import Decoder
from ingest.formats.json import JsonDecoder
from ingest.types import Record

__all__ = ["Mapper"]

log = logging.getLogger(__name__)

#: The typed tier is reviewed once this many records have been offered to it since the last review ...
TYPED_REVIEW_RECORDS = 4096
#: ... and turned off for good when more than this share of them fell back to the orjson tier (a
#: stream whose records carry fields no column reads, or nested values: each miss costs a failed
#: typed decode on top of the orjson one).
TYPED_MAX_MISS_SHARE = 0.25


def _column_type(spec: ColumnSpec, dialect: str | None) -> tuple[str, str, Coercer, Any, bool, Any]:
    """``(pg base type or "", normalised type, coercer, inline code, required, implicit default)`` of a column.

    A ClickHouse column that is neither Nullable nor given a default is
    required (ClickHouse would silently write a zero); an Array defaults to ``[]``.
    """
    if (dialect or getattr(spec, "dialect", "postgres")) == "clickhouse":
        ch = ch_type(spec.type)
        required = spec.required or (ch.kind != "array" and not ch.nullable and spec.default is None)
        return "", ch.name, _ch_coercer(ch), _ch_inline(ch), required, [] if ch.kind == "array" else None
    base, full = pg_base_type(spec.type)
    return base, full, _coercer_for(base), _pg_inline(base), spec.required, None


def column_coercer(spec: ColumnSpec, dialect: str) -> tuple[Coercer, bool]:
    """``(coercer, required)`` of a column of ``spec``'s type in ``dialect`` (``columns: auto``, which
    coerces each value exactly as a column of that type written by hand would)."""
    _base, _full, coerce, _inline, required, _default = _column_type(spec, dialect)
    return coerce, required


def _compile_column(name: str, spec: ColumnSpec, dialect: str | None, source: str,
                    parsed: Mapping[str, Any], needs_object: bool,
                    key_decoder: Decoder | None) -> tuple[tuple[Any, ...], FastColumn, str]:
    """One column's generic plan entry, fast-path column and normalised type; ValueError on a bad spec."""
    base, full, coerce, inline, required, default = _column_type(spec, dialect)
    doc_key: str | None = None
    if source.startswith("@key.$"):
        getter = _key_path_getter(source, key_decoder)
    elif source.startswith("$"):
        steps = parsed[source]
        getter = _path_getter(steps, needs_object)
        if len(steps) == 1 and steps[0][0]:
            doc_key = str(steps[0][1])
    else:
        getter = _metadata_getter(source, as_text=base != "bytea")
    if spec.default is not None:
        try:
            default = coerce(spec.default)
        except _Bad as exc:
            raise ValueError(f"default is not a valid {full}: {exc.detail}") from None
    entry = (name, source, getter, coerce, default, required)
    metadata = source if source in INLINE_METADATA else None
    fast = FastColumn(getter, doc_key, coerce, default, required, inline, metadata, reads_doc=source.startswith("$"))
    return entry, fast, full

def _key_path_getter(source: str, key_decoder: Decoder | None) -> Getter:
    """``@key.$.PATH``: the value at PATH in the record's key, decoded by the key format (a key that
    does not decode raises its InvalidRecord, stage ``decode``; a null key is missing)."""
    if key_decoder is None:
        raise ValueError(f"source {source} reads into the record key: set key_format (json, avro, ...)")
    path = _path_getter(_parse_path(source[len("@key."):]), False)
    decode = key_decoder.decode

    def get(record: Record, doc: Any) -> Any:
        return None if record.key is None else path(record, decode(record))

    return get


class Mapper:
    """Turns a :class:`~ingest.types.Record` into a row tuple plus its ordering key.

    Build one per pipeline (construction does all the parsing); :meth:`map` is
    then cheap and thread-safe (the mapper holds no mutable state).

    ``columns``: target columns in row order; each column reads ``spec.source``
    (default ``$.<name>``) and is coerced to ``spec.type``.
    ``key_path``: where the ordering key comes from; ``None`` means the Kafka
    message key.
    ``dialect``: the type system of ``spec.type`` -- ``postgres`` (values for
    psycopg) or ``clickhouse`` (values for clickhouse-connect: ``UInt8``..``Int64``
    range-checked, ``Float32/64``, ``Decimal(P,S)`` rounded to S places and
    range-checked, ``String``, ``LowCardinality(String)``, ``Bool``, ``Date``,
    ``DateTime64(p)`` (as its raw int: ticks since the epoch), ``UUID``, ``JSON`` (compact JSON
    text for a String column), ``Nullable(T)``, ``Array(T)`` from a JSON array).
    Default: each spec's ``dialect`` class attribute
    (:class:`~ingest.config.ClickHouseColumnSpec` says ``clickhouse``), else
    ``postgres``. A ClickHouse column that is neither Nullable nor an Array and
    has no default is required (a missing value is a ``missing_field`` map
    error rather than ClickHouse's silent zero); a missing Array is ``[]``.

    Raises ``ValueError`` for an unsupported column type, an invalid source or
    key path, or a default that is not valid for its column's type.
    """

    __slots__ = ("column_names", "column_types", "_plan", "_needs_json", "_needs_object", "_key_getter", "_fast",
                 "_fast_doc", "_untyped", "_decoder", "_describe", "fast_misses", "_typed_misses", "_typed_offered",
                 "_typed_reviewed_misses", "_columnar_source", "_columnar_why", "_sources", "_columnar_nested",
                 "_columnar_documents", "_columnar_payloads")

    def __init__(self, columns: Mapping[str, ColumnSpec], key_path: str | None = None, *,
                 dialect: str | None = None, decoder: Decoder | None = None,
                 key_decoder: Decoder | None = None) -> None:
        if dialect not in (None, "postgres", "clickhouse"):
            raise ValueError(f"unknown dialect {dialect!r}")
        #: records the compiled fast path declined (the generic loop mapped them or found them poison):
        #: the fast path's hit rate is ``1 - fast_misses / records mapped``
        self.fast_misses = 0
        if not columns:
            raise ValueError("at least one column is required")
        sources = {name: spec.source or f"$.{name}" for name, spec in columns.items()}
        all_paths = [s for s in sources.values() if s.startswith("$")]
        if key_path is not None and key_path.startswith("$"):
            all_paths.append(key_path)
        parsed = {p: _parse_path(p) for p in all_paths}
        #: bytes -> document (ingest.formats): JSON unless the pipeline's format says otherwise
        self._decoder: Decoder = decoder if decoder is not None else JsonDecoder()
        #: ``record -> "value schema id 7"``: which schema wrote a record, for map errors (typed formats)
        self._describe = getattr(self._decoder, "describe", None)
        #: Decode the value only if a $-path is read; check for a top-level object only
        #: if some path starts with a key step.
        self._needs_json = bool(parsed)
        self._needs_object = any(steps and steps[0][0] for steps in parsed.values())

        plan = []
        types = []
        fast_columns = []
        for name, spec in columns.items():
            try:
                entry, fast, full = _compile_column(name, spec, dialect, sources[name], parsed, self._needs_object,
                                                    key_decoder)
            except ValueError as exc:
                raise ValueError(f"column {name!r}: {exc}") from None
            plan.append(entry)
            fast_columns.append(fast)
            types.append(full)
        self._plan: tuple[tuple[str, str, Getter, Coercer, Any, bool], ...] = tuple(plan)
        #: Column names in row order.
        self.column_names: tuple[str, ...] = tuple(columns)
        #: Normalised types in row order, e.g. ``('bigint', 'numeric(12,2)')`` or
        #: ``('UInt64', 'Decimal(12, 2)')``.
        self.column_types: tuple[str, ...] = tuple(types)

        if key_path is None:
            self._key_getter: Getter | None = None
        elif key_path.startswith("@key.$"):
            self._key_getter = _key_path_getter(key_path, key_decoder)
        elif key_path.startswith("$"):
            self._key_getter = _path_getter(parsed[key_path], self._needs_object)
        else:
            self._key_getter = _metadata_getter(key_path, as_text=False)
        loads = self._decoder.value_loader()
        #: the orjson tier (or the format's own loader / decode)
        self._untyped: FastMap = compile_fast_map(
            fast_columns, needs_json=self._needs_json, needs_object=self._needs_object, key_getter=self._key_getter,
            render_key=_render_key, loads=loads, decode=self._decoder.decode)
        #: records the typed tier handed to the orjson tier (a list: the generated code adds to its item)
        self._typed_misses = [0]
        self._typed_offered = self._typed_reviewed_misses = 0
        self._fast: FastMap = self._untyped
        key_doc_key: str | None = None
        key_typed = key_path is None or not key_path.startswith("$")
        if key_path is not None and key_path.startswith("$"):
            steps = parsed[key_path]
            if len(steps) == 1 and steps[0][0]:
                key_doc_key, key_typed = str(steps[0][1]), True
        keys = typed_keys(fast_columns, key_doc_key) if key_typed and self._needs_object else None
        #: what a columnar plan is made of (:meth:`columnar_plan`): the columns of a typed JSON pipeline,
        #: the keys it decodes, and their dialect (one for every column)
        self._columnar_source: tuple[list[FastColumn], list[str], str] | None = None
        #: why there is no columnar source (the first reason), for :meth:`columnar_refusal`
        self._columnar_why: str | None = None
        #: document paths of more than one key the columnar plan decodes: by column position, and the
        #: pipeline key's (position -1)
        self._columnar_nested: dict[int, tuple[str, ...]] = {}
        #: a non-JSON format's batch decoder the columnar plan reads documents with (its ``decode_batch``,
        #: when the decoder declares ``columnar_documents``), None for JSON
        self._columnar_documents: Any = None
        #: a format whose values are JSON behind a prefix (json_schema): its ``columnar_payloads``, which the
        #: columnar plan reads the JSON texts with; None for plain JSON and other formats
        self._columnar_payloads: Any = getattr(self._decoder, "columnar_payloads", None)
        self._sources = sources
        if keys is not None and loads is orjson.loads:  # JSON values, every $ source one key: the typed tier
            dialects = {dialect or getattr(spec, "dialect", "postgres") for spec in columns.values()}
            if len(dialects) == 1:
                self._columnar_source = (fast_columns, keys, dialects.pop())
            else:
                self._columnar_why = "its columns mix dialects"
            self._fast = compile_typed_map(fast_columns, keys, untyped=self._untyped, key_doc_key=key_doc_key,
                                           key_getter=self._key_getter, render_key=_render_key,
                                           misses=self._typed_misses)
        elif loads is not orjson.loads and self._columnar_payloads is None:
            self._columnar_why = "its values are not JSON documents"
            if getattr(self._decoder, "columnar_documents", False):  # Avro: the plan reads its decoded documents
                self._columnar_why = self._untyped_reason(fast_columns, key_path, key_doc_key, key_typed) \
                    if keys is None else None
                dialects = {dialect or getattr(spec, "dialect", "postgres") for spec in columns.values()}
                if keys is not None and len(dialects) == 1:
                    self._columnar_source = (fast_columns, keys, dialects.pop())
                    fields_of = getattr(self._decoder, "decode_fields", None)
                    self._columnar_documents = fields_of if fields_of is not None else functools.partial(
                        document_fields, self._decoder.decode_batch)
                elif keys is not None:
                    self._columnar_why = "its columns mix dialects"
        else:  # JSON values (plain, or behind a prefix: columnar_payloads) the typed tier does not read
            self._columnar_why = self._untyped_reason(fast_columns, key_path, key_doc_key, key_typed)
            nested = self._nested_paths(fast_columns, parsed, key_path)
            dialects = {dialect or getattr(spec, "dialect", "postgres") for spec in columns.values()}
            if nested is not None and len(dialects) == 1:
                self._columnar_source = (fast_columns, nested[0], dialects.pop())
                self._columnar_nested = nested[1]
                self._columnar_why = None
        self._fast_doc = compile_fast_map(fast_columns, needs_json=True, needs_object=self._needs_object,
                                          key_getter=self._key_getter, render_key=_render_key, given_doc=True)

    def _nested_paths(self, fast_columns: Sequence[FastColumn], parsed: Mapping[str, Any], key_path: str | None
                      ) -> tuple[list[str], dict[int, tuple[str, ...]]] | None:
        """For the columnar plan of a JSON pipeline whose ``$`` sources are paths of keys (``$.user.id``;
        no array index, none a prefix of another): the top-level keys it decodes and the longer paths
        by column position (the pipeline key's at -1); None when some source is not such a path."""
        paths: dict[int, tuple[str, ...]] = {}
        for i, col in enumerate(fast_columns):
            if col.reads_doc:
                paths[i] = tuple(str(step) for _, step in parsed[self._sources[self.column_names[i]]])
                if not all(is_key for is_key, _ in parsed[self._sources[self.column_names[i]]]):
                    return None
        if key_path is not None and key_path.startswith("$"):
            if not all(is_key for is_key, _ in parsed[key_path]):
                return None
            paths[-1] = tuple(str(step) for _, step in parsed[key_path])
        if not paths or any(not p or any(unnameable_key(k) for k in p) for p in paths.values()):
            return None
        distinct = set(paths.values())
        if any(a != b and b[:len(a)] == a for a in distinct for b in distinct):
            return None  # one path reads a value, another reads into it
        keys = list(dict.fromkeys(p[0] for p in paths.values()))
        return keys, {i: p for i, p in paths.items() if len(p) > 1}

    def _untyped_reason(self, fast_columns: Sequence[FastColumn], key_path: str | None, key_doc_key: str | None,
                        key_typed: bool) -> str:
        """Why the typed decoder (and so the columnar tier) reads none of this mapper's documents."""
        for name, col in zip(self.column_names, fast_columns, strict=True):
            if col.doc_key is None and col.reads_doc:
                return f"column {name!r} reads {self._sources[name]!r} (the tier reads one top-level key per column)"
            if col.doc_key is not None and unnameable_key(col.doc_key):
                return f"column {name!r} reads a key with a quote, backslash or control character"
        if not key_typed:
            return f"the pipeline key {key_path!r} is not one top-level key"
        if key_doc_key is not None and unnameable_key(key_doc_key):
            return "the pipeline key has a quote, backslash or control character"
        return "no column reads the record value"

    def nested_refusal(self) -> str | None:
        """Why a plan with transforms cannot read these columns: the first column reading a nested path
        (the steps' decoder reads top-level fields), or None -- or that the values are not JSON (the
        steps' decoder reads JSON)."""
        if self._columnar_documents is not None:
            return "with transforms the tier reads JSON values only"
        for position in sorted(self._columnar_nested):
            if position >= 0:
                name = self.column_names[position]
                return f"column {name!r} reads {self._sources[name]!r}: with transforms the tier reads top-level fields"
        return "the key reads a nested path: with transforms the tier reads top-level fields" \
            if self._columnar_nested else None

    def columnar_refusal(self, key_index: tuple[int, ...] | None, version_index: int | None = None) -> str | None:
        """Why :meth:`columnar_plan` makes no plan for these columns -- the first reason, naming the
        column -- or None when it makes one."""
        if self._columnar_source is None:
            return self._columnar_why or "the columns cannot be staged"
        columns, _keys, dialect = self._columnar_source
        kinds = []
        for name, col, full in zip(self.column_names, columns, self.column_types, strict=True):
            staged = self._staged(name, col, full, dialect)
            if staged is not None:
                kinds.append(staged.kind)
                continue
            if not col.reads_doc and col.metadata is None:
                return f"column {name!r} reads {self._sources[name]!r}, which the tier does not stage"
            if dialect == "clickhouse":
                if col.doc_key is None and col.metadata is None:
                    return f"column {name!r} reads {self._sources[name]!r}, which the tier does not stage"
                if col.default is not None and self._staged(name, dataclasses.replace(col, default=None), full, dialect):
                    return f"column {name!r} has a default the tier cannot stage exactly ({col.default!r})"
                return f"column {name!r} is {full}: the tier stages integer, String, Decimal and DateTime64 columns"
            if col.default is not None and pg_staged(name, dataclasses.replace(col, default=None), full) is not None:
                return f"column {name!r} has a default the tier cannot stage ({col.default!r})"
            if col.doc_key is None:
                return f"column {name!r} reads {self._sources[name]!r}, which the tier does not stage"
            return (f"column {name!r} is {full}: the tier stages integer, text, numeric, timestamp, double "
                    "precision and boolean columns")
        if version_index is not None and kinds[version_index] not in VERSION_KINDS:
            name, full = self.column_names[version_index], self.column_types[version_index]
            return f"the version column {name!r} is {full}, not an integer or timestamp column"
        return None

    def _staged(self, name: str, col: FastColumn, full: str, dialect: str) -> StagedColumn | None:
        """How the columnar plan stages a column (``full``: its normalised type), or None when it cannot."""
        if dialect == "clickhouse":
            return ch_staged(name, col, ch_type(full), documents=self._columnar_documents is not None)
        return pg_staged(name, col, full)

    def columnar_columns(self) -> list[Any]:
        """The compiled columns a columnar plan reads (:class:`~ingest.core.mapping.fastmap.FastColumn`,
        in column order), or ``[]`` when no plan can be made."""
        return list(self._columnar_source[0]) if self._columnar_source is not None else []

    def columnar_plan(self, key_index: tuple[int, ...] | None,
                      version_index: int | None = None, *, transform: Any = None) -> ColumnarPlan | None:
        """A :class:`~ingest.core.mapping.columnar.ColumnarPlan` for this mapper's columns (rows
        collapsed to the winner of each ``key_index`` key -- the last record, or the highest
        ``version_index`` value, ties to the last; None: every row kept), or None when the columnar
        tier cannot map them: not a typed JSON pipeline (see :attr:`typed`), a column of a kind it
        does not stage (:func:`~ingest.core.mapping.columnar.pg_staged`,
        :func:`~ingest.core.mapping.columnar.ch_staged`), a version column that is not an integer or
        (PostgreSQL) timestamp column. ``transform``: the pipeline's transforms compiled for the tier,
        applied to each batch before its columns are read (:class:`ingest.core.mapping.columnar.ColumnarPlan`)."""
        if self._columnar_source is None:
            return None
        columns, keys, dialect = self._columnar_source
        kinds = []
        for name, col, full in zip(self.column_names, columns, self.column_types, strict=True):
            staged = self._staged(name, col, full, dialect)
            if staged is None:
                return None
            kinds.append(staged)
        if version_index is not None and kinds[version_index].kind not in VERSION_KINDS:
            return None
        if transform is not None and (self._columnar_nested or self._columnar_documents is not None):
            return None  # the steps' decoder reads top-level fields of JSON values
        return ColumnarPlan(self.column_names, columns, kinds, keys, key_index, version_index, transform=transform,
                            record_key_orders=self._key_getter is None, nested=self._columnar_nested,
                            documents=self._columnar_documents, payloads=self._columnar_payloads,
                            route_documents=getattr(self._decoder, "route_fields", None)
                            if self._columnar_documents is not None else None,
                            documents_stage=self._columnar_documents is not None
                            and getattr(self._decoder, "stages_logical_types", False))

    @property
    def typed(self) -> bool:
        """Whether records go through the typed tier first (see :mod:`ingest.core.mapping.fastmap`)."""
        return self._fast is not self._untyped

    @property
    def typed_misses(self) -> int:
        """Records the typed tier handed to the orjson tier (fields no column reads, nested values...);
        its hit rate is ``1 - typed_misses / records mapped`` while :attr:`typed` holds."""
        return self._typed_misses[0]

    def review_typed(self, offered: int) -> None:
        """Count ``offered`` records mapped since the last call (once per polled chunk, by the caller that
        maps them); turn the typed tier off for good when it misses too often (``TYPED_MAX_MISS_SHARE``)."""
        if self._fast is self._untyped:
            return
        self._typed_offered += offered
        if self._typed_offered < TYPED_REVIEW_RECORDS:
            return
        misses = self._typed_misses[0] - self._typed_reviewed_misses
        if misses > TYPED_MAX_MISS_SHARE * self._typed_offered:
            self._fast = self._untyped
            log.info("typed JSON decoding off: %d of %d records fell back to orjson (fields no column reads, "
                     "nested values or integers beyond 64 bits)", misses, self._typed_offered)
        self._typed_offered, self._typed_reviewed_misses = 0, self._typed_misses[0]

    def map(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        """Return ``(row, ordering_key)`` for ``record`` (same contract as :meth:`map_generic`).

        Tries the compiled fast path (:mod:`ingest.core.fastmap`) first; any
        record it declines goes through the generic loop.
        """
        try:
            return self._fast(record)
        except Exception:  # noqa: BLE001 - the generic loop gives the precise result or error
            self.fast_misses += 1
            return self.map_generic(record)

    def map_generic(self, record: Record) -> tuple[tuple[Any, ...], bytes | None]:
        """Return ``(row, ordering_key)`` for ``record``.

        ``row`` holds one psycopg-ready value per column, in ``column_names``
        order (``None`` for SQL NULL). ``ordering_key`` is ``record.key`` when
        the mapper has no key path; otherwise the value at the key path as
        bytes (str → UTF-8, int → decimal digits, metadata bytes as is, other
        JSON → compact JSON), or ``None`` when missing or null.

        Raises :class:`~ingest.errors.InvalidRecord` — and nothing else, for
        any input — when the record cannot be mapped:

        - stage ``decode``: ``tombstone`` (null value), ``invalid_utf8``,
          ``invalid_json``;
        - stage ``map``: ``not_an_object``, ``missing_field``, ``wrong_type``,
          ``out_of_range``, ``invalid_value``.
        """
        value = record.value
        if value is None:
            raise InvalidRecord("decode", "tombstone", "record value is null (tombstone)")
        return self._map_doc(record, self.decode(record) if self._needs_json else None)

    def decode(self, record: Record) -> Any:
        """The record's decoded value (a tombstone is never decoded).

        Raises InvalidRecord (stage ``decode``) for bytes that do not decode; a format's
        TransientError / FatalPipelineError (the registry, not the record) passes through.
        """
        try:
            return self._decoder.decode(record)
        except IngestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a decoder's bug must not crash the pipeline
            raise InvalidRecord("decode", "undecodable",
                                f"record value could not be decoded: {type(exc).__name__}: {exc}"[:300]) from None

    def map_document(self, record: Record, doc: Any) -> tuple[tuple[Any, ...], bytes | None]:
        """Like :meth:`map` for a document decoded elsewhere (a change event's row image, ``ingest.cdc``):
        ``$`` paths read ``doc``, metadata sources read ``record``. Same errors as :meth:`map_generic`."""
        try:
            return self._fast_doc(record, doc)
        except Exception:  # noqa: BLE001 - the generic loop gives the precise result or error
            self.fast_misses += 1
            return self._map_doc(record, doc)

    def _map_doc(self, record: Record, doc: Any) -> tuple[tuple[Any, ...], bytes | None]:
        if self._needs_object and type(doc) is not dict:
            raise InvalidRecord(
                "map", "not_an_object", f"record value must be {self._decoder.document}, got {_json_kind(doc)}"
            )
        name = source = ""
        try:
            row = []
            append = row.append
            for name, source, get, coerce, default, required in self._plan:
                raw = get(record, doc)
                if raw is None:
                    if required:
                        raise _Bad("missing_field", "required value is missing or null")
                    append(default)
                else:
                    append(coerce(raw))
            name = source = ""
            key_getter = self._key_getter
            key = record.key if key_getter is None else _render_key(key_getter(record, doc))
        except _Bad as exc:
            raise InvalidRecord("map", exc.error_class, _context(name, source) + exc.detail + self._written_by(record)
                                ) from None
        except IngestError:  # a key that does not decode (@key.$ sources), or the registry is down
            raise
        except Exception as exc:  # noqa: BLE001 - defensive: never let a record crash the pipeline
            detail = f"internal mapping error {type(exc).__name__}: {exc}"[:300]
            raise InvalidRecord("map", "invalid_value", _context(name, source) + detail) from None
        return tuple(row), key

    def _written_by(self, record: Record) -> str:
        """`` (written with value schema id 7)`` for a record of a typed format, else nothing."""
        what = self._describe(record) if self._describe is not None else None
        return f" (written with {what})" if what else ""


def _context(name: str, source: str) -> str:
    return f"column {name!r} (source {source}): " if name else "ordering key: "


def _json_kind(doc: Any) -> str:
    if isinstance(doc, list):
        return "an array"
    if isinstance(doc, str):
        return "a string"
    if isinstance(doc, bool):
        return "a boolean"
    if doc is None:
        return "null"
    return "a number"
