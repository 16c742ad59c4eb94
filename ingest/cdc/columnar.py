"""The columnar tier for change events: a batch of Debezium events as one staged write (issue #38 item 1).

:class:`ChangePlan` has :class:`~ingest.core.mapping.columnar.ColumnarPlan`'s contract (``build``,
``columns``, ``route_refusal``, ``lane_keys``) for pipelines with ``envelope: debezium`` and hard or
soft deletes into one PostgreSQL table. Per batch:

1. each event is unwrapped by the row mapper's own code (:meth:`ChangeMapper.change_image
   <ingest.cdc.mapper.ChangeMapper.change_image>`: the same decode -- JSON, JSON Schema (the JSON after
   the wire-format prefix), Avro or Protobuf, and the record key's for a delete without a ``before``
   image --, the same schema part and ``@source`` block), so an upsert's image and a delete's image are
   exactly the documents the row path maps;
2. the values the columns read are listed off those images -- each top-level key of the image, each
   key of the source block (the plans read it as a top-level key of its own, ``__source_<n>``) -- None
   where missing, as the row mapper reads a missing key; timestamps a schema decoded (``datetime``: a
   schema part's, Avro's ``timestamp-*``, Protobuf's ``Timestamp``) are listed as their ISO 8601 text
   where only timestamp columns read them, which those parse to the same instant (a naive one, as the
   row mapper does, as UTC), and decimals (``Decimal``) as their plain digits (:func:`decimal_text`)
   where only ``numeric`` columns read them, which those stage as the same number; any other value a
   schema decodes -- a date, a time, a UUID, a duration, bytes -- hands the record to the row mapper;
3. the upserts' values go through the upsert columns' plan and the deletes' through the delete columns'
   plan (the key, the version and the hidden source columns: the row path's
   :class:`~ingest.types.DeleteRow` columns), neither collapsing, every value's type checked
   (:meth:`ColumnarPlan.build_fields <ingest.core.mapping.columnar.ColumnarPlan.build_fields>`); the
   plans' contract makes their rows the row mapper's rows;
4. the two tables become one (a delete's other columns null: the statements read only its key,
   version and source), with the ``_ingest_deleted`` / ``_ingest_image`` flags the row path stages,
   collapsed per key exactly as :func:`ingest.core.collapse.collapse` orders a group: the highest
   version, ties (and without a version, everything) to the later record.

Records the plan does not vouch for are *rejected*, i.e. handed to the row mapper, which alone decides
(:class:`~ingest.runner.columnar.ColumnarTier`): tombstones (a no-op, a delete by key, or poison by the
configuration), truncates, undecodable values and ops Debezium never writes, and whatever a column
plan rejects. With more than one lane, :meth:`ChangePlan.lane_keys` routes each event by its row's key
as the row path does, and keeps each record's values for :meth:`ChangePlan.build` (one unwrap per
record). Soft deletes: a delete that wins a key with an upsert before it in the batch carries that
upsert's values, flagged as the row path's :class:`~ingest.types.ImageDeleteRow`
(:meth:`ChangePlan._with_images`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from ingest.core.mapping.columnar import (
    MAX_DECIMAL_TEXT,
    UNROUTED,
    BatchFields,
    ColumnarBatch,
    ColumnarPlan,
    StagedColumn,
)
from ingest.core.routing import key_bytes
from ingest.types import Record

__all__ = ["ChangePlan", "DELETED_FLAG", "IMAGE_FLAG", "decimal_text", "text_keys"]

#: The stage's flag columns (:mod:`ingest.sinks.postgres.statements`): a delete; a delete with its row's values.
DELETED_FLAG, IMAGE_FLAG = "_ingest_deleted", "_ingest_image"

#: What a JSON decode gives: values the plans read as a JSON decode would give them.
_JSON_TYPES = frozenset((str, int, float, bool, type(None), dict, list))
#: Where an image carries the event's ``source`` block (:mod:`ingest.cdc.mapper`).
_SOURCE = "@source"
#: At most this many records' values are kept between ``lane_keys`` and ``build``.
MAX_KEPT = 262_144


class ChangePlan:
    """Plans a batch of change events (see the module docstring). Used by one thread (the pipeline's):
    the row mapper it unwraps events with caches schema parts, and values are kept between calls."""

    def __init__(self, mapper: Any, upserts: ColumnarPlan, deletes: ColumnarPlan, delete_positions: Sequence[int],
                 key_index: tuple[int, ...], version_index: int | None, as_text: dict[type, frozenset[str]], *,
                 sources: Sequence[tuple[str, str]] = (), merge_deletes: bool = False,
                 route: Sequence[tuple[str, StagedColumn]] | None = None) -> None:
        """``mapper``: the :class:`~ingest.cdc.mapper.ChangeMapper`; ``upserts``: the plan of its upsert
        columns, ``deletes``: of its delete columns, whose column ``j`` is the upsert column at
        ``delete_positions[j]`` (staged alike); neither collapses, both read top-level keys only.
        ``as_text``: per Python type a schema part decodes (``datetime``, ``Decimal``), the image keys
        where such a value is listed as its text (:func:`text_keys`). ``sources``: the plans' keys that
        stand for a key of the source block, ``(plan key, source key)``. ``merge_deletes``: soft deletes
        (see :meth:`_with_images`). ``route``: per key column, the plans' key it reads and how it is
        staged (None: lanes > 1 write by rows)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        self._pa, self._pc = pa, pc
        self._image = mapper.change_image
        self._upserts = upserts
        self._deletes = deletes
        self._delete_positions = tuple(delete_positions)
        self._key_index = key_index
        self._version_index = version_index
        self._as_text = as_text
        self._sources = tuple(sources)
        flat = {k for k, _ in self._sources}
        #: the image's top-level keys the plans read
        self._read_keys = tuple(k for k in dict.fromkeys([*upserts.keys, *deletes.keys]) if k not in flat)
        self._merge_deletes = merge_deletes
        self._route = None if route is None else tuple(route)
        #: id(record) -> (record, its values): lane_keys's work, taken by build (pipeline thread only)
        self._kept: dict[int, tuple[Record, Any]] = {}
        self.columns = upserts.columns
        self._names = [c.name for c in self.columns]
        #: why :meth:`lane_keys` cannot route (lanes > 1 then write by rows), or None
        self.route_refusal: str | None = (
            None if route is not None else "a key column does not read a key of the row image")

    def lane_keys(self, records: Sequence[Record]) -> list[Any]:
        """Per record, what the row path routes it to a lane by (:func:`~ingest.core.routing.key_bytes` of
        its upsert's or delete's key values, as the accept loop computes them from the row), or
        :data:`~ingest.core.mapping.columnar.UNROUTED` where only the row mapper can say (a record
        :meth:`build` would reject, a key value it would coerce). Requires ``route_refusal is None``.
        Never raises for any record content."""
        assert self._route is not None
        keys: list[Any] = []
        route = self._route
        single = len(route) == 1
        for doc in self._documents(records, keep=True):
            if doc is None:
                keys.append(UNROUTED)
                continue
            values = []
            for k, staged in route:
                v = doc[1].get(k)
                if staged.kind == "int":
                    ok = type(v) is int and staged.lo <= v <= staged.hi  # type: ignore[operator]
                else:
                    ok = type(v) is str and not (staged.forbid_nul and "\x00" in v)
                if not ok:
                    break
                values.append(v)
            else:
                keys.append(key_bytes(values[0] if single else tuple(values)))
                continue
            keys.append(UNROUTED)
        return keys

    def _documents(self, records: Sequence[Record], keep: bool = False) -> list[tuple[str, dict[str, Any]] | None]:
        """Each record's ``(op, values)`` (:meth:`_document`), or None. ``keep``: remember them for the next
        call that meets the same records (:meth:`lane_keys` then :meth:`build`: one unwrap each)."""
        kept = self._kept
        if keep and len(kept) > MAX_KEPT:  # records never built (a revoked partition's): start afresh
            kept.clear()
        out = []
        for record in records:
            hit = kept.pop(id(record), None) if kept else None
            if hit is not None and hit[0] is record:
                doc = hit[1]
            else:
                doc = self._document(record) if record.value is not None else None
            if keep:
                kept[id(record)] = (record, doc)
            out.append(doc)
        return out

    def build(self, records: Sequence[Record], listed: dict[str, list[Any]] | None = None) -> ColumnarBatch | None:
        """The batch as collapsed Arrow columns (the sink's columns, then the two flags) plus the
        positions of the records left to the row mapper; None declines the whole batch (a republished
        record, a record of the batch without a version). Never raises for any record content."""
        n = len(records)
        if n == 0 or BatchFields(records, listed)("origin").count(None) != n:
            return None
        rejected: list[int] = []
        split: dict[str, tuple[list[int], list[dict[str, Any]]]] = {"u": ([], []), "d": ([], [])}
        for i, doc in enumerate(self._documents(records)):
            if doc is None:
                rejected.append(i)
                continue
            positions, docs = split[doc[0]]
            positions.append(i)
            docs.append(doc[1])
        tables = []
        for (positions, docs), plan in ((split["u"], self._upserts), (split["d"], self._deletes)):
            if not positions:
                tables.append((None, []))
                continue
            values = {k: [d.get(k) for d in docs] for k in plan.keys}
            built = plan.build_fields([records[i] for i in positions], values)
            if built is None:
                return None
            if built.rejected:
                dropped = set(built.rejected)
                rejected += (positions[j] for j in built.rejected)
                positions = [p for j, p in enumerate(positions) if j not in dropped]
            tables.append((built.table, positions))
        table, positions, _ = self._merged(*tables[0], *tables[1])
        if table is None:  # every record rejected: no rows (the tier writes none)
            return ColumnarBatch(None, sorted(rejected))
        if self._version_index is not None and table.column(self._version_index).null_count:
            return None  # a record without a version: the row path decides
        winners, rows_of = self._winners(table, positions)
        if self._merge_deletes:
            return ColumnarBatch(self._with_images(table, positions, winners, rows_of), sorted(rejected))
        table = table.take(self._pa.array(winners, type=self._pa.int64()))
        return ColumnarBatch(table, sorted(rejected))

    def _document(self, record: Record) -> tuple[str, dict[str, Any]] | None:
        """``(op, the values the plans read)`` of a record they may take ("u" or "d"), else None."""
        try:
            op, image = self._image(record)
        except Exception:  # noqa: BLE001 - poison (InvalidRecord) or a registry error: the row mapper's to say
            return None
        if op == "t" or type(image) is not dict:
            return None
        doc = {}
        for k in self._read_keys:
            v = image.get(k)
            if type(v) not in _JSON_TYPES:
                if k in self._as_text.get(type(v), ()):
                    v = v.isoformat() if type(v) is datetime else decimal_text(v)
                else:
                    return None  # a value a schema decoded (a date, a time, a UUID...): the row mapper's
            doc[k] = v
        if self._sources:
            source = image.get(_SOURCE)
            if source is not None and type(source) is not dict:
                return None
            for flat, key in self._sources:
                v = source.get(key) if source is not None else None
                if type(v) not in _JSON_TYPES:
                    return None
                doc[flat] = v
        return op, doc

    def _merged(self, upserts: Any, up_at: list[int], deletes: Any, del_at: list[int]) -> tuple[Any, list[int], int]:
        """One table of the upserts' rows then the deletes' (their other columns null), with the flags;
        each row's batch position; how many rows delete. ``(None, [], 0)`` when neither has a row."""
        pa = self._pa
        parts = []
        if upserts is not None and upserts.num_rows:
            parts.append(upserts)
        if deletes is not None and deletes.num_rows:
            by_position = dict(zip(self._delete_positions, deletes.columns))
            types = [f.type for f in upserts.schema] if parts else [pa.null()] * len(self._names)
            arrays = [by_position[p].cast(types[p]) if p in by_position and parts else by_position.get(p)
                      if p in by_position else pa.nulls(deletes.num_rows, types[p]) for p in range(len(self._names))]
            parts.append(pa.Table.from_arrays(arrays, names=self._names))
        if not parts:
            return None, [], 0
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        n_up = upserts.num_rows if upserts is not None else 0
        n_del = table.num_rows - n_up
        flags = pa.array([False] * n_up + [True] * n_del, type=pa.bool_())
        table = table.append_column(DELETED_FLAG, flags).append_column(
            IMAGE_FLAG, pa.array([False] * table.num_rows, type=pa.bool_()))
        return table, up_at + del_at, n_del

    def _winners(self, table: Any, positions: list[int]) -> tuple[list[int], dict[Any, list[int]]]:
        """Row indices to keep: per key, the highest version, ties to the later record; without a version,
        the later record (:func:`ingest.core.collapse.collapse`'s order); and, with ``merge_deletes``, each
        key's row indices in batch order (else empty)."""
        order = sorted(range(len(positions)), key=positions.__getitem__)
        keys = [table.column(i).to_pylist() for i in self._key_index]
        key_of = keys[0] if len(keys) == 1 else list(zip(*keys, strict=True))
        rows_of: dict[Any, list[int]] = {}
        if self._merge_deletes:
            for r in order:
                rows_of.setdefault(key_of[r], []).append(r)
        if self._version_index is not None:
            versions = table.column(self._version_index).to_pylist()
            order.sort(key=versions.__getitem__)  # stable: equal versions stay in batch order
        winners = dict(zip(map(key_of.__getitem__, order), order))
        return sorted(winners.values()), rows_of

    def _with_images(self, table: Any, positions: list[int], winners: list[int], rows_of: dict[Any, list[int]]) -> Any:
        """Soft deletes: the winning rows, where a delete wins a key that has an upsert before it in the
        batch, as :func:`ingest.core.collapse._merged` makes it -- the batch's records of the key applied one
        by one (a record older than the key's state is skipped; a delete keeps the values it marks), and
        when an upsert's values are left, the delete carries them (its own key, version and source
        columns, the upsert's others) flagged ``_ingest_image``: the row path's
        :class:`~ingest.types.ImageDeleteRow`."""
        pa = self._pa
        deleted = table.column(DELETED_FLAG).to_pylist()
        versions = table.column(self._version_index).to_pylist() if self._version_index is not None else None
        keys = [table.column(i).to_pylist() for i in self._key_index]
        key_of = keys[0] if len(keys) == 1 else list(zip(*keys, strict=True))
        image: dict[int, int] = {}  # a winning delete's row -> the upsert row whose values it carries
        for w in winners:
            rows = rows_of[key_of[w]]
            if not deleted[w] or len(rows) < 2:
                continue
            values = version = None
            for r in rows:
                if versions is not None and version is not None and versions[r] < version:
                    continue
                version = versions[r] if versions is not None else None
                if not deleted[r]:
                    values = r
            if values is not None:
                image[w] = values
        take = pa.array(winners, type=pa.int64())
        if not image:
            return table.take(take)
        base = pa.array([image.get(w, w) for w in winners], type=pa.int64())
        own = set(self._delete_positions)
        arrays = [table.column(p).take(take if p in own else base) for p in range(len(self._names))]
        arrays.append(table.column(DELETED_FLAG).take(take))
        arrays.append(pa.array([w in image for w in winners], type=pa.bool_()))
        return pa.Table.from_arrays(arrays, names=[*self._names, DELETED_FLAG, IMAGE_FLAG])


def decimal_text(v: Decimal) -> str:
    """``v`` as plain decimal digits (``format(v, "f")``: no exponent, the same number and the same scale --
    ``Decimal('0E-8')`` is ``0.00000000``, ``Decimal('1E+3')`` ``1000`` -- which PostgreSQL's ``numeric``
    input reads as the row path's Decimal) when its exponent is within ``MAX_DECIMAL_TEXT`` (the longest
    text the plan stages); else its ``str`` (a NaN, an infinity, an exponent beyond), which the plan leaves
    to the row mapper."""
    exponent = v.as_tuple().exponent
    if type(exponent) is int and -MAX_DECIMAL_TEXT <= exponent <= MAX_DECIMAL_TEXT:
        return format(v, "f")
    return str(v)


def text_keys(columns: Sequence[Any], staged: Sequence[Any]) -> dict[type, frozenset[str]]:
    """Where :class:`ChangePlan` writes a schema part's decoded value as text: a ``datetime`` in an image
    key only timestamp columns read (its ISO 8601 text: ``_timestamptz`` / ``_timestamp`` give the same
    instant for the text as for the datetime), a ``Decimal`` in one only ``numeric`` columns read (its
    :func:`decimal_text`: staged only when plain digits, the same number as the Decimal). ``columns``: the
    upsert plan's :class:`~ingest.core.mapping.fastmap.FastColumn` list, ``staged`` its StagedColumns."""
    kinds: dict[str, set[str]] = {}
    for col, st in zip(columns, staged, strict=True):
        if col.doc_key is not None:
            kinds.setdefault(col.doc_key, set()).add(st.kind)
    return {datetime: frozenset(k for k, ks in kinds.items() if ks == {"timestamp"}),
            Decimal: frozenset(k for k, ks in kinds.items() if ks == {"numeric"})}
