"""PostgreSQL sink: one transaction per batch, idempotent multi-row upsert.

Write path (``write_method: copy``, the default) -- chosen by measurement
(``bench/``; see README): COPY the batch into a session-local temporary
staging table, then one ``INSERT INTO t (...) SELECT ... FROM stage ON CONFLICT
(key) DO UPDATE SET ...`` and COMMIT. The staging table is ``ON COMMIT DELETE
ROWS`` and is created once per connection. ``write_method: values`` sends a
multi-row ``INSERT ... VALUES`` instead (for poolers that forbid temp tables).

Idempotency: rows are deduplicated by conflict key *before* they get here
(PostgreSQL refuses to update one row twice in one statement), and the upsert
makes a replayed batch a no-op. With ``version_column`` an update applies only
when the incoming version is not older than the stored one, so a stale
writer (e.g. a lane finishing after its partition moved) cannot overwrite a
newer value.

The SQL is composed once per table (:mod:`.statements`); driver errors are
translated by :func:`ingest.drivers.postgres.translate`, the one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from ingest.config.cdc import DeleteSettings
from ingest.drivers.postgres import check_dsn, make_pool, pooled, translate
from ingest.sinks.base import InTransaction, RowSource
from ingest.errors import PermanentError
from ingest.sinks.postgres.columnar import ColumnarStatements, csv_bytes
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.statements import (
    DeleteStatements,
    UpsertStatements,
    row_sources_query,
)
from ingest.core.mapping.columnar import StagedColumn
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
                 deletes: DeleteSettings | None = None) -> None:
        """``deletes``: the pipeline's records can delete (:class:`~ingest.types.DeleteRow` rows; see
        :class:`~ingest.sinks.postgres.statements.DeleteStatements`)."""
        self._cfg = cfg
        self._deletes = DeleteStatements(cfg, deletes) if deletes is not None else None
        self._sql = UpsertStatements(cfg, self._deletes)
        self._expired_at = 0.0  # monotonic time of the last tombstone expiry
        self._pool_size = max(1, cfg.pool_size or pool_size)
        self._name = name
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        #: statements sent per write, for tests and metrics (round trips that carry rows)
        self.statements = 0
        #: the columnar write's SQL, once :meth:`use_columnar` was called
        self._columnar: ColumnarStatements | None = None

    # -- connection management -------------------------------------------------
    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        conn.autocommit = True
        conn.execute(
            sql.SQL("SET statement_timeout = {}").format(sql.Literal(int(self._cfg.statement_timeout_ms)))
        )
        if self._cfg.write_method == "copy":
            conn.execute(self._sql.create_stage)
        if self._columnar is not None:
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
                with conn.transaction():
                    if rows:
                        self.write_rows_in(conn, rows)
                    if in_tx is not None:
                        in_tx(conn)

    def use_columnar(self, columns: Sequence[StagedColumn]) -> None:
        """Prepare :meth:`write_columns` for a columnar plan's columns (before the first write: each
        pooled connection creates its stage when it opens). Raises ValueError, saying why, when they are
        not this table's columns or the table is written by rows (deletes). A version column's guard
        (``EXCLUDED.v >= t.v``) is the row path's own conflict clause."""
        if self._deletes is not None:
            raise ValueError("a table whose records delete is written by rows")
        self._columnar = ColumnarStatements(self._cfg, columns)

    def encode_columns(self, table: Any) -> Any:
        """A columnar batch (a ``pyarrow.Table`` of this table's columns as
        :class:`~ingest.core.mapping.columnar.ColumnarPlan` stages them, one row per key) as the
        payload :meth:`write_encoded` sends: its CSV (:func:`~ingest.sinks.postgres.columnar.csv_bytes`).
        Pure, any thread (the pipeline thread, while the lane writes the previous batch)."""
        return csv_bytes(table)

    def write_columns(self, table: Any, *, token: str | None = None) -> None:
        """:meth:`write_encoded` of :meth:`encode_columns`."""
        self.write_encoded(self.encode_columns(table), token=token)

    def write_encoded(self, payload: Any, *, token: str | None = None) -> None:
        """Write an encoded columnar batch (:meth:`encode_columns`) in one transaction: CSV COPY into
        the stage, upsert (the commit empties the stage). Raises like :meth:`write` (TransientError,
        PermanentError...); a connection that is not UTF-8 raises PermanentError (the CSV is UTF-8).
        Requires :meth:`use_columnar`. ``token`` is ignored: the write is one transaction, and the sink
        takes no insert tokens."""
        statements = self._columnar
        assert statements is not None, "use_columnar() first"
        with translate() as t:
            with self.connection() as conn:
                t.conn = conn
                if conn.info.encoding != "utf-8":
                    raise PermanentError(f"the connection's encoding is {conn.info.encoding}, not UTF-8",
                                         error_class="encoding")
                with conn.transaction(), conn.cursor() as cur:
                    with cur.copy(statements.copy_stage) as copy:
                        copy.write(memoryview(payload))
                    cur.execute(statements.upsert)
                    self.statements += 2

    def row_sources(self, keys: Sequence[tuple[Any, ...]]) -> dict[tuple[Any, ...], RowSource]:
        """Where the rows with these conflict keys were last written from (rows that do not exist are
        left out). Only for tables with source columns (``tracks_sources``)."""
        out: dict[tuple[Any, ...], RowSource] = {}
        width = len(self._cfg.conflict_key)
        per_query = max(1, MAX_PARAMETERS // max(1, width))
        with translate() as t, self.connection() as conn:
            t.conn = conn
            for start in range(0, len(keys), per_query):
                chunk = keys[start:start + per_query]
                rows = conn.execute(row_sources_query(self._cfg, len(chunk)), [v for k in chunk for v in k]).fetchall()
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
        self._write_rows(conn, rows)
        if self._cfg.write_method == "copy":
            conn.execute(self._sql.clear_stage)

    def _write_rows(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        with conn.cursor() as cur:
            if self._deletes is not None:
                self._write_changes(cur, rows, self._deletes)
            elif self._cfg.write_method == "copy":
                with cur.copy(self._sql.copy_stage) as copy:
                    copy.set_types(self._sql.copy_types)
                    self._copy_rows(copy, rows)
                cur.execute(self._sql.insert_from_stage)
                self.statements += 2
            else:
                # One transaction, as many statements as the 65,535 bind parameters of the protocol need.
                per_statement = max(1, MAX_PARAMETERS // len(self._sql.columns))
                for start in range(0, len(rows), per_statement):
                    chunk = rows[start:start + per_statement]
                    cur.execute(self._sql.insert_values(len(chunk)), [v for row in chunk for v in row])
                    self.statements += 1

    def _copy_rows(self, copy: psycopg.Copy, rows: Sequence[tuple[Any, ...]]) -> None:
        """``rows`` into the stage, the numeric columns staged as text as their Decimal's text (statements.py)."""
        write = copy.write_row
        as_text = self._sql.numeric_as_text
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

    def _write_changes(self, cur: psycopg.Cursor[Any], rows: Sequence[tuple[Any, ...]], d: DeleteStatements) -> None:
        """Stage upserts and deletes with their flag, then upsert, delete and record tombstones
        (the keys are distinct, so the statements never touch one row twice)."""
        deletes = 0
        with cur.copy(self._sql.copy_stage) as copy:
            copy.set_types(self._sql.copy_types)
            for row in rows:
                deleted = isinstance(row, DeleteRow)
                deletes += deleted
                copy.write_row((*row, deleted, type(row) is ImageDeleteRow))
        cur.execute(self._sql.insert_from_stage)
        self.statements += 2
        if deletes:
            cur.execute(d.delete)
            if d.delete_with_image is not None:
                cur.execute(d.delete_with_image)
            cur.execute(d.record_tombstones)
            self.statements += 2
        if d.retention_s and time.monotonic() - self._expired_at > TOMBSTONE_EXPIRY_INTERVAL_S:
            self._expired_at = time.monotonic()
            cur.execute(d.expire)
