"""PostgreSQL DLQ backend: the ``ingest_dlq`` table (DDL in ``sql/dlq_postgres.sql``).

``put`` upserts on (pipeline, topic, partition, offset): a record that is
dead-lettered again (after a crash before its offset was committed, or by a
failed replay) keeps one row whose ``attempts`` and ``last_failed_at`` advance
and whose error fields show the latest failure.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolTimeout

from ingest.dlq.base import DlqEntry
from ingest.config.base import PgNetworkSettings
from ingest.drivers.postgres import classify, execute_ddl, load_sql, make_pool, pooled
from ingest.errors import TransientError
from ingest.redact import scrub

_COLUMNS = (
    "pipeline", "topic", "partition", "offset", "record_timestamp", "key", "value",
    "headers", "stage", "error_class", "error_message", "sqlstate", "replays",
)
#: Header carried by records that ``replay-dlq --to topic`` republished: how many
#: replays the record has been through (the loop guard's memory across topics).
REPLAYS_HEADER = "ingest.replays"


def headers_json(headers: Sequence[tuple[str, bytes | None]]) -> str:
    """Headers as JSON: ``[[name, base64 value or null], ...]`` (bytes kept exactly)."""
    return orjson.dumps(
        [[name, None if value is None else base64.b64encode(value).decode()] for name, value in headers]
    ).decode()


def headers_from_json(value: Any) -> tuple[tuple[str, bytes | None], ...]:
    """Inverse of :func:`headers_json` (accepts the decoded jsonb value)."""
    items = orjson.loads(value) if isinstance(value, (str, bytes)) else (value or [])
    return tuple((name, None if b64 is None else base64.b64decode(b64)) for name, b64 in items)


def replays_of(headers: Sequence[tuple[str, bytes | None]]) -> int:
    for name, value in headers:
        if name == REPLAYS_HEADER and value is not None:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def entry_row(entry: DlqEntry) -> tuple[Any, ...]:
    rec = entry.record
    ts = (
        datetime.fromtimestamp(rec.timestamp_ms / 1000, tz=timezone.utc)
        if rec.timestamp_ms is not None and rec.timestamp_ms >= 0
        else None
    )
    return (
        entry.pipeline, rec.topic, rec.partition, rec.offset, ts, rec.key, rec.value,
        headers_json(rec.headers), entry.failure.stage, entry.failure.error_class,
        scrub(entry.failure.message).replace("\x00", "\\0")[:4000], entry.failure.sqlstate, replays_of(rec.headers),
    )


def upsert_sql(schema: str, table: str) -> sql.Composable:
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in _COLUMNS)
    return sql.SQL(
        "INSERT INTO {t} AS d ({cols}) VALUES ({ph}) "
        'ON CONFLICT (pipeline, topic, "partition", "offset") DO UPDATE SET '
        "attempts = d.attempts + 1, last_failed_at = now(), stage = EXCLUDED.stage, "
        "error_class = EXCLUDED.error_class, error_message = EXCLUDED.error_message, "
        "sqlstate = EXCLUDED.sqlstate, "
        "status = CASE WHEN d.status = 'replayed' THEN 'pending' ELSE d.status END"
    ).format(t=sql.Identifier(schema, table), cols=cols, ph=sql.SQL(", ").join(sql.Placeholder() * len(_COLUMNS)))


class PostgresDlq:
    """Writes DLQ entries into a PostgreSQL table. Thread-safe (pooled connections)."""

    def __init__(self, dsn: str, schema: str, table: str, *, pool_size: int = 2,
                 statement_timeout_ms: int = 30_000, network: PgNetworkSettings | None = None) -> None:
        self._dsn = dsn
        self._network = network or PgNetworkSettings()
        self._statement_timeout_ms = statement_timeout_ms
        self._upsert = upsert_sql(schema, table)
        self._pool_size = pool_size
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()

    def _get_pool(self) -> ConnectionPool:
        with self._lock:
            if self._pool is None:
                self._pool = make_pool(
                    self._dsn, self._network, statement_timeout_ms=self._statement_timeout_ms,
                    min_size=1, max_size=self._pool_size, open=True,
                    check=ConnectionPool.check_connection, timeout=5.0, reconnect_timeout=24 * 3600.0,
                    configure=self._configure, name="dlq",
                )
            return self._pool

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        # A locked or stalled DLQ table surfaces as a (retried, logged) timeout instead of a silent wait.
        conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(self._statement_timeout_ms)))
        # a session left behind by a connection that went silent mid-transaction releases its locks
        conn.execute(sql.SQL("SET idle_in_transaction_session_timeout = {}").format(
            sql.Literal(self._network.idle_in_transaction_ms(self._statement_timeout_ms))))
        conn.commit()

    def put(self, entries: Sequence[DlqEntry]) -> None:
        if not entries:
            return
        rows = [entry_row(e) for e in entries]
        try:
            with pooled(self._get_pool()) as conn:
                with conn.transaction(), conn.cursor() as cur:
                    self.put_in(cur, rows)
        except PoolTimeout as exc:
            raise TransientError(f"DLQ database unavailable: {exc}", error_class="pool_timeout") from None
        except psycopg.Error as exc:
            # Any DLQ failure is retried: a DLQ that rejects data is a bug to fix, never a reason to drop.
            err = classify(exc)
            raise TransientError(f"DLQ write failed: {err}", sqlstate=err.sqlstate, error_class="dlq_unavailable") from exc

    def put_in(self, cur: psycopg.Cursor[Any], rows: list[tuple[Any, ...]]) -> None:
        """Write prepared rows with an open cursor (inside the caller's transaction)."""
        cur.executemany(self._upsert, rows)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


# --------------------------------------------------------------------------- migrate


def derived_name(table: str, suffix: str) -> str:
    """``<table>_<suffix>`` as a PostgreSQL name (≤ 63 bytes), distinct per suffix and never equal to ``table``.

    Long names keep a byte-safe prefix of the table plus a short hash of the whole name.
    """
    name = f"{table}_{suffix}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(table.encode()).hexdigest()[:8]
    room = 63 - len(suffix) - len(digest) - 2
    prefix = table.encode()[:room].decode("utf-8", "ignore")
    return f"{prefix}_{digest}_{suffix}"


def dlq_table_sql(schema: str, table: str) -> list[sql.Composable]:
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)),
        load_sql(
            "dlq_postgres.sql",
            schema=schema,
            table=table,
            uniq=derived_name(table, "record_key"),
            idx_time=derived_name(table, "pipeline_time_idx"),
            idx_status=derived_name(table, "pipeline_status_idx"),
        ),
    ]


def migrate_dlq_table(dsn: str, schema: str, table: str, what: str) -> None:
    """Create the DLQ table (and its schema and indexes) if missing."""
    execute_ddl(dsn, what, dlq_table_sql(schema, table))
