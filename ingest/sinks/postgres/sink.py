"""PostgreSQL sink: one transaction per batch, idempotent multi-row upsert.

Write path (``write_method: copy``, the default) -- chosen by measurement
(``bench/``; see README): COPY the batch into a session-local temporary
staging table, then one ``INSERT INTO t (...) SELECT ... FROM stage ON CONFLICT
(key) DO UPDATE SET ...`` and COMMIT. The staging table is ``ON COMMIT DELETE
ROWS`` and is created once per connection. ``write_method: values`` sends a
multi-row ``INSERT ... VALUES`` instead (for poolers that forbid temp tables).

Idempotency: rows are deduplicated by conflict key *before* they get here
(PostgreSQL refuses to update one row twice in one statement), and the upsert
makes a replayed batch a no-op -- with ``skip_unchanged`` (the default) one that
rewrites no row at all (no new row versions). With ``version_column`` an update applies only
when the incoming version is not older than the stored one, so a stale
writer (e.g. a lane finishing after its partition moved) cannot overwrite a
newer value.

The SQL is composed once per table (:mod:`.statements`); driver errors are
translated by :func:`ingest.drivers.postgres.translate`, the one place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import threading
import weakref
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from ingest.config.cdc import DeleteSettings
from ingest.drivers.postgres import check_dsn, connect, make_pool, pooled, translate
from ingest.sinks.base import InTransaction, RowSource
from ingest.errors import PermanentError, TransientError
from ingest.sinks.postgres.auto import UNDEFINED, AutoTables
from ingest.sinks.postgres.children import ChildTable
from ingest.sinks.postgres.columnar import ColumnarStatements, csv_bytes, routed_csv
from ingest.sinks.postgres.settings import OFFSET_COLUMN, STREAM_COLUMN, PostgresSinkSettings
from ingest.sinks.postgres.statements import (
    DELETED_FLAG,
    DeleteStatements,
    UpsertStatements,
    row_sources_query,
    sink_table_sql,
    stage_name,
)
from ingest.core.mapping.columnar import StagedColumn
from ingest.mirror.ddl import KeyedLocks, lock_key, postgres_tables
from ingest.mirror.router import table_of, without_table
from ingest.types import DeleteRow, ImageDeleteRow

log = logging.getLogger(__name__)

#: PostgreSQL's wire protocol counts bind parameters in 16 bits: one statement takes at most this many.
MAX_PARAMETERS = 65_535
#: How often (at most) a sink removes the tombstones past their retention, inside a batch's transaction.
TOMBSTONE_EXPIRY_INTERVAL_S = 60.0


class PostgresSink:
    """Writes batches into one table. Thread-safe: each ``write`` borrows a pooled connection.

    Owns its connection pool (created lazily on first use, closed by ``close``).
    """

    #: ``write`` ignores ``token``: the batch writer need not compute one.
    dedup_tokens = False

    def __init__(self, cfg: PostgresSinkSettings, *, pool_size: int, name: str = "sink",
                 deletes: DeleteSettings | None = None, children: Sequence[ChildTable] = (),
                 routed: bool = False) -> None:
        """``deletes``: the pipeline's records can delete (:class:`~ingest.types.DeleteRow` rows; see
        :class:`~ingest.sinks.postgres.statements.DeleteStatements`). ``children``: the child tables of
        the pipeline's ``explode`` steps (:mod:`.children`), written in each batch's transaction.
        ``routed``: ``cfg.table`` is a template and each row ends with its table's name
        (:mod:`ingest.mirror.router`): a batch writes every table it holds, each with one COPY and one
        upsert, all in its one transaction; a table is created the first time this sink sees it."""
        self._cfg = cfg
        self._routed = routed
        self._delete_settings = deletes
        #: routed: the SQL of each table seen so far (composed once), after its table was ensured
        self._tables: dict[str, _Table] = {}
        self._tables_lock = threading.Lock()
        self._table_lock = KeyedLocks()  # one per table name: a table's DDL never holds up the others
        self._routes = 0  # the next routed table's number in the shared stage
        #: routed: the tables whose stage each pooled connection has (created outside a transaction)
        self._staged: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        #: routed without deletes: one stage per session for every table (rows carry their table's number)
        self._shared = (UpsertStatements(cfg, shared_stage=stage_name(cfg.db_schema, cfg.table))
                        if routed and deletes is None and not cfg.auto_columns else None)
        #: columns: auto: the tables made from the records' schemas (:mod:`.auto`)
        self._auto = AutoTables(cfg, deletes) if cfg.auto_columns else None
        self._children = tuple(children)
        self._deletes = DeleteStatements(cfg, deletes) if deletes is not None else None
        self._sql = UpsertStatements(cfg, self._deletes)
        names = list(cfg.columns)
        #: explode: the parents the upsert applied, told by the source columns it returns (bigints that come
        #: back exactly as sent: a key of a rounding type -- numeric(p,s), timestamptz(p) -- would not)
        self._source_index = ((names.index(STREAM_COLUMN), names.index(OFFSET_COLUMN))
                              if STREAM_COLUMN in names and OFFSET_COLUMN in names else None)
        self._expired_at = 0.0  # monotonic time of the last tombstone expiry
        self._pool_size = max(1, cfg.pool_size or pool_size)
        self._name = name
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        #: statements sent per write, for tests and metrics (round trips that carry rows)
        self.statements = 0
        #: the columnar write's SQL, once :meth:`use_columnar` was called
        self._columnar: ColumnarStatements | None = None
        self._columnar_columns: tuple[StagedColumn, ...] = ()
        #: routed: the shared columnar stage's statements, and each table's number in the shared stages
        self._columnar_stage: ColumnarStatements | None = None
        self._route_numbers: dict[str, int] = {}

    # -- connection management -------------------------------------------------
    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        conn.autocommit = True
        conn.execute(
            sql.SQL("SET statement_timeout = {}").format(sql.Literal(int(self._cfg.statement_timeout_ms)))
        )
        # a session left behind by a connection that went silent mid-transaction releases its locks
        conn.execute(sql.SQL("SET idle_in_transaction_session_timeout = {}").format(
            sql.Literal(self._cfg.network.idle_in_transaction_ms(self._cfg.statement_timeout_ms))))
        if self._cfg.write_method == "copy" and not self._routed:
            conn.execute(self._sql.create_stage)
        for child in self._children:
            conn.execute(child.sql.create_stage)
        if self._columnar is not None and not self._routed:  # a routed table's stage: made with the table
            conn.execute(self._columnar.create_stage)

    def _get_pool(self) -> ConnectionPool:
        with self._lock:
            if self._pool is None:
                self._pool = make_pool(
                    self._cfg.dsn.get_secret_value(),
                    self._cfg.network,
                    statement_timeout_ms=self._cfg.statement_timeout_ms,
                    min_size=1,
                    max_size=self._pool_size,
                    configure=self._configure,
                    check=ConnectionPool.check_connection,
                    open=True,
                    # Short waits for a connection: the caller's retry policy backs off and asks again,
                    # while the pool keeps reconnecting in the background for as long as an outage lasts.
                    timeout=5.0,
                    reconnect_timeout=24 * 3600.0,
                    name=self._name,
                )
            return self._pool

    def warm_up(self, timeout_s: float = 2.0) -> None:
        """Open the pool and wait up to ``timeout_s`` for its first connection.

        Never raises: a failure is logged and the first write waits (and retries) as usual. The
        pool closes itself when ``wait`` times out, so a failed warm-up forgets it: the first write
        opens a new one (a closed pool would fail every retry for the rest of the run).
        """
        pool = self._get_pool()
        try:
            pool.wait(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort; the write path owns the retries
            log.warning("PostgreSQL not reachable at start; the first write will retry",
                        extra={"sink": self._name, "error": type(exc).__name__})
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.close()

    def check(self) -> None:
        """Connect and run ``SELECT 1``. Raises ServiceUnreachable (message without the password)."""
        check_dsn(self._cfg.dsn.get_secret_value(), f"postgres sink {self._cfg.table!r}", self._cfg.network)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    # -- writing ----------------------------------------------------------------
    def write(self, rows: Sequence[tuple[Any, ...]], *, token: str | None = None,
              in_tx: InTransaction | None = None) -> None:
        """Write ``rows`` (collapsed) in one transaction; see :class:`ingest.sinks.base.Sink`.

        ``in_tx(conn)`` runs inside the same transaction after the rows (replay marks its DLQ
        entries there). ``token`` is accepted and ignored: the upsert already makes a replayed
        batch a no-op.
        """
        if not rows and in_tx is None:
            return
        with translate() as t:
            with self.connection() as conn:
                t.conn = conn
                self.before_transaction(conn, rows)
                with conn.transaction():
                    if rows:
                        self.write_rows_in(conn, rows)
                    if in_tx is not None:
                        in_tx(conn)

    def use_columnar(self, columns: Sequence[StagedColumn]) -> None:
        """Prepare :meth:`write_columns` for a columnar plan's columns (before the first write: each
        pooled connection creates its stage when it opens). Raises ValueError, saying why, when they are
        not this table's columns or the table is written by rows (routed with deletes, exploded children).
        A version column's guard (``EXCLUDED.v >= t.v``) is the row path's own conflict clause; a table
        whose records delete stages the plan's rows with the row path's flags and applies them with the
        row path's statements (:meth:`_write_encoded_changes`)."""
        if self._deletes is not None and self._routed:
            raise ValueError("routed tables whose records delete are written by rows")
        if self._children:
            raise ValueError("a table with exploded child rows is written by rows")
        if self._auto is not None:
            raise ValueError("columns: auto maps each record by its own schema")
        # checks the columns, for routed tables too
        self._columnar = ColumnarStatements(self._cfg, columns, self._sql if self._deletes is not None else None)
        self._columnar_columns = tuple(columns)

    def encode_columns(self, table: Any) -> Any:
        """A columnar batch (a ``pyarrow.Table`` of this table's columns as
        :class:`~ingest.core.mapping.columnar.ColumnarPlan` stages them, one row per key) as the
        payload :meth:`write_encoded` sends: its CSV (:func:`~ingest.sinks.postgres.columnar.csv_bytes`).
        Pure, any thread (the pipeline thread, while the lane writes the previous batch). A table whose
        records delete (its rows carry the stage's flags, :class:`~ingest.cdc.columnar.ChangePlan`): the CSV
        and how many rows delete; None for no rows."""
        if self._deletes is None:
            return csv_bytes(table)
        if table is None or not table.num_rows:
            return None
        import pyarrow.compute as pc

        return csv_bytes(table), int(pc.sum(table.column(DELETED_FLAG).cast("int64")).as_py() or 0)

    def write_columns(self, table: Any, *, token: str | None = None) -> None:
        """:meth:`write_encoded` of :meth:`encode_columns`."""
        self.write_encoded(self.encode_columns(table), token=token)

    def write_encoded(self, payload: Any, *, token: str | None = None) -> None:
        """Write an encoded columnar batch (:meth:`encode_columns`) in one transaction: CSV COPY into
        the stage, upsert (the commit empties the stage). Raises like :meth:`write` (TransientError,
        PermanentError...); a connection that is not UTF-8 raises PermanentError (the CSV is UTF-8).
        Requires :meth:`use_columnar`. ``token`` is ignored: the write is one transaction, and the sink
        takes no insert tokens."""
        if self._deletes is not None:
            assert self._columnar is not None, "use_columnar() first"
            if payload is not None:
                self._write_encoded_changes(self._columnar, *payload)
            return
        with translate() as t:
            with self.connection() as conn:
                t.conn = conn
                if self._routed:  # each table ensured and the stage made, before the transaction
                    self._stage_columnar(conn, payload[0])
                with conn.transaction():
                    self.write_encoded_in(conn, payload)

    def write_encoded_in(self, conn: psycopg.Connection[Any], payload: Any) -> None:
        """:meth:`write_encoded` inside the caller's open transaction on a connection of this sink
        (exactly-once: beside the batch's offsets). At most once per transaction (or per savepoint
        rolled back): the stage is emptied by the commit. Raises psycopg's errors (the caller
        translates them); PermanentError for a connection that is not UTF-8. A table whose records delete:
        ``payload`` is ``(csv, deletes)`` (or None: no rows), written as :meth:`_changes_in` writes it."""
        statements = self._columnar
        assert statements is not None, "use_columnar() first"
        _require_utf8(conn)
        with conn.cursor() as cur:
            if self._deletes is not None:
                if payload is not None:
                    self._changes_in(cur, statements, *payload)
            elif self._routed:  # one COPY of every table's rows into the shared stage, every upsert in one go
                names, data = payload
                if not names:  # every record of the batch was poison
                    return
                with cur.copy(self._columnar_shared().copy_stage) as copy:
                    copy.write(memoryview(data))
                cur.execute(sql.SQL("; ").join(self._table(name).columnar.upsert for name in names))  # type: ignore[union-attr]
            else:
                with cur.copy(statements.copy_stage) as copy:
                    copy.write(memoryview(payload))
                cur.execute(statements.upsert)
            self.statements += 2

    def encode_routed(self, parts: Sequence[tuple[str, Any]]) -> Any:
        """A routed columnar batch -- ``(table, pyarrow.Table)`` per table -- as :meth:`write_encoded`
        sends it: the tables' names and one CSV of every row, each ending with its table's number (the
        shared stage's route). Pure but for numbering a table not seen before; any thread."""
        return [name for name, _ in parts], routed_csv([(self._route_of(name), table) for name, table in parts])

    def _route_of(self, name: str) -> int:
        """A routed table's number in the shared stages (given on first sight, never reused)."""
        number = self._route_numbers.get(name)
        if number is None:
            with self._tables_lock:
                number = self._route_numbers.setdefault(name, len(self._route_numbers))
        return number

    def _columnar_shared(self) -> ColumnarStatements:
        """The shared columnar stage's own statements (create, COPY with the table's number)."""
        if self._columnar_stage is None:
            self._columnar_stage = ColumnarStatements(self._cfg, self._columnar_columns,
                                                      shared_stage=stage_name(self._cfg.db_schema, self._cfg.table) + "_c")
        return self._columnar_stage

    def _stage_columnar(self, conn: psycopg.Connection[Any], tables: Sequence[str]) -> None:
        """A routed columnar batch, before its transaction (autocommit): each table ensured, its columnar
        SQL composed and the session's stage of it made, once per pooled connection."""
        staged = self._staged.get(conn)
        if staged is None:
            staged = self._staged[conn] = set()
        shared = self._columnar_shared()
        for name in tables:
            t = self._table(name)
            if t.columnar is None:
                t.columnar = ColumnarStatements(t.cfg, self._columnar_columns, route=self._route_of(name),
                                                shared_stage=stage_name(self._cfg.db_schema, self._cfg.table) + "_c")
        if COLUMNAR_STAGED not in staged:
            conn.execute(shared.create_stage)
            staged.add(COLUMNAR_STAGED)

    def _write_encoded_changes(self, statements: ColumnarStatements, csv: Any, deletes: int) -> None:
        """:meth:`write_encoded` of a table whose records delete: :meth:`_changes_in`, in one transaction."""
        with translate() as t:
            with self.connection() as conn:
                t.conn = conn
                _require_utf8(conn)
                with conn.transaction(), conn.cursor() as cur:
                    self._changes_in(cur, statements, csv, deletes)

    def _changes_in(self, cur: psycopg.Cursor[Any], statements: ColumnarStatements, csv: Any, deletes: int) -> None:
        """A columnar batch of changes (``deletes`` of its rows delete) in the caller's transaction: the
        CSV into the columnar stage, moved into the row path's stage (:attr:`ColumnarStatements.transfer`),
        then the row path's statements (:meth:`_apply_changes`)."""
        with cur.copy(statements.copy_stage) as copy:
            copy.write(memoryview(csv))
        cur.execute(statements.transfer)
        self._apply_changes(cur, self._sql, self._deletes, deletes, self)  # type: ignore[arg-type]

    def row_sources(self, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], RowSource]:
        """Where the rows with these conflict keys were last written from (rows that do not exist are
        left out). Only for tables with source columns (``tracks_sources``)."""
        if self._auto is not None:  # keys are (the key's values, table)
            by_auto: dict[str, list[tuple[Any, ...]]] = {}
            for key in keys:
                by_auto.setdefault(key[-1], []).append(key[0])
            out: dict[tuple[Any, ...], RowSource] = {}
            for table, table_keys in by_auto.items():
                t = self._auto.lookup(table)
                if t is None or STREAM_COLUMN not in t.cfg.columns:
                    continue  # not written by this process yet, or append-only: nothing to guard
                out.update({(k, table): source for k, source in self._row_sources(t.cfg, table_keys).items()})
            return out
        if self._routed:  # the keys end with their table (ingest.mirror.router): ask each table
            by_table: dict[str, list[tuple[Any, ...]]] = {}
            for key in keys:
                by_table.setdefault(key[-1], []).append(key[:-1])
            return {(*k, table): source for table, table_keys in by_table.items()
                    for k, source in self._row_sources(self._table(table).cfg, table_keys).items()}
        return self._row_sources(self._cfg, keys)

    def _row_sources(self, cfg: PostgresSinkSettings, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], RowSource]:
        out: dict[tuple[Any, ...], RowSource] = {}
        width = len(cfg.conflict_key)
        per_query = max(1, MAX_PARAMETERS // max(1, width))
        with translate() as t, self.connection() as conn:
            t.conn = conn
            for start in range(0, len(keys), per_query):
                chunk = keys[start:start + per_query]
                rows = conn.execute(row_sources_query(cfg, len(chunk)), [v for k in chunk for v in k]).fetchall()
                for row in rows:
                    out[tuple(row[:width])] = RowSource(row[width], row[width + 1])
            conn.rollback()
        return out

    def connection(self) -> Any:
        """A pooled connection (context manager); for work in one transaction with the rows.

        Replaced by a new one after an error that condemns its session (:func:`ingest.drivers.postgres.pooled`)."""
        return pooled(self._get_pool())

    def write_rows_in(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        """Write ``rows`` inside the caller's open transaction; several such writes may share it
        (exactly-once savepoints), so the stage is emptied after each."""
        if self._auto is not None:
            self._write_auto(conn, rows)
            return
        if self._routed:
            self._write_routed(conn, rows)
            return
        self._write_rows(conn, rows, self._sql, self._deletes)
        if self._cfg.write_method == "copy":
            conn.execute(self._sql.clear_stage)

    def _write_routed(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        """Each table's rows (in batch order), in the caller's transaction: without deletes, one COPY of
        every row into the shared stage and one round trip of every table's upsert (and the stage's
        clearing); with deletes, one COPY and one upsert per table."""
        if self._shared is not None:
            self._write_shared(conn, rows)
            return
        by_table: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            table = table_of(row)
            found = by_table.get(table)
            if found is None:
                by_table[table] = found = []
            found.append(without_table(row))
        staged = self._staged.get(conn, ())
        for table, table_rows in by_table.items():
            t = self._table(table)
            if table not in staged:  # in the caller's transaction: rolled back with it if it fails
                conn.execute(t.sql.create_stage)
            self._write_rows(conn, table_rows, t.sql, t.deletes, t)
            conn.execute(t.sql.clear_stage)

    def _write_auto(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        """``columns: auto``: each table's rows (carriers opened by :mod:`.auto`), in the caller's
        transaction, one COPY and one upsert per table; a table altered behind ingest's back is forgotten
        (the retry reads the catalog and repairs it)."""
        auto = self._auto
        assert auto is not None
        by_table: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            by_table.setdefault(table_of(row), []).append(row)
        tables = auto.batch_tables(conn, by_table)  # as prepared on conn; refuses incompatible rows here
        try:
            for name, carriers in by_table.items():
                t = tables[name]
                self._write_rows(conn, auto.rows_for(t, carriers), t.sql, t.deletes, t)
                conn.execute(t.sql.clear_stage)
        except UNDEFINED:
            auto.forget(by_table)
            raise

    def _write_shared(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        shared = self._shared
        assert shared is not None
        tables: dict[str, _Table] = {}
        as_text = shared.numeric_as_text
        with conn.cursor() as cur:
            if "" not in self._staged.get(conn, ()):
                cur.execute(shared.create_stage)
            with cur.copy(shared.copy_stage) as copy:
                copy.set_types(shared.copy_types)
                write = copy.write_row
                for row in rows:
                    name = row[-1]
                    t = tables.get(name)
                    if t is None:
                        t = tables[name] = self._table(name)
                    staged = list(row)
                    staged[-1] = t.route
                    for i in as_text:
                        if staged[i] is not None:
                            staged[i] = str(staged[i])
                    write(staged)
            cur.execute(sql.SQL("; ").join([*(t.sql.insert_from_stage for t in tables.values()), shared.clear_stage]))
            self.statements += 2

    def before_transaction(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...] | None]) -> None:
        """What a batch of ``rows`` needs before its transaction opens (autocommit; ``None`` rows are
        skipped): routed, each table ensured (DDL never runs inside a batch's transaction, where it would
        hold the table's lock, or wait on another writer's, for the batch's whole life) and its stage."""
        if self._auto is not None:
            self._auto.prepare(conn, rows)
        elif self._routed:
            tables = {table_of(row) for row in rows if row is not None}
            if tables:
                self._stage_tables(conn, tables)

    def _stage_tables(self, conn: psycopg.Connection[Any], tables: set[str]) -> None:
        """Before a routed batch's transaction (autocommit): each table ensured and its session stage
        created, once per pooled connection -- committed at once, so a batch that rolls back cannot
        take a stage the connection's later batches count on."""
        staged = self._staged.get(conn)
        if staged is None:
            staged = self._staged[conn] = set()
        for table in tables - staged:
            t = self._table(table)
            if self._shared is None:
                conn.execute(t.sql.create_stage)
            staged.add(table)
        if self._shared is not None and "" not in staged:
            conn.execute(self._shared.create_stage)
            staged.add("")  # the shared stage

    def plan_auto_table(self, name: str, shape: Any, *, dry_run: bool) -> Any:
        """``columns: auto``: create or evolve ``name`` for ``shape`` now (``ingest migrate``), or with
        ``dry_run`` say what that would run -- a :class:`~ingest.mirror.ddl.DdlResult`."""
        assert self._auto is not None, "columns: auto only"
        return self._auto.migrate(name, shape, dry_run=dry_run)

    def ensure_table(self, name: str) -> None:
        """Create the routed table ``name`` now if it is missing (``ingest migrate``). Raises like a write;
        ValueError with ``columns: auto`` (a table is made from a record's schema)."""
        if self._auto is not None:
            raise ValueError("columns: auto: a table is made from its records' schemas")
        self._table(name)

    def _table(self, name: str) -> _Table:
        """A routed table's SQL, the table created (idempotently) the first time this sink sees it."""
        t = self._tables.get(name)
        if t is not None:
            return t
        with self._table_lock(name):
            t = self._tables.get(name)
            if t is None:
                cfg = self._cfg.model_copy(update={"table": name})
                deletes = DeleteStatements(cfg, self._delete_settings) if self._delete_settings is not None else None
                ensure_routed_table(cfg, deletes)
                shared = stage_name(self._cfg.db_schema, self._cfg.table) if self._shared is not None else None
                with self._tables_lock:
                    route = self._routes
                    self._routes += 1
                upsert = UpsertStatements(cfg, deletes, shared_stage=shared, route=route if shared else None)
                t = self._tables[name] = _Table(cfg, upsert, deletes, route)
            return t

    def existing_tables(self) -> list[str]:
        """The tables of the sink's schema, oldest first (the routed case guard's seed). Raises like a write."""
        with translate() as t, self.connection() as conn:
            t.conn = conn
            return postgres_tables(conn, self._cfg.db_schema)

    def _write_rows(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]], upsert: UpsertStatements,
                    deletes: DeleteStatements | None, expiry: Any = None) -> None:
        with conn.cursor() as cur:
            if deletes is not None:
                self._write_changes(cur, rows, upsert, deletes, expiry or self)
            elif self._cfg.write_method == "copy":
                with cur.copy(upsert.copy_stage) as copy:
                    copy.set_types(upsert.copy_types)
                    self._copy_rows(copy, rows, upsert)
                if not self._children:
                    cur.execute(upsert.insert_from_stage)
                    self.statements += 2
                    return
                # Children follow only the parents the upsert's ordering guard let through (it skips a late
                # writer's), those it left unchanged included (statements.UpsertStatements._sources_of_applied):
                # each collapsed row has its own record, so (stream, offset) names it exactly.
                assert upsert.applied_sources is not None, "explode tables track sources"
                cur.execute(upsert.applied_sources)
                applied = set(cur.fetchall())
                stream_at, offset_at = self._source_index  # type: ignore[misc]
                parents = [row for row in rows if (row[stream_at], row[offset_at]) in applied]
                for child in self._children:  # in the parents' transaction (module .children)
                    child.write(cur, parents)
                self.statements += 2 + 2 * len(self._children)
            else:
                # One transaction, as many statements as the 65,535 bind parameters of the protocol need.
                per_statement = max(1, MAX_PARAMETERS // len(self._sql.columns))
                for start in range(0, len(rows), per_statement):
                    chunk = rows[start:start + per_statement]
                    cur.execute(self._sql.insert_values(len(chunk)), [v for row in chunk for v in row])
                    self.statements += 1

    def _copy_rows(self, copy: psycopg.Copy, rows: Sequence[tuple[Any, ...]], upsert: UpsertStatements) -> None:
        """``rows`` into the stage, the numeric columns staged as text as their Decimal's text (statements.py)."""
        write = copy.write_row
        as_text = upsert.numeric_as_text
        if not as_text:
            for row in rows:
                write(row)
            return
        for row in rows:
            staged = list(row)
            for i in as_text:
                value = staged[i]
                if value is not None:
                    staged[i] = str(value)
            write(staged)

    def _write_changes(self, cur: psycopg.Cursor[Any], rows: Sequence[tuple[Any, ...]], upsert: UpsertStatements,
                       d: DeleteStatements, expiry: Any) -> None:
        """Stage upserts and deletes with their flag, then upsert, delete and record tombstones
        (the keys are distinct, so the statements never touch one row twice). ``expiry``: what holds
        the time of the table's last tombstone expiry (``_expired_at``)."""
        deletes = 0
        with cur.copy(upsert.copy_stage) as copy:
            copy.set_types(upsert.copy_types)
            for row in rows:
                deleted = isinstance(row, DeleteRow)
                deletes += deleted
                copy.write_row((*row, deleted, type(row) is ImageDeleteRow))
        self._apply_changes(cur, upsert, d, deletes, expiry)

    def _apply_changes(self, cur: psycopg.Cursor[Any], upsert: UpsertStatements, d: DeleteStatements, deletes: int,
                       expiry: Any) -> None:
        """The statements of a staged batch of changes (``deletes``: how many staged rows delete): upsert,
        delete and record tombstones, and now and then expire old tombstones -- the row path's, and the
        columnar tier's after its rows reached the same stage."""
        cur.execute(upsert.insert_from_stage)
        self.statements += 2
        if deletes:
            cur.execute(d.delete)
            if d.delete_with_image is not None:
                cur.execute(d.delete_with_image)
            cur.execute(d.record_tombstones)
            self.statements += 2
        if d.retention_s and time.monotonic() - expiry._expired_at > TOMBSTONE_EXPIRY_INTERVAL_S:
            expiry._expired_at = time.monotonic()
            cur.execute(d.expire)


@dataclass(slots=True)
class _Table:
    """A routed table: its settings and SQL."""

    cfg: PostgresSinkSettings
    sql: UpsertStatements
    deletes: DeleteStatements | None
    #: the table's number in the shared stage
    route: int = 0
    #: the columnar tier's SQL of the table (its stage and upsert), once a columnar batch wrote it
    columnar: ColumnarStatements | None = None
    #: monotonic time of the table's last tombstone expiry
    _expired_at: float = 0.0


#: The mark of the routed tables' shared columnar stage among a session's stages (no table name holds a NUL).
COLUMNAR_STAGED = "\x00columnar"

#: How long a routed table's DDL waits for a lock before it gives up (the batch's retries take it again):
#: never queued for long ahead of readers behind a long transaction, never stuck on one.
ROUTED_DDL_LOCK_TIMEOUT_MS = 5_000


def _require_utf8(conn: psycopg.Connection[Any]) -> None:
    """The columnar CSV is UTF-8: PermanentError for a connection of another encoding."""
    if conn.info.encoding != "utf-8":
        raise PermanentError(f"the connection's encoding is {conn.info.encoding}, not UTF-8", error_class="encoding")


def ensure_routed_table(cfg: PostgresSinkSettings, deletes: DeleteStatements | None) -> None:
    """Create a routed table (and its tombstone table) if missing, idempotently, on its own connection.

    A table that exists with every column (and its tombstone table, with deletes) is left alone: no DDL,
    so no lock on it and no privilege beyond writing it. Otherwise, under a transaction-level advisory
    lock on the schema (two processes or lanes creating tables at once take turns; the second finds
    the table made: ``IF NOT EXISTS``), with a lock timeout: a table another session holds makes this
    fail fast, and the batch's retries try again. Raises TransientError / PermanentError
    (:func:`translate`), which the batch's retries and isolation handle like any write error."""
    network = cfg.network.model_copy(update={"client_timeout_ms": 0})  # DDL may wait (bounded by lock_timeout)
    with translate() as t, connect(cfg.dsn.get_secret_value(), network, autocommit=True) as conn:
        t.conn = conn
        if _routed_table_ready(conn, cfg, deletes):
            return
        statements = sink_table_sql(cfg)
        if deletes is not None:
            statements.append(deletes.create_tombstones)
            if deletes.soft_column_ddl is not None:
                statements.append(deletes.soft_column_ddl)
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(ROUTED_DDL_LOCK_TIMEOUT_MS)))
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [lock_key(cfg.db_schema, "")])
            for statement in statements:
                conn.execute(statement)


def _routed_table_ready(conn: psycopg.Connection[Any], cfg: PostgresSinkSettings,
                        deletes: DeleteStatements | None) -> bool:
    """The table exists with every column the sink writes (and, with deletes, its tombstone table and
    soft-delete column): a catalog read, no lock."""
    wanted = set(cfg.columns)
    if deletes is not None and deletes.soft_column is not None:
        wanted.add(deletes.soft_column)
    found = {r[0] for r in conn.execute(
        "SELECT a.attname FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 "
        "AND NOT a.attisdropped", [sql.Identifier(cfg.db_schema, cfg.table).as_string(conn)]).fetchall()}
    if not wanted <= found:
        return False
    if deletes is not None:
        tomb = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [deletes.tombstones.as_string(conn)]).fetchone()
        return bool(tomb and tomb[0])
    return True
