"""The columnar tier: a whole batch of JSON records mapped to Arrow columns at once (issue #19).

The row path maps each record in Python (:class:`~ingest.core.mapping.Mapper`) and a lane then
copies each row into the database. For the commonest pipelines -- JSON values whose columns each
read one top-level key or record metadata, into integer, text, numeric and epoch-millisecond
timestamp columns -- :class:`ColumnarPlan` does that work per batch instead:

1. the batch's values are joined by newlines and decoded in one C call by the typed tier's own
   msgspec decoder (:func:`~ingest.core.mapping.fastmap.typed_lines_decoder`: a Struct of exactly
   the keys the columns read, unknown fields refused, a key read only by integer or only by text
   columns typed so), after checking that no value holds a
   newline and that each is framed as one object (:func:`_framed`), so document ``i`` is record
   ``i`` (a batch that is not, or whose decode fails, is decoded in pieces of
   :data:`DECODE_PIECE` values, a failing piece in halves: :meth:`ColumnarPlan._decode`);
2. each column's values go into one Arrow array; a column is checked as a whole (the Python types
   it holds, its integer range, NUL characters, missing required values) and every record that
   fails a check, or that the decoder refused, is *rejected*: handed to the row mapper, which
   alone decides poison;
3. the rows of one key collapse to the last one (the sink's ``ON CONFLICT DO UPDATE`` rule), or
   with a version column (ClickHouse's ``ReplacingMergeTree(version)``) to the highest version,
   ties to the last.

Each column is staged as a :class:`StagedColumn` says (:func:`pg_staged`, :func:`ch_staged`), and
the sink converts the staged columns into its own types. Conversions the row mapper does in
Python are left to the sink, on values that carry the same information: PostgreSQL gets a JSON
float for a ``numeric`` column as the shortest text that round-trips it (Arrow's CSV writer writes
exactly the digits of ``float_decimal``) and rounds it itself, epoch milliseconds as an integer
that the upsert adds to the epoch (see :mod:`ingest.sinks.postgres.columnar`); ClickHouse gets
only decimals that need no rounding, and multiplies epoch milliseconds to its ``DateTime64``
ticks in Arrow (:meth:`ingest.sinks.clickhouse.sink.ClickHouseSink.write_columns`). A typed
format's documents (Avro, Protobuf) hold Python values of their own (Decimals, datetimes) beside
numbers: their ``Decimal(P,S)`` and ``DateTime64(p)`` values go through the row mapper's own coercer
and are staged as what it returns (:func:`_coerced_array`).

Contract of :meth:`ColumnarPlan.build`: for the records it accepts, the table's rows are the rows
the row mapper returns for them (the same values once the database has converted them), collapsed
as :func:`ingest.core.collapse.collapse` would; every other record is listed in ``rejected``.
``None`` declines the whole batch (a tombstone, a republished record, a newline in a value). The
differential tests hold it to that: ``tests/unit/test_columnar.py`` and
``tests/unit/test_columnar_ch_plan.py`` (pure, each dialect), ``tests/integration/test_columnar_pg.py``
and ``tests/integration/test_columnar_ch.py`` (the databases' values).

Pure logic, no I/O; pyarrow is imported only when a plan is made.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Union

import msgspec
import orjson

from ingest.core.dialects import ChType
from ingest.core.mapping import coerce_pg
from ingest.core.mapping.coerce_ch import CH_DT64_MAX_MS
from ingest.core.mapping.common import _EPOCH_AWARE, _EPOCH_NAIVE, _FALSE, _MAX_DATETIME_TEXT, _TRUE
from ingest.core.mapping.fastmap import (
    _SCALAR,
    EXACT_FROMTIMESTAMP_MS,
    TYPED_FIELDS,
    STREAM_ID_MAX,
    STREAM_ID_MIN,
    FastColumn,
    memoised_stream_id,
    typed_lines_decoder,
)
from ingest.core.routing import key_bytes, stream_id
from ingest.types import Record

#: The kinds of column the tier stages: ``int`` (an int8 stage column), ``text``, and for ClickHouse
#: ``decimal`` (a float whose digits need no rounding) and ``epoch_ms`` (int64 milliseconds); for
#: PostgreSQL ``numeric`` (a JSON number as the shortest digits of its value, as text), ``timestamp``
#: (epoch milliseconds or ISO 8601 text, as int8 microseconds since the epoch: the upsert adds them
#: to it), ``float`` (``double precision``), ``bool`` and ``json`` (``json`` / ``jsonb``: the row
#: mapper's JSON text of the value; see :func:`pg_staged`); for ClickHouse columns of a typed format's
#: documents (Avro, Protobuf: ``ch_staged(..., documents=True)``) ``coerced_decimal`` and ``coerced_ticks``:
#: each value as the row mapper's own coercer returns it (a ``Decimal(P,S)`` column's Decimal, as Arrow
#: ``decimal(P,S)``; a ``DateTime64(p)`` column's ticks, as int64).
KINDS = ("int", "text", "decimal", "epoch_ms", "numeric", "timestamp", "float", "bool", "json", "coerced_decimal",
         "coerced_ticks")

#: Metadata sources the tier reads off the records (a republished record declines the batch): the
#: record's attribute, and the Python type of its values (or None).
_METADATA: dict[str, tuple[str, type]] = {
    "@topic": ("topic", str),
    "@partition": ("partition", int),
    "@offset": ("offset", int),
    "@timestamp": ("timestamp_ms", int),
}

_astuple = msgspec.structs.astuple

#: :meth:`ColumnarPlan.lane_keys` of a record only the row mapper can route.
UNROUTED = object()

#: The signed 64-bit range of the tier's integer arrays (the typed decoder refuses integers beyond it).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: A batch whose one-call decode fails is decoded this many values at a time (a piece that fails, in
#: halves): a few poison records cost a few small decodes, not one call per value of the batch.
DECODE_PIECE = 64

#: The kinds a version column may be staged as: its staged values order as the row mapper's do
#: (integers; a timestamp's microseconds since the epoch order as its instants).
VERSION_KINDS = ("int", "timestamp")

#: The Python types a column of each kind may hold, null (a missing value) included.
_STAGED_TYPES = {kind: frozenset({*ts, type(None)})
                 for kind, ts in (("int", (int,)), ("text", (str,)), ("decimal", (float,)), ("epoch_ms", (int,)),
                                  ("numeric", (int, float, str)), ("timestamp", (int, str)), ("float", (int, float)),
                                  ("bool", (bool, int, str)), ("json", (msgspec.Raw, str, int, float, bool)),
                                  ("coerced_decimal", (int, float, str, Decimal)),
                                  ("coerced_ticks", (int, str, datetime)))}

#: The microseconds since the epoch a PostgreSQL ``timestamp`` column stages: ``|us| < 2**53`` (1685 to
#: 2255), where the upsert's ``us * interval '1 microsecond'`` is exact (a double multiplies); beyond it,
#: the row mapper.
PG_US_MIN, PG_US_MAX = -(2**53) + 1, 2**53 - 1
_US = timedelta(microseconds=1)

#: The kinds whose values the decoder can check itself (:data:`~ingest.core.mapping.fastmap.TYPED_FIELDS`:
#: exactly the Python types of :data:`_STAGED_TYPES`).
_DECODED_AS = {"int": "int", "epoch_ms": "int", "text": "str", "json": "raw"}


@dataclass(frozen=True, slots=True)
class StagedColumn:
    """One sink column as the tier stages it, and the checks its values must pass (the rest go to the
    row mapper).

    ``kind``: one of :data:`KINDS`. ``lo``/``hi``: the accepted range of an ``int``, ``epoch_ms`` or
    ``timestamp`` column. ``aware``: a ``timestamp`` column is ``timestamptz`` (PostgreSQL). ``forbid_nul``: a
    ``text`` value may not hold NUL (PostgreSQL text cannot; ClickHouse strings can). ``scale`` and
    ``max_abs``: a ``decimal`` column whose sink does not round (ClickHouse): only floats whose
    shortest digits have at most ``scale`` decimals and whose magnitude is below ``max_abs`` -- the
    values the row mapper takes without rounding, digit for digit. ``None``: the sink rounds as the
    row mapper does (PostgreSQL's ``numeric(p,s)``), every finite float is staged."""

    name: str
    kind: str
    aware: bool = False
    lo: int | None = None
    hi: int | None = None
    forbid_nul: bool = True
    scale: int | None = None
    max_abs: float | None = None
    as_text: bool = False
    default: Any = None
    #: a ``coerced_decimal`` or ``coerced_ticks`` column's ClickHouse type precision (``P`` of
    #: ``Decimal(P,S)``, whose ``S`` is ``scale``; ``p`` of ``DateTime64(p)``)
    precision: int | None = None
    #: a ``json``, ``coerced_decimal`` or ``coerced_ticks`` column's coercer (the row mapper's own: the
    #: staged value is what it returns)
    coerce: Any = field(default=None, compare=False)


#: PostgreSQL base types the tier stages, by kind (integers come from the row mapper's inline check).
_PG_KINDS = {"text": "text", "varchar": "text", "numeric": "numeric", "timestamptz": "timestamp",
             "timestamp": "timestamp", "double precision": "float", "boolean": "bool", "json": "json", "jsonb": "json"}


def pg_staged(name: str, col: FastColumn, full_type: str) -> StagedColumn | None:
    """How the tier stages a PostgreSQL column (``full_type``: the mapper's normalised type), or None
    when it cannot (then no plan is made): integer, ``text``/``varchar``, ``numeric`` (with or without
    precision and scale), ``timestamptz``/``timestamp``, ``double precision`` and ``boolean`` columns
    reading one top-level key or record metadata, with or without a default."""
    base = full_type.split("(", 1)[0]
    inline = col.inline[0] if col.inline else None
    kind = "int" if inline == "int" else _PG_KINDS.get(base)
    if kind is None or not _readable(col, kind):
        return None
    lo = hi = None
    if kind == "int":
        _, lo, hi = col.inline  # type: ignore[misc]
    elif kind == "timestamp":
        lo, hi = PG_US_MIN, PG_US_MAX
    default = None if col.default is None else _staged_default(kind, col.default)
    if col.default is not None and (default is None or (lo is not None and not lo <= default <= hi)):
        return None
    return StagedColumn(name, kind, aware=base == "timestamptz", lo=lo, hi=hi,
                        forbid_nul=bool(col.inline[1]) if kind == "text" else True,  # type: ignore[index]
                        as_text=kind == "numeric" and ("(" not in full_type or default is not None),
                        default=default, coerce=col.coerce if kind == "json" else None)


def _readable(col: FastColumn, kind: str) -> bool:
    """Whether the tier reads a column's values: a top-level key, or metadata it lists off the records
    (``@stream`` only into an integer column of the signed 64-bit range)."""
    if col.doc_key is not None or col.reads_doc:  # a top-level key, or a path of keys (the plan's ``nested``)
        return True
    if col.metadata == "@stream":
        return kind == "int" and col.inline[1] <= STREAM_ID_MIN and col.inline[2] >= STREAM_ID_MAX  # type: ignore[index]
    return col.metadata in _METADATA


def _staged_default(kind: str, default: Any) -> Any:
    """A column's coerced default (the row mapper's) as the tier stages it, or None when it cannot."""
    if kind == "timestamp":
        if type(default) is not datetime:
            return None
        epoch = _EPOCH_AWARE if default.tzinfo is not None else _EPOCH_NAIVE
        return (default - epoch) // _US
    if kind == "numeric":
        return str(default) if type(default) is Decimal and default.is_finite() else None
    if kind in ("int", "text", "float", "bool", "json") and type(default) in _STAGED_TYPES[kind]:
        return default
    return None


def ch_staged(name: str, col: FastColumn, t: ChType, *, documents: bool = False) -> StagedColumn | None:
    """How the tier stages a ClickHouse column of type ``t``, or None when it cannot: integers,
    ``String``, ``Decimal(P, S)`` (values that need no rounding, see :class:`StagedColumn`) and
    ``DateTime64(p)`` from epoch milliseconds, each possibly ``Nullable``/``LowCardinality``, with or
    without a default the staged kind holds exactly (:func:`_ch_staged_default`). ``documents``: the
    values are a typed format's documents (Avro, Protobuf: Decimals, datetimes, epoch milliseconds of
    two writer schemas in one column), whose ``Decimal(P, S)`` and ``DateTime64(p)`` values are staged
    as the column's own coercer returns each of them (``coerced_decimal``, ``coerced_ticks``; a value it
    refuses is the row mapper's). The sink turns the staged columns into its own Arrow types
    (:meth:`~ingest.sinks.clickhouse.sink.ClickHouseSink.use_columnar`)."""
    staged = _ch_staged(name, col, t, documents)
    if staged is None or col.default is None:
        return staged
    default = _ch_staged_default(staged, col.default, t)
    return None if default is None else dataclasses.replace(staged, default=default)


def _ch_staged(name: str, col: FastColumn, t: ChType, documents: bool) -> StagedColumn | None:
    """:func:`ch_staged` without the default."""
    while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
        t = t.inner
    if t.kind == "decimal":
        kind = "coerced_decimal" if documents else "decimal"
    elif t.kind == "datetime64":
        kind = "coerced_ticks" if documents else "epoch_ms"
    else:
        kind = col.inline[0] if col.inline else None
        if kind not in ("int", "text"):
            return None
    if col.doc_key is None and not (col.metadata in _METADATA or (col.metadata == "@stream" and kind == "int")):
        return None
    if kind == "int":
        _, lo, hi = col.inline  # type: ignore[misc]
        if col.metadata == "@stream" and not (lo <= STREAM_ID_MIN and hi >= STREAM_ID_MAX):
            return None
        return StagedColumn(name, kind, lo=max(lo, INT64_MIN), hi=min(hi, INT64_MAX))
    if kind == "text":
        return StagedColumn(name, kind, forbid_nul=False)
    if kind in ("coerced_decimal", "coerced_ticks"):
        return StagedColumn(name, kind, scale=t.scale if kind == "coerced_decimal" else None,
                            precision=t.precision, coerce=col.coerce)
    if kind == "decimal":
        # as the row mapper's exact branch (coerce_ch._ch_decimal): |v| < 10**(P-S) / 10
        return StagedColumn(name, kind, scale=t.scale, max_abs=float(10 ** (t.precision - t.scale)) / 10)
    return StagedColumn(name, kind, lo=0, hi=CH_DT64_MAX_MS)


def _ch_staged_default(staged: StagedColumn, default: Any, t: ChType) -> Any:
    """A ClickHouse column's coerced default (the row mapper's: an int, a str, a Decimal, DateTime64
    ticks) as ``staged`` holds it -- the staged value the sink converts back to exactly that default --
    or None when it cannot (then the column has no plan)."""
    while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
        t = t.inner
    kind = staged.kind
    if kind == "text":
        return default if type(default) is str else None
    if kind == "coerced_decimal":  # staged as the Decimal itself
        return default if type(default) is Decimal and default.is_finite() else None
    if kind == "coerced_ticks":  # staged as the ticks themselves, in int64
        return default if type(default) is int and INT64_MIN <= default <= INT64_MAX else None
    if kind == "int":
        return default if type(default) is int and staged.lo <= default <= staged.hi else None  # type: ignore[operator]
    if kind == "decimal":  # staged as a double: only a default the double holds to the digit
        if type(default) is not Decimal or not default.is_finite():
            return None
        as_float = float(default)
        return as_float if Decimal(repr(as_float)) == default and abs(as_float) < staged.max_abs else None  # type: ignore[operator]
    if kind == "epoch_ms" and type(default) is int:  # DateTime64(p) ticks → epoch milliseconds, when exact
        per_ms = 10 ** (t.precision - 3) if t.precision >= 3 else 1
        ms = default // per_ms if t.precision >= 3 else default * 10 ** (3 - t.precision)
        return ms if default % per_ms == 0 and 0 <= ms <= CH_DT64_MAX_MS else None
    return None


@dataclass(frozen=True, slots=True)
class ColumnarBatch:
    """What :meth:`ColumnarPlan.build` made of a batch: the collapsed rows of the records it took (a
    ``pyarrow.Table`` whose columns are the sink's, in order) and the positions of the records it
    left to the row mapper, in batch order."""

    table: Any
    rejected: list[int]
    #: the positions of the records a transform's filter dropped, by the filter's label (no row, not
    #: rejected: the row path drops them alike; ingest.core.transforms.columnar)
    filtered: dict[str, list[int]] = field(default_factory=dict)


class ColumnarPlan:
    """Maps batches of records to Arrow columns (see the module docstring). Thread-safe: no state
    but the memo of stream ids, which any thread may fill."""

    def __init__(self, names: Sequence[str], columns: Sequence[FastColumn], kinds: Sequence[StagedColumn],
                 keys: Sequence[str], key_index: tuple[int, ...] | None, version_index: int | None = None,
                 transform: Any = None, record_key_orders: bool = True,
                 nested: dict[int, tuple[str, ...]] | None = None,
                 documents: Callable[[Sequence[Record], Sequence[str]], tuple[list[Sequence[Any]], set[int]]]
                 | None = None,
                 payloads: Callable[[Sequence[Record], Sequence[bytes]], list[bytes | None]] | None = None,
                 route_documents: Callable[[Sequence[Record], Sequence[str]], tuple[list[Sequence[Any]], set[int]]]
                 | None = None, documents_stage: bool = False) -> None:
        """``transform``: the pipeline's transforms compiled for the tier
        (:class:`ingest.core.transforms.columnar.ColumnarTransform`): the batch is decoded by its
        decoder and the columns read its results (``keys``: the document keys after the steps; no
        ``nested`` paths then). ``key_index``: the positions of the key columns whose rows collapse
        (None: every row kept); ``version_index``: the position of the version column (of
        :data:`VERSION_KINDS`) whose highest value wins a key, ties going to the last record (None: the
        last record wins); ``record_key_orders``: the ordering key is the record's key (no ``key``
        path), for :meth:`lane_keys` without key columns; ``nested``: document paths of more than one
        key, by column position (-1: the pipeline key's), whose first key is among ``keys``: that key is
        decoded as an object of the next keys (:func:`_nested_struct`), and such a column reads its
        path, None where any step is missing or null (an object where a value is wanted, or a value
        where an object is, is refused by the decoder: the row mapper decides). ``documents``: the batch's
        values are not JSON: ``documents(records, keys)`` gives each key's values over the batch and the
        records the decoder refused, exactly as the pipeline's decoder gives the row mapper its documents
        (the Avro decoder's ``decode_fields``, or :func:`document_fields` of a ``decode_batch``), and the
        columns read those top-level keys; no ``transform`` or
        ``nested`` then, and every column's values are type-checked (nothing is known of them).
        ``payloads``: the batch's values are JSON behind a prefix (``format: json_schema``):
        ``payloads(records, values)`` gives each record's JSON text exactly as the pipeline's decoder
        parses it, or None for a record that decoder does not vouch for (the row mapper's: rejected),
        and the plan reads those texts as it reads plain JSON values (:meth:`_json_values`).
        ``route_documents``: ``documents`` for :meth:`lane_keys` alone (default: ``documents``), whose
        values need be exact only for the records ``documents`` does not refuse (the Avro decoder's
        ``route_fields``, which reads each datum only up to its key fields). ``documents_stage``:
        ``documents`` takes a third argument, the keys whose logical-type values it may give already
        staged, with the type of each (:class:`Digits` for a decimal, :class:`Micros` for a timestamp:
        exactly what :func:`_precoerced` makes of its ``Decimal`` or ``datetime`` through the row
        mapper's coercer; the Avro decoder's ``decode_fields``) -- the keys only columns of one such
        kind read, through a coercer that returns those values unchanged (:data:`_STAGED_BY_COERCER`)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self._pa, self._pc = pa, pc
        self.columns = tuple(kinds)
        self._names = list(names)
        # The decoder checks a key's type itself (refusing the document) when every column reading
        # that key stages one type: those columns' values need no type check of their own.
        staged_as: dict[str, set[str | None]] = {}
        for col, staged in zip(columns, kinds, strict=True):
            if col.doc_key is not None:
                staged_as.setdefault(col.doc_key, set()).add(_DECODED_AS.get(staged.kind))
        decoded_as = [next(iter(staged_as[key])) if len(staged_as.get(key, ())) == 1 else None for key in keys]
        self._transform = None if transform is None else transform.bind(keys)
        nested = nested or {}
        #: the document keys the plan reads, in the decoder's field order (:meth:`build_fields`; a non-JSON
        #: format's ``documents`` get them too)
        self.keys = list(keys)
        #: the document paths of more than one key the plan reads, by column position
        self.nested = dict(nested)
        #: the decoder of a non-JSON format's batches (see ``documents`` above), or None: JSON lines
        self._documents = documents
        #: what :meth:`lane_keys` reads a non-JSON format's key fields with
        self._route_documents = route_documents or documents
        #: the JSON texts of a format's values (see ``payloads`` above), or None: the values are JSON
        self._payloads = payloads
        assert documents is None or payloads is None, "a format's documents, or its JSON texts"
        if documents is not None:
            assert transform is None and not nested, "non-JSON documents: top-level fields, no transforms"
            decoded_as = [None] * len(keys)  # the documents' values are any Python objects: each checked
        if self._transform is not None:  # the columns read computed values: each is checked
            assert not nested, "transforms read top-level fields: no nested paths (Mapper.columnar_plan)"
            decoded_as = [None] * len(keys)
            self._decode_lines = self._transform.decode_lines
            self._decode_skipping = self._decode_lines  # the steps' decoder reads every field they name
        elif nested:
            tree = _path_tree(keys, nested.values())
            self._decode_lines = msgspec.json.Decoder(_nested_struct(tree, decoded_as, True)).decode_lines
            self._decode_skipping = msgspec.json.Decoder(_nested_struct(tree, decoded_as, False)).decode_lines
        else:
            self._decode_lines = typed_lines_decoder(keys, decoded_as)
            #: the same, skipping keys no column reads: for batches :func:`_skippable` clears
            self._decode_skipping = typed_lines_decoder(keys, decoded_as, forbid_unknown=False)
        self._empty = self._decode_lines(b"{}")[0]  # the document of a refused value (all fields missing)
        self._stream = memoised_stream_id(stream_id)
        #: per column: (how to read its values from (the documents' fields, each a sequence over the
        #: batch, in the decoder's field order; the batch's record fields), how it is staged,
        #: required, whether its values are known to be of the staged types: checked by the decoder, or
        #: metadata of such a type)
        self._readers: list[tuple[Callable[[list[Sequence[Any]], BatchFields], Sequence[Any]], StagedColumn, bool,
                                  bool]] = []
        for i, (col, staged) in enumerate(zip(columns, kinds, strict=True)):
            if i in nested:
                path = nested[i]
                reader = _nested_reader(keys.index(path[0]), _steps(tree, path))
                typed = False
            elif col.doc_key is not None:
                reader = _doc_reader(keys.index(col.doc_key))
                typed = decoded_as[keys.index(col.doc_key)] is not None
            elif col.metadata == "@stream":
                reader = self._stream_reader
                typed = int in _STAGED_TYPES[staged.kind]
            else:
                assert col.metadata in _METADATA, col.metadata
                name, python_type = _METADATA[col.metadata]
                reader = _field_reader(name)
                typed = python_type in _STAGED_TYPES[staged.kind]
            self._readers.append((reader, staged, col.required, typed))
        #: per column, with ``documents``: the row mapper's coercer where the plan stages a typed format's
        #: logical-type values through it (:func:`_precoerced`: Decimal → numeric, datetime → timestamps)
        self._coercers = [col.coerce if documents is not None and staged.kind in _PRECOERCED else None
                          for col, staged in zip(columns, kinds, strict=True)]
        #: the document keys ``documents`` gives already staged, and as what (``documents_stage``)
        self._staged_keys: dict[str, type] = _staged_keys(columns, kinds) if documents_stage else {}
        self._key_index = key_index
        self._version_index = version_index
        self._init_routing(columns, kinds, key_index, record_key_orders)
        # pyarrow imports pandas (when installed) on its first array from a list: at start-up, not in
        # the first batch
        pa.array([0], type=pa.int64())

    def _init_routing(self, columns: Sequence[FastColumn], kinds: Sequence[StagedColumn],
                      key_index: tuple[int, ...] | None, record_key_orders: bool) -> None:
        """What :meth:`lane_keys` reads: each key column's source and checks, and a decoder of the
        document keys among them (skipping every other key); ``route_refusal`` says why it cannot."""
        #: why :meth:`lane_keys` cannot route this plan's records (lanes > 1 then write by rows), or None
        self.route_refusal: str | None = None
        #: per key column: (document field position, or None for metadata; the metadata attribute;
        #: its staged column)
        self._route: list[tuple[int | None, str | None, StagedColumn]] = []
        self._route_decode: Callable[[bytes], list[Any]] | None = None
        self._route_empty: Any = None
        #: a typed format's documents (Avro, Protobuf): the document keys the key columns read, listed by
        #: the format's own decoder (a second decode of the chunk, the price of routing it columnar)
        self._route_doc_keys: list[str] = []
        if key_index is None:
            if not record_key_orders:
                self.route_refusal = "a table without a conflict key routes by the pipeline key, which it does not read"
            return
        doc_keys: list[str] = []
        for i in key_index:
            col, staged = columns[i], kinds[i]
            if staged.kind not in ("int", "text") or col.default is not None:
                self.route_refusal = (f"the key column {staged.name!r} is routed by its value as the row mapper "
                                      "coerces it; the tier routes integer and text keys without a default")
                return
            if col.doc_key is not None:
                if col.doc_key not in doc_keys:
                    doc_keys.append(col.doc_key)
                self._route.append((doc_keys.index(col.doc_key), None, staged))
            elif col.metadata in _METADATA:
                self._route.append((None, _METADATA[col.metadata][0], staged))
            else:
                self.route_refusal = f"the key column {staged.name!r} reads {col.metadata}, which the tier does not route by"
                return
        if doc_keys and self._documents is not None:
            self._route_doc_keys = doc_keys
            return
        if doc_keys:
            kind_of = {doc_keys.index(columns[i].doc_key): kinds[i].kind for i in key_index  # type: ignore[arg-type]
                       if columns[i].doc_key is not None}
            self._route_decode = typed_lines_decoder(
                doc_keys, [_DECODED_AS[kind_of[j]] for j in range(len(doc_keys))], forbid_unknown=False)
            self._route_empty = self._route_decode(b"{}")[0]
            self._route_fields = [operator.attrgetter(f"f{j}") for j in range(len(doc_keys))]

    def lane_keys(self, records: Sequence[Record], listed: dict[str, list[Any]] | None = None) -> list[Any]:
        """Per record, what the row path routes it to a lane by -- :func:`~ingest.core.routing.key_bytes`
        of its row's key values, or without key columns the record's key -- or :data:`UNROUTED` where
        only the row mapper can say (a value it would coerce, a missing key, a document the decoder
        refused, a republished record: the caller maps that record). Requires ``route_refusal is None``.
        ``listed``: fields of the records already listed (as :meth:`build` takes them). Pure; never
        raises for any record content."""
        n = len(records)
        fields = BatchFields(records, listed)
        if self._key_index is None:
            return fields("key")
        unsure = [False] * n
        by_field: list[Sequence[Any]] = []
        if self._route_decode is not None:
            values = fields("value")
            rejected: set[int] = set()
            if self._payloads is not None:
                values, rejected = self._json_values(records, [b"" if v is None else v for v in values])
            joined = b"\n".join(b"" if v is None else v for v in values)
            if None in values or joined.count(b"\n") != n - 1:
                values = [b"" if v is None or b"\n" in v else v for v in values]
                joined = b"\n".join(values)
            # No _skippable screen: a document whose skipped keys orjson refuses is poison, and poison
            # touches no row (its lane does not matter); every other document's key values are orjson's.
            docs: list[Any] = []
            self._decode(values, 0, docs, rejected, joined, self._route_decode, self._route_empty)
            for i in rejected:
                unsure[i] = True
            by_field = [list(map(get, docs)) for get in self._route_fields]
        elif self._route_doc_keys:  # the decoder's own documents: any type, each value checked below
            try:
                by_field, rejected = self._route_documents(records, self._route_doc_keys)  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - a registry that cannot answer: the row mapper routes them
                return [UNROUTED] * n
            for i in rejected:
                unsure[i] = True
        checked = self._route_decode is not None  # the typed decoder gave only ints (int columns) or strs
        if fields("origin").count(None) != n:
            for i, origin in enumerate(fields("origin")):
                unsure[i] = unsure[i] or origin is not None
        columns = []
        for j, attr, staged in self._route:
            column = by_field[j] if j is not None else fields(attr)  # type: ignore[arg-type]
            typed = checked or j is None  # metadata: ints and strs
            if staged.kind == "int":
                lo, hi = staged.lo, staged.hi
                # the decoder gives ints or None (metadata: ints): a range check per batch when it can
                if not typed or None in column or not (lo <= min(column) and max(column) <= hi):  # type: ignore[operator]
                    unsure = [u or not (type(v) is int and lo <= v <= hi)  # type: ignore[operator]
                              for u, v in zip(unsure, column, strict=True)]
            else:
                if not typed or None in column or "\x00" in "".join(column):
                    unsure = [u or not (type(v) is str and not (staged.forbid_nul and "\x00" in v))
                              for u, v in zip(unsure, column, strict=True)]
            columns.append(column)
        if len(columns) == 1:
            column = columns[0]
            if True in unsure:
                column = [None if u else v for u, v in zip(unsure, column, strict=True)]
            keys = list(map(_key_bytes_of, column))
        else:
            keys = [None if u else key_bytes(k) for k, u in zip(zip(*columns, strict=True), unsure, strict=True)]
        if True in unsure:
            return [UNROUTED if u else k for k, u in zip(keys, unsure, strict=True)]
        return keys

    @staticmethod
    def supports(col: FastColumn) -> str | None:
        """The kind a column is staged as, or None when the tier cannot take it (then no plan is made)."""
        if col.default is not None:
            return None  # a configured default for a missing value: the row mapper's business
        kind = col.inline[0] if col.inline else None
        if kind not in KINDS:
            return None
        if col.doc_key is not None:
            return kind
        if col.metadata == "@stream":
            lo, hi = (col.inline[1], col.inline[2]) if kind == "int" else (0, -1)  # type: ignore[index]
            return kind if kind == "int" and lo <= STREAM_ID_MIN and hi >= STREAM_ID_MAX else None
        return kind if col.metadata in _METADATA else None

    def _stream_reader(self, by_field: list[Sequence[Any]], fields: BatchFields) -> list[Any]:
        """The ``@stream`` column: one digest per partition of the batch, looked up per record in C."""
        stream = self._stream
        partitions = fields("partition")
        topics = set(fields("topic"))
        if len(topics) != 1:
            return list(map(stream, fields("topic"), partitions))
        topic = topics.pop()
        ids = {p: stream(topic, p) for p in set(partitions)}
        return list(map(ids.__getitem__, partitions))

    def build(self, records: Sequence[Record], listed: dict[str, list[Any]] | None = None) -> ColumnarBatch | None:
        """The batch as collapsed Arrow columns plus the records left to the row mapper; None declines
        the whole batch. ``listed``: fields of the records the caller has already listed, by attribute
        name (``offset``: each record's offset, in order...), not listed again. Never raises for any
        record content."""
        n = len(records)
        if n == 0:
            return None
        fields = BatchFields(records, listed)
        values = fields("value")
        if None in values or fields("origin").count(None) != n:
            return None  # tombstones and republished records: the row path
        if self._documents is not None:  # a typed format's documents (Avro): decoded by its own decoder
            try:
                if self._staged_keys:
                    by_field, rejected = self._documents(records, self.keys, self._staged_keys)  # type: ignore[call-arg]
                else:
                    by_field, rejected = self._documents(records, self.keys)
            except Exception:  # noqa: BLE001 - not a record's poison (a registry error): the row path handles it
                return None
            _reject_non_finite(by_field, rejected)
            return self._columns(by_field, fields, rejected, n, {})
        rejected: set[int] = set()
        if self._payloads is not None:  # JSON behind a prefix (json_schema): the texts its decoder parses
            values, rejected = self._json_values(records, values)
        joined = b"\n".join(values)
        if joined.count(b"\n") != n - 1:
            return None  # a value holds a newline: lines would not be records
        docs: list[Any] = []
        strict = None
        if _framed(joined, n):  # most batches: every record holds exactly the keys the columns read
            try:
                strict = self._decode_lines(joined)
            except Exception:  # noqa: BLE001 - another key, or a value the decoder refuses: below
                strict = None
        if strict is not None and len(strict) == n:
            docs = strict
        else:
            self._decode(values, 0, docs, rejected, joined,
                         self._decode_skipping if _skippable(joined) else self._decode_lines, self._empty)
        # the documents transposed: one sequence per field, in C (a tuple per document, then zip)
        by_field: list[Sequence[Any]] = list(zip(*map(_astuple, docs)))
        filtered: dict[str, list[int]] = {}
        if self._transform is not None:  # the transforms' results, and the records they filtered
            by_field, filtered = self._transform.apply(by_field, fields, rejected, n)
        return self._columns(by_field, fields, rejected, n, filtered)

    def _json_values(self, records: Sequence[Record], values: Sequence[bytes]) -> tuple[list[bytes], set[int]]:
        """With ``payloads``: the JSON text of each of ``values`` (the records' values, none None), and the
        positions of the records its decoder does not vouch for (rejected: the row mapper's), an empty
        object standing in for each of their texts."""
        texts = self._payloads(records, values)  # type: ignore[misc]
        if None not in texts:
            return texts, set()  # type: ignore[return-value]
        refused = {i for i, text in enumerate(texts) if text is None}
        return [_NO_TEXT if text is None else text for text in texts], refused

    def build_fields(self, records: Sequence[Record], values: dict[str, list[Any]],
                     listed: dict[str, list[Any]] | None = None) -> ColumnarBatch | None:
        """:meth:`build` of JSON documents decoded elsewhere (ingest.cdc.columnar: the row images of change
        events): ``values``, each document key the plan reads (:attr:`keys`) with its values over the
        batch as a JSON decode gives them (None where missing; every value's type is checked, none is
        trusted to a decoder). For a plan of JSON values without transforms or nested paths. Never raises
        for any record content."""
        assert self._transform is None and not self.nested and self._documents is None, \
            "JSON documents decoded elsewhere: top-level keys only"
        n = len(records)
        if n == 0:
            return None
        fields = BatchFields(records, listed)
        if fields("origin").count(None) != n:
            return None  # republished records: the row path
        return self._columns([values[k] for k in self.keys], fields, set(), n, {}, decoded=False)

    def _columns(self, by_field: list[Sequence[Any]], fields: BatchFields, rejected: set[int], n: int,
                 filtered: dict[str, list[int]], *, decoded: bool = True) -> ColumnarBatch | None:
        """:meth:`build` from the documents' fields on (``by_field``: one sequence per decoded key, over
        the batch, in :attr:`keys` order; ``rejected``: the positions already left to the row mapper,
        added to here): the columns checked, built and collapsed. ``decoded``: by the plan's own
        decoder, whose type checks a column may rely on (False: every column's values are checked)."""
        pa, pc = self._pa, self._pc
        arrays = []
        # each key column's values as Python objects equal where the row mapper's values are (the
        # collapse's keys); None for the other columns
        values_of: list[Sequence[Any] | None] = []
        bad = None
        for i, (reader, staged, required, typed) in enumerate(self._readers):
            kind = staged.kind
            column = reader(by_field, fields)
            coerce = self._coercers[i]
            if coerce is not None and _PRECOERCED[kind] in set(map(type, column)):
                column, unfit = _precoerced(column, kind, coerce, staged.aware)
                if unfit is not None:
                    mask = pa.array(unfit)
                    bad = mask if bad is None else pc.or_(bad, mask)
            types = None
            if not (typed and decoded):
                types = set(map(type, column))
                if not types <= _STAGED_TYPES[kind]:
                    # some value needs the row mapper's coercion
                    column, mask = _without_wrong_types(column, _STAGED_TYPES[kind])
                    mask = pa.array(mask)
                    bad = mask if bad is None else pc.or_(bad, mask)
                    types &= _STAGED_TYPES[kind]
            checks = []
            convert = _CONVERTERS.get(kind)
            if convert is None:
                array = pa.array(column, type=_ARROW_TYPE[kind](pa))
            else:
                array, unfit = convert(pa, pc, column, staged, set(map(type, column)) if types is None else types)
                if unfit is not None:
                    checks.append(unfit)
            if required and array.null_count:
                checks.append(pc.is_null(array))
            if staged.lo is not None:
                checks.append(pc.or_(pc.less(array, staged.lo), pc.greater(array, staged.hi)))
            if kind == "text" and staged.forbid_nul:
                checks.append(pc.match_substring(array, "\x00"))
            elif kind == "decimal":
                checks.append(pc.invert(pc.is_finite(array)))
                if staged.scale is not None:
                    checks.append(_needs_rounding(pc, array, staged.scale, staged.max_abs))
            for check in checks:
                check = pc.fill_null(check, False)
                bad = check if bad is None else pc.or_(bad, check)
            filled = staged.default is not None and not required and array.null_count
            if filled:
                array = pc.fill_null(array, staged.default)
            if self._key_index is None or i not in self._key_index:
                values_of.append(None)
            elif kind == "numeric" and pa.types.is_string(array.type):
                values_of.append([None if v is None else Decimal(v) for v in array.to_pylist()])
            elif kind in ("int", "text", "decimal", "epoch_ms") and not filled:
                values_of.append(column)
            else:  # values the conversion made equal (ISO forms of one instant, 1 and 1.0 ...)
                values_of.append(array.to_pylist())
            arrays.append(array)
        if bad is not None and pc.any(bad).as_py():
            rejected.update(pc.indices_nonzero(bad).to_pylist())
        if filtered:  # a filtered record has no row: its values are not checked, it is not rejected
            dropped = set(itertools.chain.from_iterable(filtered.values()))
            rejected.difference_update(dropped)
            skipped = rejected | dropped
        else:
            skipped = rejected
        table = pa.Table.from_arrays(arrays, names=self._names)
        if self._version_index is not None and _null_at(table.column(self._version_index), skipped):
            return None  # a record without a version: the row path decides
        keep = self._survivors(table, values_of, n, skipped)
        if keep is not None:
            table = table.take(pa.array(keep, type=pa.int64()))
        return ColumnarBatch(table, sorted(rejected), filtered)

    def _decode(self, values: list[bytes], start: int, docs: list[Any], rejected: set[int],
                joined: bytes | None = None, decode: Callable[[bytes], list[Any]] | None = None,
                empty: Any = None) -> None:
        """Append the documents of ``values`` (the batch's from position ``start``; ``joined``: them
        joined by newlines, when the caller has it) to ``docs``, and the positions the decoder refused
        to ``rejected``, an empty document standing in for each. ``values`` hold no newline
        (:meth:`build`). One C call decodes them all when it can; else they are decoded
        :data:`DECODE_PIECE` at a time, a failing piece in halves, down to single values, so a few
        poison records cost a few small decodes, not one call per value of the batch."""
        if decode is None:
            decode, empty = self._decode_lines, self._empty
        n = len(values)
        if n > 1:
            if joined is None:
                joined = b"\n".join(values)
            got = None
            if _framed(joined, n):
                try:
                    got = decode(joined)
                except Exception:  # noqa: BLE001 - some value is not a typed document: split
                    got = None
            if got is not None and len(got) == n:
                docs += got
                return
            step = DECODE_PIECE if n > DECODE_PIECE else (n + 1) // 2
            for i in range(0, n, step):
                self._decode(values[i:i + step], start + i, docs, rejected, None, decode, empty)
            return
        try:
            one = decode(values[0])
            if len(one) != 1:
                raise ValueError("not one document")
            docs.append(one[0])
        except Exception:  # noqa: BLE001 - refused: the row mapper decides
            docs.append(self._empty if empty is None else empty)
            rejected.add(start)

    def _survivors(self, table: Any, values_of: list[Sequence[Any] | None], n: int,
                   rejected: set[int]) -> list[int] | None:
        """Row positions to keep: the accepted records, the winner of each key (None: every row) --
        the last record, or with a version column the highest version, ties to the last (as
        :func:`ingest.core.collapse.collapse` orders a group). ``values_of``: each column of ``table``
        as the Python values it was built from (the keys, without reading them back from Arrow). Per
        record, only C calls."""
        if self._key_index is None:
            return None if not rejected else list(itertools.filterfalse(rejected.__contains__, range(n)))
        order: list[int] | None = None  # None: every position, in batch order
        if self._version_index is not None:
            # positions in (version, position) order: the last of a key in that order is its winner
            # (Arrow's sort is stable; a rejected record's null version sorts last, and it is dropped)
            order = self._pc.sort_indices(table.column(self._version_index)).to_pylist()
        if rejected:
            order = list(itertools.filterfalse(rejected.__contains__, range(n) if order is None else order))
        key_columns: list[Sequence[Any]] = [values_of[i] for i in self._key_index]  # type: ignore[misc]
        if order is not None:
            key_columns = [list(map(column.__getitem__, order)) for column in key_columns]
        keys = key_columns[0] if len(key_columns) == 1 else list(zip(*key_columns, strict=True))
        return sorted(dict(zip(keys, range(n) if order is None else order, strict=True)).values())


def _null_at(array: Any, rejected: set[int]) -> bool:
    """Whether ``array`` is null anywhere but at the ``rejected`` positions."""
    if not array.null_count:
        return False
    return any(v is None for i, v in enumerate(array.to_pylist()) if i not in rejected)


def _without_wrong_types(column: Sequence[Any], staged: frozenset[type]) -> tuple[list[Any], list[bool]]:
    """``column`` with null where a value's type is not one the column stages,
    and the mask of those positions (the records the row mapper must coerce). C calls per value."""
    mask = list(map(operator.not_, map(staged.__contains__, map(type, column))))
    column = list(column)
    for i in itertools.compress(range(len(column)), mask):
        column[i] = None
    return column, mask


def _needs_rounding(pc: Any, array: Any, scale: int, max_abs: float | None) -> Any:
    """True where a float's shortest digits (Arrow's cast writes them, as ``repr`` does) are not plain
    with at most ``scale`` decimals, or its magnitude is not below ``max_abs``: values the row mapper
    rounds or refuses."""
    plain = pc.match_substring_regex(pc.cast(array, "string"), f"^-?[0-9]+(\\.[0-9]{{1,{scale}}})?$")
    small = pc.less(pc.abs(array), max_abs) if max_abs is not None else plain
    return pc.invert(pc.and_(plain, small))


#: Digits and ``.`` as ``0``, ``e``/``E`` as ``e``, ``+`` kept, every other byte a space: the shape of
#: the numbers in a batch, searched by :func:`_big_number` at C speed.
_NUMBER_SHAPE = bytes.maketrans(bytes(range(256)), bytes(
    ord("0") if chr(b) in "0123456789." else ord("e") if chr(b) in "eE" else ord("+") if b == ord("+") else ord(" ")
    for b in range(256)))
#: What may start a JSON number token: the bytes before one (``[``, ``,``, ``:``, whitespace).
_BEFORE_NUMBER = frozenset(b"[,: \t\r\n\f\v")


def _big_number(joined: bytes) -> bool:
    """Whether ``joined`` may hold a JSON number beyond a double's range (which orjson refuses and
    msgspec does not check where it skips): a number token -- a run of digits and points, after one of
    :data:`_BEFORE_NUMBER` and an optional ``-`` -- holding twenty digits or points in a row, or an
    exponent of three digits or more. One translation and substring searches in C; Python only per
    such run (text inside strings may match too: then the batch is decoded the strict way)."""
    shape = joined.translate(_NUMBER_SHAPE)
    rfind, find = shape.rfind, shape.find
    for pattern in (b"00000000000000000000", b"0e000", b"0e+000"):
        pos = find(pattern)
        while pos != -1:
            # the run of digits and points holding the match starts after the last other byte before it
            # (looked for in the 64 bytes before it: a longer run is taken as a number)
            low = max(pos - 64, 0)
            begin = max(rfind(b" ", low, pos), rfind(b"e", low, pos), rfind(b"+", low, pos)) + 1
            if begin == 0 and low > 0:
                return True
            if begin > 0 and joined[begin - 1] == 0x2D:  # a minus sign
                begin -= 1
            if begin == 0 or joined[begin - 1] in _BEFORE_NUMBER:
                return True
            # past this run (its other matches start alike)
            high = pos + 64
            ends = [e for e in (find(b" ", pos, high), find(b"e", pos + 1, high), find(b"+", pos, high)) if e != -1]
            pos = find(pattern, min(ends) if ends else high)
    return False


#: A value opening this many brackets (``[``, ``{``) is never decoded skipping keys (orjson's nesting
#: limit is 1024 levels, and a value that deep opens at least that many).
MAX_SKIPPED_OPEN = 1000


def n_values(joined: bytes) -> int:
    """How many newline-separated values ``joined`` holds."""
    return joined.count(b"\n") + 1


def _skippable(joined: bytes) -> bool:
    """Whether keys no column reads may be skipped in this batch (``typed_lines_decoder(...,
    forbid_unknown=False)``): its bytes are UTF-8, it holds no number that may be beyond a double's
    range -- the two things orjson checks that msgspec does not check in what it skips -- and no
    value nests deeper than orjson allows. A batch that is not is decoded with unknown keys refused
    (their records go to the row mapper)."""
    if not joined.isascii():
        try:
            joined.decode("utf-8")
        except UnicodeDecodeError:
            return False
    if _big_number(joined):
        return False
    # Nesting: orjson refuses a document deeper than 1024; msgspec's limit follows the interpreter's
    # recursion limit (refusing deeper than it less the stack in use), which may be raised above that.
    # A value that deep opens at least that many brackets.
    if sys.getrecursionlimit() <= MAX_SKIPPED_OPEN:
        return True
    opened = joined.count(b"[") + joined.count(b"{")
    if opened - n_values(joined) < MAX_SKIPPED_OPEN:
        return True
    return all(v.count(b"[") + v.count(b"{") < MAX_SKIPPED_OPEN for v in joined.split(b"\n"))


def _framed(joined: bytes, n: int) -> bool:
    """Whether decoding ``joined`` (``n`` values joined by the only ``n - 1`` newlines) as lines can
    only give document ``i`` from value ``i``: every value starts with ``{`` and ends with ``}``.

    The decoder reads whitespace-separated documents, not lines: it skips an empty line, reads two
    documents from ``{"id":1}{"id":2}`` and one from ``{"id":`` and ``1}`` on two lines, so ``n``
    documents from ``n`` lines alone proves nothing. With the rule no document spans a newline (the
    next line starts with ``{`` where a document in progress needs ``,``, ``}`` or ``]``, and a string
    cannot hold a raw newline), so every line holds at least one document, and ``n`` of them means
    exactly one each. A batch that breaks the rule is decoded in pieces (:meth:`ColumnarPlan._decode`).

    One scan: each of the ``n - 1`` newlines must sit in its own ``}\n{`` (the occurrences cannot
    overlap: each holds exactly one newline), which with a leading ``{`` and a trailing ``}`` is the rule."""
    return joined[:1] == b"{" and joined[-1:] == b"}" and joined.count(b"}\n{") == n - 1


class BatchFields:
    """A batch's records and their fields, each listed once (by a C map) when first asked for:
    ``fields("offset")`` is every record's offset, in order. ``listed``: lists a caller already
    made, by attribute name, taken as they are."""

    __slots__ = ("_records", "_lists")

    def __init__(self, records: Sequence[Record], listed: dict[str, list[Any]] | None = None) -> None:
        self._records = records
        self._lists = dict(listed) if listed else {}

    def __call__(self, name: str) -> list[Any]:
        got = self._lists.get(name)
        if got is None:
            got = self._lists[name] = list(map(operator.attrgetter(name), self._records))
        return got


def document_fields(documents: Callable[[Sequence[Record]], list[Any]], records: Sequence[Record],
                    keys: Sequence[str]) -> tuple[list[Sequence[Any]], set[int]]:
    """A non-JSON batch's documents as the plan reads them, from ``documents`` (a decoder's
    ``decode_batch``): per key of ``keys``, each record's value of that top-level key (None where the
    document lacks it, as the row mapper's getter reads a missing key), and the positions left to the
    row mapper: a record whose decode raised InvalidRecord (its poison, which the row mapper decides
    again, identically) and a document that is not a dict (the row mapper's ``not an object``).
    Raises what ``documents`` raises (a registry error: the plan declines the batch)."""
    docs = documents(records)
    rejected: set[int] = set()
    if not all(type(d) is dict for d in docs):
        for i, d in enumerate(docs):
            if type(d) is not dict:
                rejected.add(i)
        docs = [d if type(d) is dict else _NO_FIELDS for d in docs]
    return [[d.get(key) for d in docs] for key in keys], rejected


def _reject_non_finite(by_field: list[Sequence[Any]], rejected: set[int]) -> None:
    """Add to ``rejected`` the records holding a non-finite float in a read field: JSON never has one,
    and the plan's conversions were proven on JSON's values only (the row mapper decides them)."""
    for column in by_field:
        if float in set(map(type, column)):
            for i, v in enumerate(column):
                if type(v) is float and not math.isfinite(v):
                    rejected.add(i)


#: the JSON text standing in for a value the format's decoder does not vouch for (``payloads``)
_NO_TEXT = b"{}"

#: a refused document's fields (every key missing)
_NO_FIELDS: dict[str, Any] = {}


def _doc_reader(j: int) -> Callable[[list[Sequence[Any]], BatchFields], Sequence[Any]]:
    def read(by_field: list[Sequence[Any]], fields: BatchFields) -> Sequence[Any]:
        return by_field[j]

    return read


def _key_bytes_of(v: Any) -> bytes | None:
    """:func:`~ingest.core.routing.key_bytes` of one int or str key value (None: the caller's UNROUTED)."""
    return b"%d" % v if type(v) is int else None if v is None else v.encode("utf-8", "surrogatepass")


def _path_tree(keys: Sequence[str], paths: Any) -> dict[str, Any]:
    """The documents' shape the plan decodes: each top-level key (in ``keys`` order) maps to None (a
    value) or to the tree of the keys read inside it."""
    tree: dict[str, Any] = {key: None for key in keys}
    for path in paths:
        node = tree
        for step in path[:-1]:
            if node.get(step) is None:
                node[step] = {}
            node = node[step]
        node.setdefault(path[-1], None)
    return tree


def _nested_struct(tree: dict[str, Any], decoded_as: Sequence[str | None] | None, forbid_unknown: bool) -> Any:
    """The Struct of ``tree``: field ``f<j>`` is its ``j``-th key, a JSON scalar (narrowed as
    ``decoded_as[j]`` says, at the top level) or, for a key with a subtree, that subtree's Struct or
    null. Unknown keys refused unless ``forbid_unknown`` is false (see :func:`_skippable`)."""
    names, types = [], []
    for j, (key, sub) in enumerate(tree.items()):
        names.append(f"f{j}")
        if sub is not None:
            types.append(Union[_nested_struct(sub, None, forbid_unknown), None])  # noqa: UP007
        else:
            narrow = decoded_as[j] if decoded_as is not None else None
            types.append(TYPED_FIELDS[narrow] if narrow is not None else _SCALAR)
    return msgspec.defstruct("TypedDocument", [(n, t, None) for n, t in zip(names, types, strict=True)],
                             rename=dict(zip(names, tree, strict=True)), forbid_unknown_fields=forbid_unknown,
                             gc=False)


def _steps(tree: dict[str, Any], path: tuple[str, ...]) -> list[Callable[[Any], Any]]:
    """Attribute getters that walk ``path`` (after its first key) through :func:`_nested_struct`'s Structs."""
    getters = []
    node = tree[path[0]]
    for step in path[1:]:
        getters.append(operator.attrgetter(f"f{list(node).index(step)}"))
        node = node[step]
    return getters


def _nested_reader(j: int, steps: list[Callable[[Any], Any]]) -> Callable[[list[Sequence[Any]], BatchFields], list[Any]]:
    def read(by_field: list[Sequence[Any]], fields: BatchFields) -> list[Any]:
        values: Sequence[Any] = by_field[j]
        for get in steps:
            values = [None if v is None else get(v) for v in values]
        return list(values)

    return read


def _field_reader(name: str) -> Callable[[list[Sequence[Any]], BatchFields], list[Any]]:
    def read(by_field: list[Sequence[Any]], fields: BatchFields) -> list[Any]:
        return fields(name)

    return read


_ARROW_TYPE: dict[str, Callable[[Any], Any]] = {
    "int": lambda pa: pa.int64(),
    "text": lambda pa: pa.string(),
    "decimal": lambda pa: pa.float64(),
    "epoch_ms": lambda pa: pa.int64(),
}


# --------------------------------------------------------------------------- PostgreSQL conversions
# Each takes a column's values (of the kind's staged Python types, or None) and returns the Arrow
# array the sink stages and the mask of the values the row mapper must decide (or None): for the
# values it keeps, the stage converted by the upsert holds exactly what the row mapper's coercer
# (coerce_pg) returns for them.

#: Decimal text the tier stages for a ``numeric`` column as it is: a sign, digits, a point and digits (a
#: subset of what ``_numeric`` reads -- no exponent, no ``+``, no bare point -- of at most
#: :data:`MAX_DECIMAL_TEXT` characters).
_PLAIN_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
MAX_DECIMAL_TEXT = 1000


def _numeric_text(v: Any) -> bytes | None:
    """:func:`_number_text`, and plain decimal text (:data:`_PLAIN_DECIMAL`) as itself; ``b"null"`` for
    other text (the row mapper's)."""
    if type(v) is str:
        return v.encode() if len(v) <= MAX_DECIMAL_TEXT and _PLAIN_DECIMAL.fullmatch(v) else b"null"
    return _number_text(v)


class Digits(str):
    """A numeric value the row mapper's coercer returned (a Decimal), as its exact text: what the plan
    stages for a typed format's ``decimal`` (:func:`_precoerced`). A type of its own, so that text a
    document holds (staged only as plain decimal digits, :func:`_numeric_text`; the rest the row mapper
    parses) is never taken for it."""

    __slots__ = ()


class Micros(int):
    """A timestamp the row mapper's coercer returned (a datetime), as microseconds since the epoch of
    its column (aware: UTC; naive: its wall clock): what the plan stages for a typed format's
    ``timestamp-*`` values (:func:`_precoerced`). A type of its own: an int a document holds is epoch
    milliseconds."""

    __slots__ = ()


_STAGED_TYPES["numeric"] = _STAGED_TYPES["numeric"] | {Digits}
_STAGED_TYPES["timestamp"] = _STAGED_TYPES["timestamp"] | {Micros}

#: The kinds whose values of a typed format's logical types go through the row mapper's coercer, and
#: the Python type of those values (fastavro's ``decimal`` and ``timestamp-*``).
_PRECOERCED: dict[str, type] = {"numeric": Decimal, "timestamp": datetime}


#: The row mapper's coercers that give a typed format's logical-type value back unchanged (a Decimal as
#: it is, a UTC datetime as it is or as its naive UTC wall clock), so that the staged form of the value
#: (:func:`_precoerced`: its text, its microseconds since the epoch) can be made without them: by
#: coercer, the type the plan stages those values as.
_STAGED_BY_COERCER: dict[Any, type] = {coerce_pg._numeric: Digits, coerce_pg._timestamptz: Micros,
                                      coerce_pg._timestamp: Micros}


def _staged_keys(columns: Sequence[FastColumn], kinds: Sequence[StagedColumn]) -> dict[str, type]:
    """The document keys read only by columns of :data:`_PRECOERCED` kinds through one of
    :data:`_STAGED_BY_COERCER`'s coercers, all staging one type: by key, that type."""
    by_key: dict[str, set[Any]] = {}
    for col, staged in zip(columns, kinds, strict=True):
        if col.doc_key is not None:
            as_type = _STAGED_BY_COERCER.get(col.coerce) if staged.kind in _PRECOERCED else None
            by_key.setdefault(col.doc_key, set()).add(as_type)
    return {key: types.pop() for key, types in by_key.items() if len(types) == 1 and None not in types}


def _precoerced(column: Sequence[Any], kind: str, coerce: Callable[[Any], Any],
                aware: bool = False) -> tuple[list[Any], list[bool] | None]:
    """``column`` with each value of :data:`_PRECOERCED`'s type for ``kind`` replaced by what the row
    mapper's own ``coerce`` makes of it, staged exactly: a Decimal as :class:`Digits` (its ``str``,
    which PostgreSQL reads as the same number), a datetime as :class:`Micros` (since the epoch of its
    own zone: ``aware`` says which the column's coercer returns); and the mask of the
    values ``coerce`` refused (set to None: the row mapper decides them), None when it refused none.
    Other values are left as they are (checked by type as always)."""
    foreign = _PRECOERCED[kind]
    try:  # the common case, in one comprehension: every value coerces (and a timestamp column's are all aware,
        # or all naive); any exception: value by value below
        if kind == "numeric":
            return [_digits(coerce(v)) if type(v) is foreign else v for v in column], None
        epoch = _EPOCH_AWARE if aware else _EPOCH_NAIVE  # what the column's coercer returns (else: below)
        return [Micros((coerce(v) - epoch) // _US) if type(v) is foreign else v for v in column], None
    except Exception:  # noqa: BLE001 - some value the coercer refuses (or a mix of aware and naive): below
        pass
    out = list(column)
    unfit: list[bool] | None = None
    for i, v in enumerate(out):
        if type(v) is not foreign:
            continue
        try:
            c = coerce(v)
            if kind == "numeric":
                if type(c) is not Decimal or not c.is_finite():
                    raise ValueError(c)
                out[i] = Digits(c)
            else:
                if type(c) is not datetime:
                    raise ValueError(c)
                out[i] = Micros((c - (_EPOCH_NAIVE if c.tzinfo is None else _EPOCH_AWARE)) // _US)
        except Exception:  # noqa: BLE001 - the row mapper's failure (poison, or its business): it decides
            out[i] = None
            if unfit is None:
                unfit = [False] * len(out)
            unfit[i] = True
    return out, unfit


def _digits(c: Any) -> Digits:
    """A numeric coercer's result as :class:`Digits`; ValueError for anything but a finite Decimal."""
    if type(c) is not Decimal or not c.is_finite():
        raise ValueError(c)
    return Digits(c)


def _number_text(v: Any) -> bytes | None:
    """A JSON number's text as ``float_decimal`` reads it (orjson's shortest digits of a float, an
    int's digits): ``b"null"`` for a float that is not finite (orjson writes those so); a
    :class:`Digits` as its text."""
    if v is None:
        return None
    if type(v) is Digits:
        return v.encode()
    try:
        return orjson.dumps(v)
    except TypeError:  # an integer beyond 64 bits (the decoder refuses those): the row mapper's
        return b"null"


def _numeric_array(pa: Any, pc: Any, column: Sequence[Any], staged: StagedColumn, types: set[type]) -> tuple[Any, Any]:
    """``numeric``: floats (and ints) as ``_numeric`` reads them -- a float's shortest digits, an int's
    digits -- cast by the upsert to the column's type. Floats alone, into a ``numeric(p,s)`` column,
    go as a float64 array (Arrow's CSV writer writes the same shortest digits, and the scale is the
    column's); otherwise as that text. Text (a decimal sent as a string, e.g. Debezium's
    ``decimal.handling.mode=string``) is staged as itself when it is plain decimal digits
    (:data:`_PLAIN_DECIMAL`): ``Decimal(text)``, which ``_numeric`` gives the row path, and PostgreSQL's
    ``numeric`` input of the text are then the same number; other text goes to the row mapper."""
    if not staged.as_text and int not in types and str not in types and Digits not in types:
        array = pa.array(column, type=pa.float64())
        return array, pc.invert(pc.is_finite(array))
    texts = list(map(_number_text, column)) if str not in types else list(map(_numeric_text, column))
    unfit = None
    if b"null" in texts:
        mask = [t == b"null" for t in texts]
        texts = [None if m else t for t, m in zip(texts, mask, strict=True)]
        unfit = pa.array(mask)
    return pa.array(texts, type=pa.string()), unfit


def _iso(v: str) -> datetime | None:
    """``v`` parsed as ``_timestamptz`` / ``_timestamp`` parse text, or None where they refuse it."""
    if len(v) > _MAX_DATETIME_TEXT:
        return None
    try:
        return datetime.fromisoformat(v)
    except ValueError:
        return None


#: Epoch milliseconds beyond this magnitude are out of the staged range (clipped to it before the
#: multiplication, so the range check rejects them without an overflow).
_MS_CLIP = PG_US_MAX // 1000 + 1


def _timestamp_array(pa: Any, pc: Any, column: Sequence[Any], staged: StagedColumn,
                     types: set[type]) -> tuple[Any, Any]:
    """``timestamptz`` / ``timestamp``: microseconds since the epoch of the instant the row mapper's
    datetime stands for -- epoch milliseconds times 1000, ISO 8601 text parsed by the very
    ``datetime.fromisoformat`` it calls (text without a zone is UTC, a zone's offset is subtracted to
    the microsecond). The range check (``lo``/``hi``) rejects what lies beyond :data:`PG_US_MAX`."""
    if Micros in types:  # a typed format's datetimes, as the row mapper coerced them (maybe beside ints)
        if int in types:  # epoch milliseconds beside them: their microseconds, as Micros (not multiplied below)
            column = [Micros(max(min(v, _MS_CLIP), -_MS_CLIP) * 1000) if type(v) is int else v for v in column]
        if str not in types:
            return pa.array(column, type=pa.int64()), None
        types = types - {int}
    if str not in types:
        ms = pa.array(column, type=pa.int64())
        return pc.multiply(pc.max_element_wise(pc.min_element_wise(ms, _MS_CLIP, skip_nulls=False), -_MS_CLIP,
                                                  skip_nulls=False), 1000), None
    n = len(column)
    at = [i for i, t in enumerate(map(type, column)) if t is str]
    parsed = list(map(_iso, map(column.__getitem__, at)))
    walls = [d if d is None or d.tzinfo is None else d.replace(tzinfo=None) for d in parsed]
    offsets = [None if d is None else d.utcoffset() for d in parsed]
    us = pc.subtract(pa.array(walls, type=pa.timestamp("us")).cast(pa.int64()),
                     pc.fill_null(pa.array(offsets, type=pa.duration("us")).cast(pa.int64()), 0)).to_pylist()
    out: list[Any] = list(column) if int in types or Micros in types else [None] * n
    if int in types:
        for i, v in enumerate(out):
            if type(v) is int:
                out[i] = max(min(v, _MS_CLIP), -_MS_CLIP) * 1000
    for i, u in zip(at, us, strict=True):
        out[i] = u
    unfit = None
    if None in parsed:
        mask = [False] * n
        for i, d in zip(at, parsed, strict=True):
            mask[i] = d is None
        unfit = pa.array(mask)
    return pa.array(out, type=pa.int64()), unfit


def _float_array(pa: Any, pc: Any, column: Sequence[Any], staged: StagedColumn, types: set[type]) -> tuple[Any, Any]:
    """``double precision``: floats as they are, ints as ``float(v)`` (``_float_coercer``)."""
    if int in types:
        column = [float(v) if type(v) is int else v for v in column]
    array = pa.array(column, type=pa.float64())
    return array, pc.invert(pc.is_finite(array))


_NOT_BOOL = object()


def _bool_of(v: Any) -> Any:
    """``_boolean``'s value for ``v`` (a bool, an int, a str, or None), or :data:`_NOT_BOOL`."""
    t = type(v)
    if v is None or t is bool:
        return v
    if t is int:
        return True if v == 1 else False if v == 0 else _NOT_BOOL
    low = v.lower()
    return True if low in _TRUE else False if low in _FALSE else _NOT_BOOL


def _bool_array(pa: Any, pc: Any, column: Sequence[Any], staged: StagedColumn, types: set[type]) -> tuple[Any, Any]:
    """``boolean``: bools, 0 / 1, and the words ``_boolean`` takes (``true``, ``f``, ``1`` ..., any case)."""
    if types <= {bool, type(None)}:
        return pa.array(column, type=pa.bool_()), None
    values = list(map(_bool_of, column))
    mask = [v is _NOT_BOOL for v in values]
    if not any(mask):
        return pa.array(values, type=pa.bool_()), None
    return pa.array([None if m else v for v, m in zip(values, mask, strict=True)], type=pa.bool_()), pa.array(mask)


def _json_text(coerce: Callable[[Any], str], v: Any) -> Any:
    """A ``json`` column's staged text for ``v`` (a decoded scalar, or a value's raw JSON bytes parsed by
    orjson as the row mapper's decode parses them): ``coerce(value)``; None for a JSON null (a missing
    value); :data:`_NOT_BOOL` where the row mapper must decide."""
    try:
        if type(v) is msgspec.Raw:
            raw = bytes(v)
            if raw.count(b"[") + raw.count(b"{") >= MAX_SKIPPED_OPEN:
                return _NOT_BOOL  # nesting near orjson's limit, which counts the document's own level too
            v = orjson.loads(raw)
            if v is None:
                return None
        return coerce(v)
    except Exception:  # noqa: BLE001 - orjson refuses it, or the coercer does: the row mapper decides
        return _NOT_BOOL


def _json_array(pa: Any, pc: Any, column: Sequence[Any], staged: StagedColumn, types: set[type]) -> tuple[Any, Any]:
    """``json`` / ``jsonb``: the row mapper's coercer (compact JSON text, no NUL) of each value, the
    upsert casting the text as the row path's stage does."""
    coerce = staged.coerce
    texts = [None if v is None else _json_text(coerce, v) for v in column]
    mask = [t is _NOT_BOOL for t in texts]
    if not any(mask):
        return pa.array(texts, type=pa.string()), None
    return pa.array([None if m else t for t, m in zip(texts, mask, strict=True)], type=pa.string()), pa.array(mask)


# --------------------------------------------------------------------------- ClickHouse, typed formats

#: The Python type of what a ``coerced_*`` column's coercer returns for the values it takes.
_COERCED_TYPE = {"coerced_decimal": Decimal, "coerced_ticks": int}


def _coerced_array(pa: Any, pc: Any, column: Sequence[Any], staged: StagedColumn, types: set[type]) -> tuple[Any, Any]:
    """``coerced_decimal`` / ``coerced_ticks`` (a typed format's values into ClickHouse ``Decimal(P,S)`` /
    ``DateTime64(p)``): each value replaced by what the row mapper's own coercer returns for it -- the
    Decimal it rounded to the column's scale, as Arrow ``decimal(P,S)``; the DateTime64 ticks, as int64
    -- which the row path's Arrow insert writes as they are. A value the coercer refuses, or whose result
    Arrow cannot hold exactly (ticks beyond int64), is the row mapper's (masked)."""
    coerce, wanted = staged.coerce, _COERCED_TYPE[staged.kind]
    if staged.kind == "coerced_decimal":
        arrow_type = (pa.decimal128 if staged.precision <= 38 else pa.decimal256)(staged.precision, staged.scale)  # type: ignore[operator]
    else:
        arrow_type = pa.int64()
    out: list[Any] = []
    unfit = [False] * len(column)
    for i, v in enumerate(column):
        if v is not None:
            try:
                v = coerce(v)
                if type(v) is not wanted or (wanted is Decimal and not v.is_finite()):
                    raise ValueError(v)
            except Exception:  # noqa: BLE001 - the row mapper's failure (poison, or its business): it decides
                v, unfit[i] = None, True
        out.append(v)
    try:
        array = pa.array(out, type=arrow_type)
    except (pa.ArrowException, OverflowError):  # some value Arrow does not hold exactly: value by value
        for i, v in enumerate(out):
            try:
                pa.scalar(v, type=arrow_type)
            except (pa.ArrowException, OverflowError):
                out[i], unfit[i] = None, True
        array = pa.array(out, type=arrow_type)
    return array, pa.array(unfit) if True in unfit else None


_CONVERTERS: dict[str, Callable[[Any, Any, Sequence[Any], StagedColumn, set[type]], tuple[Any, Any]]] = {
    "numeric": _numeric_array,
    "timestamp": _timestamp_array,
    "float": _float_array,
    "bool": _bool_array,
    "json": _json_array,
    "coerced_decimal": _coerced_array,
    "coerced_ticks": _coerced_array,
}
