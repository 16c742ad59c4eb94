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
ticks in Arrow (:meth:`ingest.sinks.clickhouse.sink.ClickHouseSink.write_columns`).

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

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ingest.core.dialects import ChType
from ingest.core.mapping.coerce_ch import CH_DT64_MAX_MS
from ingest.core.mapping.fastmap import (
    EXACT_FROMTIMESTAMP_MS,
    STREAM_ID_MAX,
    STREAM_ID_MIN,
    FastColumn,
    memoised_stream_id,
    typed_lines_decoder,
)
from ingest.core.routing import stream_id
from ingest.types import Record

#: The kinds of column the tier stages, by the row mapper's inline check (``FastColumn.inline``):
#: ``int`` (an int8 stage column), ``text``, ``decimal`` (text: the float's shortest digits) and
#: ``epoch_ms`` (int8 milliseconds; the upsert adds them to the epoch).
KINDS = ("int", "text", "decimal", "epoch_ms")

#: Metadata sources the tier reads off the records (a republished record declines the batch): the
#: record's attribute, and the Python type of its values (or None).
_METADATA: dict[str, tuple[str, type]] = {
    "@topic": ("topic", str),
    "@partition": ("partition", int),
    "@offset": ("offset", int),
    "@timestamp": ("timestamp_ms", int),
}

_astuple = msgspec.structs.astuple

#: The signed 64-bit range of the tier's integer arrays (the typed decoder refuses integers beyond it).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: A batch whose one-call decode fails is decoded this many values at a time (a piece that fails, in
#: halves): a few poison records cost a few small decodes, not one call per value of the batch.
DECODE_PIECE = 64

#: The Python types a column of each kind may hold, null (a missing value) included.
_STAGED_TYPES = {kind: frozenset({t, type(None)})
                 for kind, t in (("int", int), ("text", str), ("decimal", float), ("epoch_ms", int))}

#: The kinds whose values the decoder can check itself (:data:`~ingest.core.mapping.fastmap.TYPED_FIELDS`:
#: exactly the Python types of :data:`_STAGED_TYPES`).
_DECODED_AS = {"int": "int", "epoch_ms": "int", "text": "str"}


@dataclass(frozen=True, slots=True)
class StagedColumn:
    """One sink column as the tier stages it, and the checks its values must pass (the rest go to the
    row mapper).

    ``kind``: one of :data:`KINDS`. ``lo``/``hi``: the accepted range of an ``int`` or ``epoch_ms``
    column. ``aware``: an ``epoch_ms`` column is ``timestamptz`` (PostgreSQL). ``forbid_nul``: a
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


def pg_staged(name: str, col: FastColumn, full_type: str) -> StagedColumn | None:
    """How the tier stages a PostgreSQL column (``full_type``: the mapper's normalised type), or None
    when it cannot (then no plan is made)."""
    kind = ColumnarPlan.supports(col)
    if kind is None or (kind == "decimal" and "(" not in full_type):
        # an unconstrained numeric keeps the digits' own scale: Arrow writes 967.0 as "967"
        return None
    lo = hi = None
    if kind == "int":
        _, lo, hi = col.inline  # type: ignore[misc]
    elif kind == "epoch_ms":
        # Only the range where the database's millisecond arithmetic is exact in a double (and
        # ``fromtimestamp`` agrees): beyond it, the row mapper.
        lo, hi = max(col.inline[2], 0), min(col.inline[3], EXACT_FROMTIMESTAMP_MS - 1)  # type: ignore[index]
    return StagedColumn(name, kind, aware=full_type.startswith("timestamptz"), lo=lo, hi=hi,
                        forbid_nul=bool(col.inline[1]) if kind == "text" else True)  # type: ignore[index]


def ch_staged(name: str, col: FastColumn, t: ChType) -> StagedColumn | None:
    """How the tier stages a ClickHouse column of type ``t``, or None when it cannot: integers,
    ``String``, ``Decimal(P, S)`` (values that need no rounding, see :class:`StagedColumn`) and
    ``DateTime64(p)`` from epoch milliseconds, each possibly ``Nullable``/``LowCardinality``. The
    sink turns the staged columns into its own Arrow types
    (:meth:`~ingest.sinks.clickhouse.sink.ClickHouseSink.use_columnar`)."""
    if col.default is not None:
        return None
    while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
        t = t.inner
    if t.kind == "decimal":
        kind = "decimal"
    elif t.kind == "datetime64":
        kind = "epoch_ms"
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
    if kind == "decimal":
        # as the row mapper's exact branch (coerce_ch._ch_decimal): |v| < 10**(P-S) / 10
        return StagedColumn(name, kind, scale=t.scale, max_abs=float(10 ** (t.precision - t.scale)) / 10)
    return StagedColumn(name, kind, lo=0, hi=CH_DT64_MAX_MS)


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
                 transform: Any = None) -> None:
        """``transform``: the pipeline's transforms compiled for the tier
        (:class:`ingest.core.transforms.columnar.ColumnarTransform`): the batch is decoded by its
        decoder and the columns read its results (``keys``: the document keys after the steps).
        ``key_index``: the positions of the key columns whose rows collapse (None: every row kept);
        ``version_index``: the position of the version column (an ``int`` column) whose highest value
        wins a key, ties going to the last record (None: the last record wins)."""
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
        if self._transform is not None:  # the columns read computed values: each is checked
            decoded_as = [None] * len(keys)
            self._decode_lines = self._transform.decode_lines
        else:
            self._decode_lines = typed_lines_decoder(keys, decoded_as)
        self._empty = self._decode_lines(b"{}")[0]  # the document of a refused value (all fields missing)
        self._stream = memoised_stream_id(stream_id)
        #: per column: (how to read its values from (the documents' fields, each a sequence over the
        #: batch, in the decoder's field order; the batch's record fields), how it is staged,
        #: required, whether its values are known to be of the staged types: checked by the decoder, or
        #: metadata of such a type)
        self._readers: list[tuple[Callable[[list[Sequence[Any]], BatchFields], Sequence[Any]], StagedColumn, bool,
                                  bool]] = []
        for col, staged in zip(columns, kinds, strict=True):
            if col.doc_key is not None:
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
        self._key_index = key_index
        self._version_index = version_index
        # pyarrow imports pandas (when installed) on its first array from a list: at start-up, not in
        # the first batch
        pa.array([0], type=pa.int64())

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
        pa, pc = self._pa, self._pc
        n = len(records)
        if n == 0:
            return None
        fields = BatchFields(records, listed)
        values = fields("value")
        if None in values or fields("origin").count(None) != n:
            return None  # tombstones and republished records: the row path
        joined = b"\n".join(values)
        if joined.count(b"\n") != n - 1:
            return None  # a value holds a newline: lines would not be records
        docs: list[Any] = []
        rejected: set[int] = set()
        self._decode(values, 0, docs, rejected, joined)
        # the documents transposed: one sequence per field, in C (a tuple per document, then zip)
        by_field: list[Sequence[Any]] = list(zip(*map(_astuple, docs)))
        filtered: dict[str, list[int]] = {}
        if self._transform is not None:  # the transforms' results, and the records they filtered
            by_field, filtered = self._transform.apply(by_field, fields, rejected, n)
        arrays = []
        values_of: list[Sequence[Any]] = []  # each column's values as Python objects (the collapse's keys)
        bad = None
        for reader, staged, required, typed in self._readers:
            kind = staged.kind
            column = reader(by_field, fields)
            if not typed and not set(map(type, column)) <= _STAGED_TYPES[kind]:
                # some value needs the row mapper's coercion
                column, mask = _without_wrong_types(column, _STAGED_TYPES[kind])
                mask = pa.array(mask)
                bad = mask if bad is None else pc.or_(bad, mask)
            array = pa.array(column, type=_ARROW_TYPE[kind](pa))
            checks = []
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
            arrays.append(array)
            values_of.append(column)
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
                joined: bytes | None = None) -> None:
        """Append the documents of ``values`` (the batch's from position ``start``; ``joined``: them
        joined by newlines, when the caller has it) to ``docs``, and the positions the decoder refused
        to ``rejected``, an empty document standing in for each. ``values`` hold no newline
        (:meth:`build`). One C call decodes them all when it can; else they are decoded
        :data:`DECODE_PIECE` at a time, a failing piece in halves, down to single values, so a few
        poison records cost a few small decodes, not one call per value of the batch."""
        decode = self._decode_lines
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
                self._decode(values[i:i + step], start + i, docs, rejected)
            return
        try:
            one = decode(values[0])
            if len(one) != 1:
                raise ValueError("not one document")
            docs.append(one[0])
        except Exception:  # noqa: BLE001 - refused: the row mapper decides
            docs.append(self._empty)
            rejected.add(start)

    def _survivors(self, table: Any, values_of: list[Sequence[Any]], n: int, rejected: set[int]) -> list[int] | None:
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
        key_columns = [values_of[i] for i in self._key_index]
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


def _doc_reader(j: int) -> Callable[[list[Sequence[Any]], BatchFields], Sequence[Any]]:
    def read(by_field: list[Sequence[Any]], fields: BatchFields) -> Sequence[Any]:
        return by_field[j]

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
