"""The tables of a ``columns: auto`` pipeline in PostgreSQL: created and evolved from the batch's schemas.

The rows reaching the sink are carriers (:mod:`ingest.mirror.auto`), each ending with its table. For a
batch, before its transaction (:meth:`AutoTables.prepare`, autocommit):

1. per table, the union of the shapes of its rows (:func:`ingest.mirror.shape.union`: decided from
   every schema in the batch, never from one record);
2. when the table as this process last saw it does not take that union as it is
   (:func:`ingest.mirror.evolve.plan` not empty), :func:`ingest.mirror.ddl.ensure_postgres` creates or
   alters it under the table's advisory lock (a CREATE that loses a race is a success), on its own
   connection, with the hidden source columns and, with deletes, the tombstone table and soft-delete
   column; the table's SQL is composed again from the catalog's shape afterwards;
3. a union the table cannot take (:class:`~ingest.mirror.evolve.Incompatible`, two schemas of the
   batch disagreeing on a column) raises :class:`~ingest.errors.PermanentError` with class
   ``schema_incompatible``: the batch's isolation then writes every other row and dead-letters the
   rows of that table's incompatible schema alone -- the other tables keep flowing;
4. each session's stage of the table is (re)made when the table's columns changed.

In the transaction (:meth:`AutoTables.rows_for`) each carrier becomes the table's row: its values put
in the table's column order by name (a column its schema lacks: NULL), the source columns last. The
table's SQL is the routed sink's (one COPY and one upsert per table, deletes as the sink writes them).

A table altered behind ingest's back (a column dropped, the table dropped) makes the write fail with an
undefined column or table: :meth:`AutoTables.forget` drops what this process knew of it, and the
batch's retry reads the catalog again and repairs the table.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ingest.config.base import ColumnSpec
from ingest.config.cdc import DeleteSettings
from ingest.drivers.postgres import connect, translate
from ingest.errors import MigrationError, PermanentError, TransientError
from ingest.mirror.auto import (
    KEY_AT,
    OFFSET_AT,
    SHAPE_AT,
    STREAM_AT,
    VALUES_AT,
    VERSION_AT,
    RowShape,
    table_override,
    version_value,
)
from ingest.mirror.ddl import _PG_LOST_RACE as LOST_RACE
from ingest.mirror.ddl import DdlResult, KeyedLocks, ensure_postgres, lock_key, read_postgres_shape
from ingest.mirror.errors import SchemaIncompatible
from ingest.mirror.evolve import Incompatible, plan
from ingest.mirror.router import table_of
from ingest.mirror.shape import Column, Shape, union
from ingest.sinks.postgres.settings import OFFSET_COLUMN, STREAM_COLUMN, PostgresSinkSettings
from ingest.sinks.postgres.statements import DeleteStatements, UpsertStatements, stage_name
from ingest.types import DeleteRow, ImageDeleteRow

__all__ = ["AutoTable", "AutoTables", "UNDEFINED"]

#: The errors that say the table is not what this process thinks (forget it; the retry repairs it).
UNDEFINED = (pg_errors.UndefinedColumn, pg_errors.UndefinedTable)
#: The hidden source columns every keyed auto table has (the order guard; replay and exactly-once read them).
SOURCE = (Column(STREAM_COLUMN, "bigint", True), Column(OFFSET_COLUMN, "bigint", True))
#: PostgreSQL's most columns in a table.
MAX_COLUMNS = 1600
#: How long a table's shape read from the catalog is trusted to refuse a schema it cannot take.
RECHECK_S = 5.0
#: How long a table's DDL waits for a lock before the batch's retry takes it again.
DDL_LOCK_TIMEOUT_MS = 5_000


@dataclass(eq=False)
class AutoTable:
    """One table as this process knows it: its shape (from the catalog), settings and SQL."""

    name: str
    shape: Shape
    cfg: PostgresSinkSettings
    sql: UpsertStatements
    deletes: DeleteStatements | None
    #: bumped each time the table is (re)read: a session's stage of an older version is made again
    version: int
    #: monotonic time of the table's last tombstone expiry (the sink's expiry reads it)
    _expired_at: float = 0.0
    #: monotonic time this shape was read from the catalog
    read_at: float = 0.0
    #: a row shape → where each of the table's columns takes its value in that shape's values (-1: NULL)
    _index: dict[RowShape, tuple[int, ...]] = field(default_factory=dict)

    def positions(self, shape: RowShape) -> tuple[int, ...]:
        found = self._index.get(shape)
        if found is None:
            where = {name: i for i, name in enumerate(shape.names)}
            found = self._index[shape] = tuple(where.get(c, -1) for c in self.cfg.columns)
        return found


class AutoTables:
    """The auto tables of one sink. Thread-safe (lanes share it): DDL on one table is serialised here
    and across processes by the table's advisory lock (:func:`ensure_postgres`)."""

    def __init__(self, cfg: PostgresSinkSettings, deletes: DeleteSettings | None) -> None:
        """``deletes``: the pipeline's (None: its records never delete); a ``tables:`` entry's ``deletes``
        replaces them for its tables, its ``version_column`` the sink's ``version:``."""
        self._cfg = cfg
        self._deletes = deletes
        self._overrides = tuple(cfg.tables.items())
        self._tables: dict[str, AutoTable] = {}
        self._lock = threading.Lock()
        self._table_lock = KeyedLocks()  # one per table name
        self._versions = 0
        #: per session: the version of each table's stage it holds
        self._staged: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
        #: per session: what :meth:`prepare` made ready for its batch (a table, or why it cannot take its rows)
        self._prepared: weakref.WeakKeyDictionary[Any, dict[str, AutoTable | str]] = weakref.WeakKeyDictionary()

    # -- before the transaction ----------------------------------------------------------------
    def prepare(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...] | None]) -> None:
        """Before a batch's transaction (autocommit): every table of ``rows`` made to take their schemas,
        and ``conn``'s stage of each. What it prepared -- and the tables that cannot take their rows --
        is what :meth:`batch_tables` gives the write on ``conn`` (so a lane writes with the shape it
        staged, whatever another lane made of the table since). Raises TransientError like a write;
        never for a schema a table cannot take (the write refuses those rows, in its transaction)."""
        shapes: dict[str, dict[int, RowShape]] = {}
        for row in rows:
            if row is None:
                continue
            found = shapes.setdefault(table_of(row), {})
            for s in (row[SHAPE_AT], getattr(row[VALUES_AT], "shape", None)):
                if s is not None:
                    found.setdefault(id(s), s)
        tables: dict[str, AutoTable | str] = {}
        staged = self._staged.setdefault(conn, {})
        for name, found in shapes.items():
            try:
                t = self.ensure(name, list(found.values()))
            except SchemaIncompatible as exc:
                tables[name] = f"table {name!r}: {exc.message}"
                continue
            if staged.get(name) != t.version:
                conn.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(
                    sql.Identifier(stage_name(self._cfg.db_schema, name))))
                conn.execute(t.sql.create_stage)
                staged[name] = t.version
            tables[name] = t
        self._prepared[conn] = tables

    def batch_tables(self, conn: psycopg.Connection[Any], names: Iterable[str]) -> dict[str, AutoTable]:
        """The tables :meth:`prepare` made ready on ``conn`` for ``names``. Raises PermanentError (class
        ``schema_incompatible``, naming each) when one of them cannot take its rows -- inside the batch's
        transaction, so isolation (at least once, or exactly once in savepoints) dead-letters those
        rows alone -- and TransientError for a table not prepared on ``conn`` (the retry prepares it)."""
        prepared = self._prepared.get(conn, {})
        out: dict[str, AutoTable] = {}
        refused: list[str] = []
        for name in names:
            t = prepared.get(name)
            if t is None:
                raise TransientError(f"table {name!r} was not prepared on this connection: preparing it again")
            if isinstance(t, str):
                refused.append(t)
            else:
                out[name] = t
        if refused:
            raise PermanentError("; ".join(refused)[:1000], error_class="schema_incompatible")
        return out

    def ensure(self, name: str, shapes: Sequence[RowShape]) -> AutoTable:
        """The table ``name`` made to take ``shapes`` (their union); raises SchemaIncompatible.

        A union the table as last read cannot take is refused without asking the database again for
        :data:`RECHECK_S` after that read: the pieces a batch is split into to isolate those rows each
        fail at once, and a table fixed by hand is seen within that time."""
        wanted = union([s.shape for s in shapes]) if len(shapes) > 1 else shapes[0].shape
        t = self._tables.get(name)
        if t is not None and self._fits(t, wanted):
            return t
        with self._table_lock(name):
            t = self._tables.get(name)
            if t is not None and self._fits(t, wanted):
                return t
            t, incompatible = self._ensure(name, wanted)
            self._tables[name] = t
            if incompatible is not None:
                raise SchemaIncompatible("incompatible", incompatible)
            self._check_filled(t, wanted)
            return t

    def _fits(self, t: AutoTable, wanted: Shape) -> bool:
        """``t`` takes ``wanted`` as it is; raises SchemaIncompatible when it cannot, and was read from
        the catalog less than :data:`RECHECK_S` ago (else False: read it again)."""
        p = plan(t.shape, wanted, self._cfg.evolve)
        if isinstance(p, Incompatible):
            if time.monotonic() - t.read_at < RECHECK_S:
                raise SchemaIncompatible("incompatible", str(p))
            return False
        if p.empty:
            self._check_filled(t, wanted)
        return p.empty

    def _check_filled(self, t: AutoTable, wanted: Shape) -> None:
        """Raise SchemaIncompatible when ``t`` has a NOT NULL column that neither ``wanted`` nor ingest
        fills (one added by hand): ingest would write NULL there, default or not."""
        managed = {STREAM_COLUMN, OFFSET_COLUMN, *(c.name for c in self._extra_columns(t.name, wanted))}
        deletes = self._deletes_for(t.name)
        if deletes is not None and deletes.mode == "soft":
            managed.add(deletes.soft_column)
        lacking = [c.name for c in t.shape.columns
                   if not c.nullable and c.name not in managed and wanted.column(c.name) is None]
        if lacking:
            raise SchemaIncompatible("unfilled_column", f"table {t.name!r} has NOT NULL column(s) {lacking} the "
                                     "schema has no field for (ingest would write NULL there; a default is not "
                                     "applied): make them nullable, or add the fields")

    def lookup(self, name: str) -> AutoTable | None:
        """The table ``name`` as the catalog has it now (None: there is none) -- for a process that has not
        written it (``replay-dlq``'s order guard); no DDL. Raises like a write."""
        t = self._tables.get(name)
        if t is not None:
            return t
        cfg = self._cfg
        with translate() as tr, connect(cfg.dsn.get_secret_value(), cfg.network, autocommit=True) as conn:
            tr.conn = conn
            shape = read_postgres_shape(conn, cfg.db_schema, name)
        if shape is None:
            return None
        t = self._build(name, shape)
        self._tables.setdefault(name, t)
        return t

    def known(self, name: str) -> AutoTable | None:
        return self._tables.get(name)

    def forget(self, names: Iterable[str]) -> None:
        """Drop what this process knows of ``names`` (the next batch reads the catalog again)."""
        for name in names:
            self._tables.pop(name, None)

    def migrate(self, name: str, wanted: Shape, *, dry_run: bool) -> DdlResult:
        """Create or evolve ``name`` for ``wanted`` now (``ingest migrate``; an incompatible table is left
        as it is), or with ``dry_run`` only say what that would run. Raises like a write."""
        result = self._run_ddl(name, wanted, dry_run=dry_run)
        if not dry_run:
            self._remember(name, result)
        return result

    def _ensure(self, name: str, wanted: Shape) -> tuple[AutoTable, str | None]:
        """The table as the catalog has it after making it take ``wanted``, and why it cannot (or None)."""
        result = self._run_ddl(name, wanted, dry_run=False)
        return self._remember(name, result)

    def _remember(self, name: str, result: DdlResult) -> tuple[AutoTable, str | None]:
        assert result.shape is not None  # created, altered, or there as it is (incompatible)
        table = self._build(name, result.shape)
        self._tables[name] = table
        return table, str(result.incompatible) if result.action == "incompatible" else None

    def _run_ddl(self, name: str, wanted: Shape, *, dry_run: bool) -> DdlResult:
        """:func:`ensure_postgres` on a connection of its own, with the columns ingest adds (the source
        columns and the version of a keyed table) and, with deletes, the tombstone table and soft column."""
        cfg = self._cfg
        extra = self._extra_columns(name, wanted)
        if len({*wanted.names, *(c.name for c in extra)}) > MAX_COLUMNS:
            raise SchemaIncompatible("too_many_columns", f"table {name!r} would have more than {MAX_COLUMNS} "
                                     "columns, PostgreSQL's limit")
        network = cfg.network.model_copy(update={"client_timeout_ms": 0})  # DDL may wait, bounded by lock_timeout
        with translate() as t, connect(cfg.dsn.get_secret_value(), network, autocommit=True) as conn:
            t.conn = conn
            conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(DDL_LOCK_TIMEOUT_MS)))
            kind = conn.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)",
                                [sql.Identifier(cfg.db_schema, name).as_string(conn)]).fetchone()
            if kind is not None and kind[0] not in ("r", "p"):  # a view, a sequence...: no DDL makes it a table
                raise SchemaIncompatible("not_a_table", f"{name!r} is there and is not a table (relkind {kind[0]!r})")
            try:
                result = ensure_postgres(conn, cfg.db_schema, name, wanted, cfg.evolve, dry_run=dry_run,
                                         extra_columns=extra)
            except MigrationError as exc:  # a type or name the database refuses: these records' schema
                raise SchemaIncompatible("ddl_refused", str(exc)) from None
            except TransientError as exc:
                if exc.sqlstate == "54011":  # too many columns (dropped ones count too)
                    raise SchemaIncompatible("too_many_columns", f"table {name!r}: {exc}") from None
                raise
            if dry_run or result.action == "incompatible" or not wanted.key or self._deletes_for(name) is None:
                return result
            assert result.shape is not None
            deletes = self._build(name, result.shape).deletes
            if deletes is not None:
                self._ensure_deletes(conn, name, deletes)
        return result

    def _extra_columns(self, name: str, wanted: Shape) -> tuple[Column, ...]:
        """The columns ingest adds to table ``name`` of ``wanted``: the source columns and the sink's
        ``version:`` column of a keyed one (unless its ``tables:`` entry names its own version column)."""
        extra: tuple[Column, ...] = SOURCE if wanted.key else ()
        if self._cfg.version is not None and wanted.key and self._own_version(name) is None:
            extra = (*extra, Column(self._cfg.version.column, self._cfg.version.type, True))
        return extra

    def _override(self, name: str) -> Any:
        return table_override(name, self._overrides)

    def _own_version(self, name: str) -> str | None:
        """The version column ``name``'s ``tables:`` entry names (a column of its schema), or None."""
        return getattr(self._override(name), "version_column", None)

    def _deletes_for(self, name: str) -> DeleteSettings | None:
        """How table ``name``'s deletes are written: its ``tables:`` entry's ``deletes``, else the
        pipeline's (None: the records never delete)."""
        if self._deletes is None:
            return None
        own = getattr(self._override(name), "deletes", None)
        return own if own is not None else self._deletes

    def _ensure_deletes(self, conn: psycopg.Connection[Any], name: str, deletes: DeleteStatements) -> None:
        """The tombstone table and soft-delete column of ``name``, under the table's advisory lock (the one
        its DDL takes): another process making them at once takes turns, and one that made them first
        leaves nothing to do (``IF NOT EXISTS``; a race lost anyway is a success)."""
        statements = [s for s in (deletes.create_tombstones, deletes.soft_column_ddl) if s is not None]
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(self._cfg.db_schema, name),))
                for statement in statements:
                    conn.execute(statement)
        except LOST_RACE:
            pass

    def _build(self, name: str, shape: Shape) -> AutoTable:
        delete_settings = self._deletes_for(name)
        soft = delete_settings.soft_column if delete_settings is not None and delete_settings.mode == "soft" else None
        columns = {c.name: ColumnSpec(type=c.type) for c in shape.columns if c.name != soft}
        keyed = bool(shape.key)
        version = (self._own_version(name) or (self._cfg.version.column if self._cfg.version is not None else None)) \
            if keyed else None
        cfg = self._cfg.model_copy(update={
            "table": name, "columns": columns, "conflict_key": list(shape.key), "version_column": version,
            "on_conflict": "update" if keyed else "none", "auto_columns": False, "tables": {}})
        deletes = DeleteStatements(cfg, delete_settings) if delete_settings is not None and keyed else None
        with self._lock:
            self._versions += 1
            version = self._versions
        return AutoTable(name, shape, cfg, UpsertStatements(cfg, deletes), deletes, version, read_at=time.monotonic())

    # -- in the transaction --------------------------------------------------------------------
    def rows_for(self, t: AutoTable, carriers: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The table's rows of ``carriers`` (see the module docstring), deletes kept as deletes."""
        names = list(t.cfg.columns)
        stream_at = names.index(STREAM_COLUMN) if STREAM_COLUMN in names else -1
        offset_at = names.index(OFFSET_COLUMN) if OFFSET_COLUMN in names else -1
        key_at = [names.index(k) for k in t.cfg.conflict_key]
        version_at = names.index(t.cfg.version_column) if t.cfg.version_column else -1
        soft = t.deletes is not None and t.deletes.soft_column is not None
        out: list[tuple[Any, ...]] = []
        for carrier in carriers:
            shaped = carrier[VALUES_AT]
            if shaped is not None and (soft or not isinstance(carrier, DeleteRow)):
                values = shaped.values
                row = [None if i < 0 else values[i] for i in t.positions(shaped.shape)]
            else:
                row = [None] * len(names)
                shape = carrier[SHAPE_AT]
                key = dict(zip(shape.shape.key, carrier[KEY_AT], strict=True))
                for position in key_at:
                    row[position] = key.get(names[position])
            if stream_at >= 0:
                row[stream_at] = carrier[STREAM_AT]
                row[offset_at] = carrier[OFFSET_AT]
            if version_at >= 0:
                row[version_at] = version_value(carrier[VERSION_AT])
            if isinstance(carrier, DeleteRow):
                out.append((ImageDeleteRow if soft and type(carrier) is ImageDeleteRow else DeleteRow)(row))
            else:
                out.append(tuple(row))
        return out

