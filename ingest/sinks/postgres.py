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

Every SQL name comes from config and is composed with
:class:`psycopg.sql.Identifier`; column types are the normalised forms
returned by :func:`ingest.config.pg_base_type` (letters, digits, spaces and a
numeric modifier only).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from ingest.config import PostgresSink as PostgresSinkSettings
from ingest.config import pg_base_type
from ingest.drivers.postgres import check_dsn, translate
from ingest.errors import PermanentError, TransientError

log = logging.getLogger(__name__)

#: Called inside the batch transaction after the rows are written (exactly-once
#: offset storage, DLQ rows joining the transaction).
TxHook = Callable[[psycopg.Connection[Any]], None]


def table_ident(schema: str, table: str) -> sql.Composable:
    return sql.Identifier(schema, table)


def stage_name(schema: str, table: str) -> str:
    """A stable temp-table name per target table (identifier-safe, <= 63 bytes)."""
    digest = hashlib.sha1(f"{schema}.{table}".encode()).hexdigest()[:16]
    return f"ingest_stage_{digest}"


#: PostgreSQL's wire protocol counts bind parameters in 16 bits: one statement takes at most this many.
MAX_PARAMETERS = 65_535


#: psycopg type names for binary COPY, by normalised column base type.
_COPY_TYPE: dict[str, str] = {
    "smallint": "int2", "integer": "int4", "bigint": "int8", "numeric": "numeric", "real": "float4",
    "double precision": "float8", "text": "text", "boolean": "bool", "timestamptz": "timestamptz",
    "timestamp": "timestamp", "date": "date", "uuid": "uuid", "bytea": "bytea",
}


class UpsertStatements:
    """SQL for one target table, composed once."""

    def __init__(self, cfg: PostgresSinkSettings) -> None:
        self.columns = list(cfg.columns)
        target = table_ident(cfg.db_schema, cfg.table)
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        stage = sql.Identifier(stage_name(cfg.db_schema, cfg.table))
        # The stage is filled with binary COPY (≈1.5x faster than text here). Columns whose binary
        # wire format differs from what the mapper produces (json/jsonb: the mapper emits JSON
        # text; varchar(n): checked on insert) are staged as text and cast by the INSERT.
        stage_types: list[str] = []
        select_exprs: list[sql.Composable] = []
        self.copy_types: list[str] = []
        for c, spec in cfg.columns.items():
            base, full = pg_base_type(spec.type)
            staged = "text" if base in ("json", "jsonb", "varchar") else full
            stage_types.append(staged)
            self.copy_types.append(_COPY_TYPE.get(base, "text") if staged != "text" else "text")
            cast = sql.SQL("::{}").format(sql.SQL(full)) if base in ("json", "jsonb") else sql.SQL("")
            select_exprs.append(sql.SQL("{}{}").format(sql.Identifier(c), cast))
        col_defs = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in zip(cfg.columns, stage_types)
        )
        self.create_stage = sql.SQL(
            "CREATE TEMP TABLE IF NOT EXISTS {stage} ({defs}) ON COMMIT DELETE ROWS"
        ).format(stage=stage, defs=col_defs)
        self.copy_stage = sql.SQL("COPY {stage} ({cols}) FROM STDIN (FORMAT BINARY)").format(stage=stage, cols=cols)
        # Several pieces may share one transaction (exactly-once savepoints): empty the stage after each.
        self.clear_stage = sql.SQL("DELETE FROM {stage}").format(stage=stage)
        select = sql.SQL(", ").join(select_exprs)
        conflict = self._conflict_clause(cfg, target)
        self.insert_from_stage = sql.SQL("INSERT INTO {t} AS t ({cols}) SELECT {sel} FROM {stage}{conflict}").format(
            t=target, cols=cols, sel=select, stage=stage, conflict=conflict
        )
        self._insert_values_head = sql.SQL("INSERT INTO {t} AS t ({cols}) VALUES ").format(t=target, cols=cols)
        self._conflict = conflict
        self._row_placeholder = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(self.columns)))

    @staticmethod
    def _conflict_clause(cfg: PostgresSinkSettings, target: sql.Composable) -> sql.Composable:
        if cfg.on_conflict == "none":
            return sql.SQL("")
        keys = sql.SQL(", ").join(sql.Identifier(k) for k in cfg.conflict_key)
        if cfg.on_conflict == "nothing":
            return sql.SQL(" ON CONFLICT ({keys}) DO NOTHING").format(keys=keys)
        updates = [c for c in cfg.columns if c not in cfg.conflict_key]
        if not updates:
            return sql.SQL(" ON CONFLICT ({keys}) DO NOTHING").format(keys=keys)
        assignments = sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in updates
        )
        clause = sql.SQL(" ON CONFLICT ({keys}) DO UPDATE SET {set}").format(keys=keys, set=assignments)
        if cfg.version_column:
            v = sql.Identifier(cfg.version_column)
            clause = sql.SQL("{clause} WHERE t.{v} IS NULL OR EXCLUDED.{v} >= t.{v}").format(clause=clause, v=v)
        return clause

    def insert_values(self, n_rows: int) -> sql.Composable:
        return sql.Composed(
            [self._insert_values_head, sql.SQL(", ").join([self._row_placeholder] * n_rows), self._conflict]
        )


class PostgresSink:
    """Writes batches into one table. Thread-safe: each ``write`` borrows a pooled connection.

    Owns its connection pool (created lazily on first use, closed by ``close``).
    """

    #: ``write`` ignores ``token``: the batch writer need not compute one.
    dedup_tokens = False

    def __init__(self, cfg: PostgresSinkSettings, *, pool_size: int, name: str = "sink") -> None:
        self._cfg = cfg
        self._sql = UpsertStatements(cfg)
        self._pool_size = max(1, cfg.pool_size or pool_size)
        self._name = name
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        #: statements sent per write, for tests and metrics (round trips that carry rows)
        self.statements = 0

    # -- connection management -------------------------------------------------
    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        conn.autocommit = True
        conn.execute(
            sql.SQL("SET statement_timeout = {}").format(sql.Literal(int(self._cfg.statement_timeout_ms)))
        )
        if self._cfg.write_method == "copy":
            conn.execute(self._sql.create_stage)

    def _get_pool(self) -> ConnectionPool:
        with self._lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self._cfg.dsn.get_secret_value(),
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

        Never raises: a failure is logged and the first write waits (and retries) as usual.
        """
        try:
            self._get_pool().wait(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort; the write path owns the retries
            log.warning("PostgreSQL not reachable at start; the first write will retry",
                        extra={"sink": self._name, "error": type(exc).__name__})

    def check(self) -> None:
        """Connect and run ``SELECT 1``. Raises ServiceUnreachable (message without the password)."""
        check_dsn(self._cfg.dsn.get_secret_value(), f"postgres sink {self._cfg.table!r}")

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    # -- writing ----------------------------------------------------------------
    def write(self, rows: Sequence[tuple[Any, ...]], tx_hook: TxHook | None = None, *,
              token: str | None = None) -> None:
        """Write ``rows`` (deduplicated) in one transaction; see :class:`ingest.sinks.base.Sink`.

        ``tx_hook`` runs inside the same transaction after the rows (used for
        exactly-once offset storage). ``token`` is accepted and ignored: the
        upsert already makes a replayed batch a no-op. Raises TransientError /
        PermanentError only.
        """
        if not rows and tx_hook is None:
            return
        with translate() as t:
            with self._get_pool().connection() as conn:
                t.conn = conn
                with conn.transaction():
                    if rows:
                        self._write_rows(conn, rows)
                    if tx_hook is not None:
                        tx_hook(conn)

    def exactly_once_writer(self, *, pipeline: str, lanes: int, dlq: Any) -> Callable[..., Any]:
        """A function running one lane batch as a single exactly-once transaction (see ingest.exactly_once).

        ``dlq`` must be a PostgresDlq in this database: its rows join the transaction.
        """
        from ingest.dlq.base import DlqEntry
        from ingest.dlq.postgres import entry_row
        from ingest.exactly_once import ROUTING_RECORD_KEY, ROUTING_ROW_KEY, LaneOffsets, write_batch_exactly_once
        from ingest.types import Failure

        routing = ROUTING_ROW_KEY if self._cfg.collapse_rule().key_index is not None else ROUTING_RECORD_KEY
        lane_offsets = LaneOffsets(self._cfg.db_schema, pipeline, lanes, routing)

        def put_dlq(conn: psycopg.Connection[Any], entries: list[Any]) -> None:
            with conn.cursor() as cur:
                dlq.put_in(cur, [entry_row(e) for e in entries])

        def write_failure(item: Any, exc: PermanentError) -> Any:
            return DlqEntry(pipeline, item.record, Failure("write", exc.error_class, str(exc), exc.sqlstate))

        def run(lane: int, items: Sequence[Any], plan: Callable[..., Any]) -> tuple[int, list[Any], int, int]:
            try:
                with translate() as t, self._get_pool().connection() as conn, conn.transaction():
                    t.conn = conn
                    return write_batch_exactly_once(
                        conn, lane=lane, items=items, lane_offsets=lane_offsets, plan=plan,
                        write_rows=self._write_rows_and_clear, put_dlq=put_dlq, write_failure=write_failure,
                    )
            except PermanentError as err:
                # Outside the savepoints (offsets, DLQ rows) nothing is the data's fault: retry.
                raise TransientError(str(err), sqlstate=err.sqlstate, error_class="exactly_once_tx") from err

        return run

    def _write_rows_and_clear(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        """``_write_rows`` for several writes in one transaction: the stage is emptied after each."""
        self._write_rows(conn, rows)
        if self._cfg.write_method == "copy":
            conn.execute(self._sql.clear_stage)

    def _write_rows(self, conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
        with conn.cursor() as cur:
            if self._cfg.write_method == "copy":
                with cur.copy(self._sql.copy_stage) as copy:
                    copy.set_types(self._sql.copy_types)
                    for row in rows:
                        copy.write_row(row)
                cur.execute(self._sql.insert_from_stage)
                self.statements += 2
            else:
                # One transaction, as many statements as the 65,535 bind parameters of the protocol need.
                per_statement = max(1, MAX_PARAMETERS // len(self._sql.columns))
                for start in range(0, len(rows), per_statement):
                    chunk = rows[start:start + per_statement]
                    cur.execute(self._sql.insert_values(len(chunk)), [v for row in chunk for v in row])
                    self.statements += 1
