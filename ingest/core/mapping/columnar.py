"""The columnar tier: a whole batch of JSON records mapped to Arrow columns at once (issue #19).

The row path maps each record in Python (:class:`~ingest.core.mapping.Mapper`) and a lane then
copies each row into the database. For the commonest pipelines -- JSON values whose columns each
read one top-level key or record metadata, into integer, text, numeric and epoch-millisecond
timestamp columns -- :class:`ColumnarPlan` does that work per batch instead:

1. the batch's values are joined by newlines and decoded in one C call by the typed tier's own
   msgspec decoder (:func:`~ingest.core.mapping.fastmap.typed_lines_decoder`: a Struct of exactly
   the keys the columns read, unknown fields refused), after checking that no value holds a
   newline and that each is framed as one object (:func:`_framed`), so document ``i`` is record
   ``i`` (a batch that is not is decoded value by value);
2. each column's values go into one Arrow array; a column is checked as a whole (the Python types
   it holds, its integer range, NUL characters, missing required values) and every record that
   fails a check, or that the decoder refused, is *rejected*: handed to the row mapper, which
   alone decides poison;
3. the rows of one key collapse to the last one (the sink's ``ON CONFLICT DO UPDATE`` rule).

Conversions the row mapper does in Python are left to the database, on values that carry the
same information: a JSON float for a ``numeric`` column is staged as the shortest text that
round-trips it (Arrow's CSV writer writes exactly the digits of ``float_decimal``), epoch
milliseconds as an integer that the upsert adds to the epoch (see
:mod:`ingest.sinks.postgres.columnar`).

Contract of :meth:`ColumnarPlan.build`: for the records it accepts, the table's rows are the rows
the row mapper returns for them (the same values once the database has converted them), collapsed
as :func:`ingest.core.collapse.collapse` would; every other record is listed in ``rejected``.
``None`` declines the whole batch (a tombstone, a republished record, a newline in a value). The
differential tests in ``tests/unit/test_columnar.py`` (pure) and
``tests/integration/test_columnar_pg.py`` (the database's values) hold it to that.

Pure logic, no I/O; pyarrow is imported only when a plan is made.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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

#: Metadata sources the tier reads off the records (a republished record declines the batch).
_METADATA: dict[str, Callable[[Record], Any]] = {
    "@topic": operator.attrgetter("topic"),
    "@partition": operator.attrgetter("partition"),
    "@offset": operator.attrgetter("offset"),
    "@timestamp": operator.attrgetter("timestamp_ms"),
}

#: The Python types a column of each kind may hold (None: missing or null).
_TYPES = {"int": {int}, "text": {str}, "decimal": {float}, "epoch_ms": {int}}

_value_of = operator.attrgetter("value")
_origin_of = operator.attrgetter("origin")
_topic_of = operator.attrgetter("topic")
_partition_of = operator.attrgetter("partition")
_NONE = type(None)


@dataclass(frozen=True, slots=True)
class StagedColumn:
    """One sink column as the tier stages it: its kind and, for ``epoch_ms``, whether the column is
    ``timestamptz`` (aware) or ``timestamp``."""

    name: str
    kind: str
    aware: bool = False


@dataclass(frozen=True, slots=True)
class ColumnarBatch:
    """What :meth:`ColumnarPlan.build` made of a batch: the collapsed rows of the records it took (a
    ``pyarrow.Table`` whose columns are the sink's, in order) and the positions of the records it
    left to the row mapper, in batch order."""

    table: Any
    rejected: list[int]


class ColumnarPlan:
    """Maps batches of records to Arrow columns (see the module docstring). Thread-safe: no state
    but the memo of stream ids, which any thread may fill."""

    def __init__(self, names: Sequence[str], columns: Sequence[FastColumn], kinds: Sequence[StagedColumn],
                 keys: Sequence[str], key_index: tuple[int, ...] | None) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        self._pa, self._pc = pa, pc
        self.columns = tuple(kinds)
        self._names = list(names)
        self._decode_lines = typed_lines_decoder(keys)
        fields = {key: f"f{j}" for j, key in enumerate(keys)}
        self._stream = memoised_stream_id(stream_id)
        #: per column: (how to read its values from (docs, records), kind, required, lo, hi, forbid NUL)
        self._readers: list[tuple[Callable[[list[Any], Sequence[Record]], list[Any]], str, bool, Any, Any]] = []
        for col, staged in zip(columns, kinds, strict=True):
            if col.doc_key is not None:
                get = operator.attrgetter(fields[col.doc_key])
                reader = _doc_reader(get)
            elif col.metadata == "@stream":
                reader = self._stream_reader
            else:
                assert col.metadata in _METADATA, col.metadata
                reader = _record_reader(_METADATA[col.metadata])
            lo = hi = None
            if staged.kind == "int":
                _, lo, hi = col.inline  # type: ignore[misc]
            elif staged.kind == "epoch_ms":
                # Only the range where the database's millisecond arithmetic is exact in a double
                # (and ``fromtimestamp`` agrees): beyond it, the row mapper.
                lo, hi = max(col.inline[2], 0), min(col.inline[3], EXACT_FROMTIMESTAMP_MS - 1)  # type: ignore[index]
            self._readers.append((reader, staged.kind, col.required, lo, hi))
        self._key_index = key_index
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

    def _stream_reader(self, docs: list[Any], records: Sequence[Record]) -> list[Any]:
        """The ``@stream`` column: one digest per partition of the batch, looked up per record in C."""
        stream = self._stream
        partitions = list(map(_partition_of, records))
        topics = set(map(_topic_of, records))
        if len(topics) != 1:
            return list(map(stream, map(_topic_of, records), partitions))
        topic = topics.pop()
        ids = {p: stream(topic, p) for p in set(partitions)}
        return list(map(ids.__getitem__, partitions))

    def build(self, records: Sequence[Record]) -> ColumnarBatch | None:
        """The batch as collapsed Arrow columns plus the records left to the row mapper; None declines
        the whole batch. Never raises for any record content."""
        pa, pc = self._pa, self._pc
        n = len(records)
        if n == 0:
            return None
        values = list(map(_value_of, records))
        if None in values or list(map(_origin_of, records)).count(None) != n:
            return None  # tombstones and republished records: the row path
        joined = b"\n".join(values)
        if joined.count(b"\n") != n - 1:
            return None  # a value holds a newline: lines would not be records
        rejected: set[int] = set()
        docs = None
        if _framed(joined, n):
            try:
                docs = self._decode_lines(joined)
            except Exception:  # noqa: BLE001 - some line is not a typed document: find which, one by one
                docs = None
        if docs is None or len(docs) != n:
            docs, rejected = self._decode_each(values)
        arrays = []
        bad = None
        for reader, kind, required, lo, hi in self._readers:
            column = reader(docs, records)
            types = set(map(type, column))
            types.discard(_NONE)
            if not types <= _TYPES[kind]:  # some value needs the row mapper's coercion
                wrong = _TYPES[kind]
                mask = pa.array([v is not None and type(v) not in wrong for v in column])
                column = [v if v is None or type(v) in wrong else None for v in column]
                bad = mask if bad is None else pc.or_(bad, mask)
            array = pa.array(column, type=_ARROW_TYPE[kind](pa))
            checks = []
            if required and array.null_count:
                checks.append(pc.is_null(array))
            if lo is not None:
                checks.append(pc.or_(pc.less(array, lo), pc.greater(array, hi)))
            if kind == "text":
                checks.append(pc.match_substring(array, "\x00"))
            elif kind == "decimal":
                checks.append(pc.invert(pc.is_finite(array)))
            for check in checks:
                check = pc.fill_null(check, False)
                bad = check if bad is None else pc.or_(bad, check)
            arrays.append(array)
        if bad is not None and pc.any(bad).as_py():
            rejected.update(pc.indices_nonzero(bad).to_pylist())
        table = pa.Table.from_arrays(arrays, names=self._names)
        keep = self._survivors(table, n, rejected)
        if keep is not None:
            table = table.take(pa.array(keep, type=pa.int64()))
        return ColumnarBatch(table, sorted(rejected))

    def _decode_each(self, values: list[bytes]) -> tuple[list[Any], set[int]]:
        """Decode record by record: the documents (an empty one where the decoder refused) and the
        positions refused."""
        decode = self._decode_lines
        docs: list[Any] = []
        rejected: set[int] = set()
        empty = decode(b"{}")[0]
        for i, value in enumerate(values):
            try:
                one = decode(value)
                if len(one) != 1:
                    raise ValueError("not one document")
                docs.append(one[0])
            except Exception:  # noqa: BLE001 - refused: the row mapper decides
                docs.append(empty)
                rejected.add(i)
        return docs, rejected

    def _survivors(self, table: Any, n: int, rejected: set[int]) -> list[int] | None:
        """Row positions to keep: the accepted records, the last of each key (None: every row)."""
        if self._key_index is None:
            return None if not rejected else [i for i in range(n) if i not in rejected]
        key_columns = [table.column(i).to_pylist() for i in self._key_index]
        keys = key_columns[0] if len(key_columns) == 1 else list(zip(*key_columns, strict=True))
        if rejected:
            last = {keys[i]: i for i in range(n) if i not in rejected}
        else:
            last = dict(zip(keys, range(n), strict=True))
        return sorted(last.values())


def _framed(joined: bytes, n: int) -> bool:
    """Whether decoding ``joined`` (``n`` values joined by the only ``n - 1`` newlines) as lines can
    only give document ``i`` from value ``i``: every value starts with ``{`` and ends with ``}``.

    The decoder reads whitespace-separated documents, not lines: it skips an empty line, reads two
    documents from ``{"id":1}{"id":2}`` and one from ``{"id":`` and ``1}`` on two lines, so ``n``
    documents from ``n`` lines alone proves nothing. With the rule no document spans a newline (the
    next line starts with ``{`` where a document in progress needs ``,``, ``}`` or ``]``, and a string
    cannot hold a raw newline), so every line holds at least one document, and ``n`` of them means
    exactly one each. A batch that breaks the rule is decoded value by value."""
    return (joined[:1] == b"{" and joined[-1:] == b"}"
            and joined.count(b"\n{") == n - 1 and joined.count(b"}\n") == n - 1)


def _doc_reader(get: Callable[[Any], Any]) -> Callable[[list[Any], Sequence[Record]], list[Any]]:
    def read(docs: list[Any], records: Sequence[Record]) -> list[Any]:
        return list(map(get, docs))

    return read


def _record_reader(get: Callable[[Record], Any]) -> Callable[[list[Any], Sequence[Record]], list[Any]]:
    def read(docs: list[Any], records: Sequence[Record]) -> list[Any]:
        return list(map(get, records))

    return read


_ARROW_TYPE: dict[str, Callable[[Any], Any]] = {
    "int": lambda pa: pa.int64(),
    "text": lambda pa: pa.string(),
    "decimal": lambda pa: pa.float64(),
    "epoch_ms": lambda pa: pa.int64(),
}
