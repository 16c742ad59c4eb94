"""The tables of a ``columns: auto`` pipeline in ClickHouse: created and evolved from the batch's schemas.

The rows reaching the sink are carriers (:mod:`ingest.mirror.auto`), each ending with its table. For a
batch, before anything is inserted (:meth:`ClickHouseAutoTables.prepare`):

1. per table, the union of the shapes of its rows (:func:`ingest.mirror.shape.union`: decided from
   every schema in the batch, never from one record);
2. when the table as this process last saw it does not take that union as it is
   (:func:`ingest.mirror.evolve.plan` not empty), :func:`ingest.mirror.ddl.ensure_clickhouse` creates
   or alters it: ``ReplacingMergeTree(version[, _ingest_deleted]) ORDER BY (the key)`` for a keyed
   table, ``MergeTree ORDER BY tuple()`` for a table without a key; new fields become ``Nullable``
   columns (``Array(T) DEFAULT []``); the table's shape is read back from the catalog afterwards.
   The version (:meth:`ClickHouseAutoTables.where`): the table's own ``tables.NAME.version_column`` (a
   column of its records, NOT NULL), else the sink's ``version:`` column (added, of its type), else the
   hidden ``_version UInt64`` holding the record's Kafka offset;
3. a union a table cannot take (:class:`~ingest.mirror.evolve.Incompatible`: a key column that would
   change type, a type that is not a widening, two schemas of the batch disagreeing on a column)
   raises :class:`~ingest.errors.PermanentError` with class ``schema_incompatible`` before any row of
   the batch is inserted: the batch's isolation then writes every other row and dead-letters the rows
   of that table's incompatible schema alone -- the other tables keep flowing. So does an existing
   keyed table whose engine is versioned otherwise
   (:meth:`~ingest.mirror.ddl.ClickHouseTable.engine_refusal`: its rows are refused until the table
   is re-created or the pipeline versioned as the table is). For
   :data:`RECHECK_S` after the table was read, such a union is refused from that shape without asking
   the server again (the pieces isolation makes fail at once; a table fixed by hand is seen after it).

Then each table's rows are one insert (:meth:`ClickHouseAutoTables.insert_data`): every carrier's
values put in the table's columns by name, converted where the table's column is wider in a way the
value's encoding shows (a ``DateTime64(3)`` value into a ``DateTime64(6)`` column: its ticks scaled);
a column the record's schema lacks is NULL (``[]`` for an Array, the type's zero for a column that
cannot hold NULL); columns no record of the batch has are left out (the server writes their default).
The version column holds the carrier's version (:func:`~ingest.mirror.auto.version_value`), or its
offset in a table versioned by ``_version``. A delete is a row of its key, its version (the delete's
offset, the sink's ``version:`` of the delete event, or its before image's own version column) and
``_ingest_deleted = 1``, zero values elsewhere (``SELECT ... FINAL`` hides the key unless a later
version of it comes, merges drop it).

A table altered behind ingest's back (dropped, a column dropped or retyped) makes the insert fail:
:meth:`ClickHouseAutoTables.forget` drops what this process knew of it and the sink raises a
transient error, so the batch's retry reads the catalog again and repairs the table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ingest.core.dialects import ChType, ch_type
from ingest.errors import PermanentError
from ingest.mirror.auto import KEY_AT, OFFSET_AT, SHAPE_AT, VALUES_AT, VERSION_AT, RowShape, table_override, version_value
from ingest.mirror.ddl import ClickHouseTable, DdlResult, KeyedLocks, ensure_clickhouse, read_clickhouse_shape
from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.evolve import Incompatible, plan
from ingest.mirror.router import table_of
from ingest.mirror.shape import Column, Shape, union
from ingest.sinks.clickhouse.settings import CH_DEFAULT_VERSION_COLUMN, DELETED_COLUMN, ClickHouseSinkSettings, _zero
from ingest.types import DeleteRow

__all__ = ["ALTERED_CODES", "AutoTable", "ClickHouseAutoTables", "InsertData", "rescaler"]

#: ClickHouse error codes that say the table is not what this process thinks (forget it; the retry
#: repairs it): THERE_IS_NO_COLUMN, NOT_FOUND_COLUMN_IN_BLOCK, NO_SUCH_COLUMN_IN_TABLE,
#: UNKNOWN_IDENTIFIER, UNKNOWN_TABLE, UNKNOWN_DATABASE.
ALTERED_CODES = frozenset({8, 10, 16, 47, 60, 81})

#: How long a table's shape read from the catalog is trusted to refuse a schema it cannot take (the
#: pieces isolation splits a batch into fail at once; a table fixed by hand is seen within that time).
RECHECK_S = 5.0

#: One value converted from the record's column type to the table's (None: as it is).
Convert = Callable[[Any], Any] | None


@dataclass(frozen=True)
class InsertData:
    """One table's insert: column names, their ClickHouse types (the table's) and the values, by column."""

    names: tuple[str, ...]
    types: tuple[ChType, ...]
    columns: list[list[Any]]


@dataclass(eq=False)
class AutoTable:
    """One table as this process knows it: its shape as the catalog gave it (managed columns included)."""

    name: str
    shape: Shape
    where: ClickHouseTable
    #: the ClickHouse type of each column, by name
    types: dict[str, ChType]
    #: monotonic time this shape was read from the catalog
    read_at: float = 0.0
    #: why the table's engine is not the one ``where`` makes (versioned otherwise), or None
    refusal: str | None = None
    #: a row shape → per table column: (where its value is in that shape's values or -1, converter)
    _plans: dict[RowShape, tuple[tuple[int, Convert], ...]] = field(default_factory=dict)

    def plan_for(self, row_shape: RowShape) -> tuple[tuple[int, Convert], ...]:
        """Where each of the table's columns takes its value in ``row_shape``'s values (-1: not there)
        and how it is converted to the column's type."""
        found = self._plans.get(row_shape)
        if found is None:
            where = {name: i for i, name in enumerate(row_shape.names)}
            out = []
            for c in self.shape.columns:
                i = where.get(c.name, -1)
                source = row_shape.shape.column(c.name) if i >= 0 else None
                column = self.types.get(c.name)
                out.append((i, rescaler(source.type, column) if source is not None and column is not None else None))
            found = self._plans[row_shape] = tuple(out)
        return found


def rescaler(record_type: str, column: ChType) -> Convert:
    """The conversion of a value the mapper made for ``record_type`` (a shape's type, no Nullable) into a
    ``column`` of another type the table's column accepts: DateTime64 ticks (also inside an Array) are
    scaled up to the column's precision; every other accepted pair holds the value as it is (None)."""
    have = _base(ch_type(record_type))
    want = _base(column)
    if have.kind == "array" and want.kind == "array" and have.inner is not None and want.inner is not None:
        inner = rescaler(have.inner.ddl, want.inner)
        if inner is None:
            return None
        return lambda v: None if v is None else [inner(x) for x in v]
    if have.kind == "datetime64" and want.kind == "datetime64" and want.precision > have.precision:
        factor = 10 ** (want.precision - have.precision)
        return lambda v: None if v is None else v * factor
    return None


def _base(t: ChType) -> ChType:
    while t.kind in ("nullable", "lowcardinality") and t.inner is not None:
        t = t.inner
    return t


class ClickHouseAutoTables:
    """The auto tables of one ClickHouse sink. Thread-safe (lanes share it): DDL on one table is
    serialised here (and by :func:`ensure_clickhouse` per process); across processes it re-plans."""

    def __init__(self, cfg: ClickHouseSinkSettings, deletes: bool) -> None:
        """``deletes``: the pipeline's records can delete (keyed tables get the ``_ingest_deleted`` mark)."""
        self._cfg = cfg
        self._deletes = deletes
        self._overrides = tuple(cfg.tables.items())
        self._tables: dict[str, AutoTable] = {}
        self._table_lock = KeyedLocks()  # one per table name

    # -- before the inserts --------------------------------------------------------------------
    def prepare(self, client: Any, rows: Sequence[tuple[Any, ...]], *, window: int | None,
                call_lock: Callable[[], contextlib.AbstractContextManager[Any]]) -> dict[str, AutoTable]:
        """Every table of ``rows`` made to take their schemas. ``window``: the tables'
        ``non_replicated_deduplication_window`` (None: a server without it); ``call_lock()`` wraps each
        DDL (chDB serialises calls). Raises PermanentError (``schema_incompatible``) naming every table
        that cannot, before anything is written; TransientError / MigrationError as the DDL does."""
        shapes: dict[str, dict[int, RowShape]] = {}
        for row in rows:
            found = shapes.setdefault(table_of(row), {})
            for s in (row[SHAPE_AT], getattr(row[VALUES_AT], "shape", None)):
                if s is not None:
                    found.setdefault(id(s), s)
        out: dict[str, AutoTable] = {}
        incompatible: list[str] = []
        for name, found in shapes.items():
            try:
                out[name] = self.ensure(client, name, list(found.values()), window=window, call_lock=call_lock)
            except SchemaIncompatible as exc:
                incompatible.append(f"table {name!r}: {exc.message}")
        if incompatible:
            raise PermanentError("; ".join(incompatible)[:1000], error_class="schema_incompatible")
        return out

    def ensure(self, client: Any, name: str, shapes: Sequence[RowShape], *, window: int | None = None,
               call_lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
               ) -> AutoTable:
        """The table ``name`` made to take ``shapes`` (their union); raises SchemaIncompatible.

        A union the table as last read cannot take is refused without asking the server again for
        :data:`RECHECK_S` after that read."""
        wanted = union([s.shape for s in shapes]) if len(shapes) > 1 else shapes[0].shape
        t = self._tables.get(name)
        if t is not None and self._fits(t, wanted):
            return t
        with self._table_lock(name):
            t = self._tables.get(name)
            if t is not None and self._fits(t, wanted):
                return t
            where = self.where(name, window)
            with call_lock():
                result = ensure_clickhouse(client, where, wanted, self._cfg.evolve)
            assert result.shape is not None
            t = self._tables[name] = _table(name, result.shape, where, result.engine)
            if result.action == "incompatible":
                raise SchemaIncompatible("incompatible", str(result.incompatible))
            return t

    def migrate(self, client: Any, name: str, wanted: Shape, *, window: int | None, dry_run: bool,
                call_lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                ) -> DdlResult:
        """Create or evolve ``name`` for ``wanted`` now (``ingest migrate``; an incompatible table is left
        as it is), or with ``dry_run`` only say what that would run. Raises like :func:`ensure_clickhouse`."""
        where = self.where(name, window)
        with call_lock():
            result = ensure_clickhouse(client, where, wanted, self._cfg.evolve, dry_run=dry_run)
        if not dry_run and result.shape is not None:
            self._tables[name] = _table(name, result.shape, where, result.engine)
        return result

    def _fits(self, t: AutoTable, wanted: Shape) -> bool:
        """``t`` takes ``wanted`` as it is (its engine and managed columns are its own); raises
        SchemaIncompatible when it cannot and was read from the catalog less than :data:`RECHECK_S` ago
        (else False: read it again)."""
        p = Incompatible((t.refusal,)) if t.refusal is not None else \
            plan(t.shape, wanted.with_columns(t.where.managed_columns(wanted)), self._cfg.evolve)
        if isinstance(p, Incompatible):
            if time.monotonic() - t.read_at < RECHECK_S:
                raise SchemaIncompatible("incompatible", str(p))
            return False
        return p.empty

    def where(self, name: str, window: int | None) -> ClickHouseTable:
        """How table ``name`` is made: in the sink's database, versioned (when keyed) by its ``tables:``
        entry's ``version_column`` (a column of its records), else the sink's ``version:`` column,
        else the hidden ``_version`` (the Kafka offset)."""
        column, type_text = self._version_of(name)
        return ClickHouseTable(name, database=self._cfg.database, version_column=column, version_type=type_text,
                               deletes=self._deletes, deduplication_window=window)

    def _version_of(self, name: str) -> tuple[str, str]:
        """``(column, type)`` of table ``name``'s version (see :meth:`where`); the type is the one the sink
        adds the column with (a table's own version column is its records' and keeps their type)."""
        own = getattr(table_override(name, self._overrides), "version_column", None)
        if own is not None:
            return own, "UInt64"
        if self._cfg.version is not None:
            return self._cfg.version.column, self._cfg.version.type
        return CH_DEFAULT_VERSION_COLUMN, "UInt64"

    def known(self, name: str) -> AutoTable | None:
        return self._tables.get(name)

    def forget(self, names: Iterable[str]) -> None:
        """Drop what this process knows of ``names`` (the next batch reads the catalog again)."""
        for name in names:
            self._tables.pop(name, None)

    def changed(self, client: Any, t: AutoTable) -> bool:
        """The catalog's shape of ``t`` is not the one this process knows (raises the client's errors)."""
        now = read_clickhouse_shape(client, self._cfg.database, t.name)
        return now is None or now.columns != t.shape.columns or now.key != t.shape.key

    # -- the insert ----------------------------------------------------------------------------
    def insert_data(self, t: AutoTable, carriers: Sequence[tuple[Any, ...]]) -> InsertData:
        """The insert of ``carriers`` (this table's rows, the table value removed or not) into ``t`` (see
        the module docstring): the key, managed columns and every column a carrier's schema has."""
        shape = t.shape
        written: set[str] = set(shape.key) | {t.where.version_column, DELETED_COLUMN}
        for carrier in carriers:
            shaped = carrier[VALUES_AT]
            if shaped is not None:
                written.update(shaped.shape.names)
        chosen = [i for i, c in enumerate(shape.columns) if c.name in written and c.name in t.types]
        plans = [None if carrier[VALUES_AT] is None else t.plan_for(carrier[VALUES_AT].shape) for carrier in carriers]
        return InsertData(tuple(shape.columns[i].name for i in chosen),
                          tuple(t.types[shape.columns[i].name] for i in chosen),
                          [self._column(t, i, carriers, plans) for i in chosen])

    def _column(self, t: AutoTable, i: int, carriers: Sequence[tuple[Any, ...]],
                plans: Sequence[tuple[tuple[int, Convert], ...] | None]) -> list[Any]:
        """Column ``i`` of ``t`` for ``carriers`` (``plans``: each carrier's :meth:`AutoTable.plan_for`,
        None for a delete)."""
        shape = t.shape
        c = shape.columns[i]
        if c.name == t.where.version_column and shape.key:
            return self._versions(t, i, carriers)
        if c.name == DELETED_COLUMN and self._deletes:
            return [1 if isinstance(carrier, DeleteRow) else 0 for carrier in carriers]
        filler = _filler(c, t.types[c.name])
        key = shape.key.index(c.name) if c.name in shape.key else None
        out: list[Any] = []
        for carrier, row_plan in zip(carriers, plans, strict=True):
            if row_plan is None:  # a delete: its key, zero values elsewhere
                out.append(carrier[KEY_AT][key] if key is not None else filler)
                continue
            at, convert = row_plan[i]
            value = carrier[VALUES_AT].values[at] if at >= 0 else None
            out.append(filler if value is None else value if convert is None else convert(value))
        return out

    @staticmethod
    def _versions(t: AutoTable, i: int, carriers: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The version column (column ``i``) of ``t`` for ``carriers``, deletes included: the offset in
        a table versioned by ``_version``, else the carrier's version -- the sink's ``version:`` value, or
        the table's own column's (converted as that column's values are, when the table's is wider)."""
        if t.where.version_column == CH_DEFAULT_VERSION_COLUMN:
            return [carrier[OFFSET_AT] for carrier in carriers]
        out = []
        for carrier in carriers:
            value = version_value(carrier[VERSION_AT])
            convert = t.plan_for(carrier[SHAPE_AT])[i][1]  # None: the sink's version: (no column of the shape)
            out.append(value if convert is None else convert(value))
        return out


def _filler(c: Column, t: ChType) -> Any:
    """A column's value when the record has none: NULL, ``[]`` for an Array, else the type's zero."""
    if c.nullable:
        return None
    return [] if _base(t).kind == "array" else _zero(t)


def _table(name: str, shape: Shape, where: ClickHouseTable, engine: str | None = None) -> AutoTable:
    """``name`` with ``shape`` and ``engine`` (``engine_full``; None: as ``where`` makes it); a column of a
    type ingest does not write (made by hand: ``Map``, ``DateTime``) gets no type and is never inserted
    (a schema that has it is incompatible anyway)."""
    types: dict[str, ChType] = {}
    for c in shape.columns:
        with contextlib.suppress(ValueError):
            types[c.name] = ch_type(shape.ddl_type(c))
    refusal = where.engine_refusal(engine) if engine is not None and shape.key else None
    return AutoTable(name, shape, where, types, time.monotonic(), refusal=refusal)
