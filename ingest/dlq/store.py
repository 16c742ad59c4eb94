"""Reading and resolving the PostgreSQL DLQ table: the :class:`~ingest.dlq.base.DlqReader` of ``dlq.kind: postgres``
(and of the table a Kafka DLQ keeps oversized records in).

Every statement names the table through :class:`psycopg.sql.Identifier`. Short-lived
connections (no pool): the commands run a few statements each.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from ingest.config.base import PgNetworkSettings
from ingest.dlq.base import DlqFilter, DlqRow
from ingest.dlq.postgres import headers_from_json
from ingest.drivers.postgres import classify, connect
from ingest.errors import ConfigError, ServiceUnreachable
from ingest.redact import scrub
from ingest.types import Failure, Record, origin_of

_OFFSET_RANGE = re.compile(r"^(?:(\d+):)?(\d+)?-(\d+)?$")
T = TypeVar("T")


def parse_offset_range(text: str) -> tuple[int | None, int | None, int | None]:
    """``'100-200'``, ``'3:100-200'``, ``'3:100-'``, ``'-200'`` → (partition, from, to)."""
    match = _OFFSET_RANGE.match(text.strip())
    if not match or (match.group(2) is None and match.group(3) is None):
        raise ConfigError(f"--offset-range {text!r}: expected [PARTITION:]FROM-TO, e.g. 3:100-200 or 100-")
    part, lo, hi = match.groups()
    return (int(part) if part else None, int(lo) if lo else None, int(hi) if hi else None)


def parse_time(text: str | None, option: str) -> datetime | None:
    """ISO 8601 timestamp (naive = UTC)."""
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected an ISO 8601 timestamp, e.g. 2026-11-30T12:00:00Z") from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


class DlqStore:
    """The DLQ table of one pipeline config (a :class:`~ingest.dlq.base.DlqReader`)."""

    can_purge = True

    def __init__(self, dsn: str, schema: str, table: str, network: PgNetworkSettings | None = None) -> None:
        self._dsn = dsn
        self._network = network or PgNetworkSettings()
        self._table = sql.Identifier(schema, table)

    def _connect(self) -> psycopg.Connection[Any]:
        return connect(self._dsn, self._network, statement_timeout_ms=0)

    def _run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """One unit of work in its own transaction; errors become ServiceUnreachable / ConfigError."""
        try:
            with self._connect() as conn:
                return fn(conn)
        except psycopg.errors.UndefinedTable:
            raise ConfigError("the DLQ table does not exist: run `ingest migrate`") from None
        except psycopg.Error as exc:
            raise ServiceUnreachable("DLQ database", str(classify(exc))) from None

    def _where(self, f: DlqFilter) -> tuple[sql.Composable, list[Any]]:
        parts = [sql.SQL("pipeline = %s"), sql.SQL("status = ANY(%s)")]
        params: list[Any] = [f.pipeline, list(f.statuses)]
        for column, op, value in (
            ("error_class", "=", f.error_class), ("stage", "=", f.stage),
            ("last_failed_at", ">=", f.since), ("last_failed_at", "<", f.until),
            ("partition", "=", f.partition), ("offset", ">=", f.offset_from), ("offset", "<=", f.offset_to),
        ):
            if value is not None:
                parts.append(sql.SQL("{} " + op + " %s").format(sql.Identifier(column)))
                params.append(value)
        return sql.SQL(" AND ").join(parts), params

    # -- reading ----------------------------------------------------------------------
    def count(self, f: DlqFilter) -> list[tuple[str, str, str, int]]:
        where, params = self._where(f)
        query = sql.SQL(
            "SELECT stage, error_class, status, count(*) FROM {t} WHERE {w} GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
        ).format(t=self._table, w=where)
        return self._run(lambda conn: [tuple(r) for r in conn.execute(query, params)])  # type: ignore[misc]

    def fetch(self, f: DlqFilter, *, limit: int, after: int | str | None = None) -> list[DlqRow]:
        """Entries matching ``f`` with ``id > after``, oldest id first."""
        where, params = self._where(f)
        query = sql.SQL("SELECT * FROM {t} WHERE {w} AND id > %s ORDER BY id LIMIT %s").format(t=self._table, w=where)

        def select(conn: psycopg.Connection[Any]) -> list[DlqRow]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(query, [*params, int(after or 0), limit])
                return [_row(r) for r in cur.fetchall()]

        return self._run(select)

    def get(self, entry_id: str) -> DlqRow | None:
        try:
            wanted = int(entry_id)
        except ValueError:
            return None
        query = sql.SQL("SELECT * FROM {t} WHERE id = %s").format(t=self._table)

        def select(conn: psycopg.Connection[Any]) -> DlqRow | None:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(query, [wanted])
                row = cur.fetchone()
                return _row(row) if row else None

        return self._run(select)

    def value_of(self, pipeline: str, record: Record) -> bytes | None:
        """The stored value of a record by its position (a Kafka DLQ's reference points here)."""
        query = sql.SQL('SELECT value FROM {t} WHERE pipeline = %s AND topic = %s AND "partition" = %s '
                        'AND "offset" = %s').format(t=self._table)
        row = self._run(lambda conn: conn.execute(
            query, (pipeline, record.topic, record.partition, record.offset)).fetchone())
        return bytes(row[0]) if row and row[0] is not None else None

    # -- resolving -------------------------------------------------------------------------
    def shares_database(self, dsn: str | None) -> bool:
        return dsn is not None and dsn == self._dsn

    def replayed_in(self, conn: psycopg.Connection[Any], ids: Sequence[int | str], *, purge: bool = False) -> None:
        if not ids:
            return
        if purge:
            conn.execute(sql.SQL("DELETE FROM {t} WHERE id = ANY(%s)").format(t=self._table), [[int(i) for i in ids]])
        else:
            conn.execute(
                sql.SQL("UPDATE {t} SET status = 'replayed', replays = replays + 1, replayed_at = now() "
                        "WHERE id = ANY(%s)").format(t=self._table),
                [[int(i) for i in ids]],
            )

    def mark_replayed(self, ids: Sequence[int | str], *, purge: bool = False) -> None:
        if ids:
            self._run(lambda conn: self.replayed_in(conn, ids, purge=purge))

    def mark_superseded(self, ids: Sequence[int | str]) -> None:
        if ids:
            query = sql.SQL("UPDATE {t} SET status = 'superseded', replayed_at = now() WHERE id = ANY(%s)").format(
                t=self._table)
            self._run(lambda conn: conn.execute(query, [[int(i) for i in ids]]))

    def mark_failed(self, failures: Sequence[tuple[int | str, Failure]], max_replays: int) -> None:
        """A replay failed again: bump attempts and replays, store the new error; give up at max_replays."""
        if not failures:
            return
        query = sql.SQL(
            "UPDATE {t} SET attempts = attempts + 1, replays = replays + 1, last_failed_at = now(), "
            "stage = %s, error_class = %s, error_message = %s, sqlstate = %s, "
            "status = CASE WHEN replays + 1 >= %s THEN 'gave_up' ELSE 'pending' END WHERE id = %s"
        ).format(t=self._table)
        params = [(f.stage, f.error_class, scrub(f.message)[:4000], f.sqlstate, max_replays, int(i))
                  for i, f in failures]

        def update(conn: psycopg.Connection[Any]) -> None:
            with conn.cursor() as cur:
                cur.executemany(query, params)

        self._run(update)

    def give_up(self, ids: Sequence[int | str]) -> None:
        if ids:
            query = sql.SQL("UPDATE {t} SET status = 'gave_up' WHERE id = ANY(%s)").format(t=self._table)
            self._run(lambda conn: conn.execute(query, [[int(i) for i in ids]]))

    def close(self) -> None:
        pass


def _row(r: dict[str, Any]) -> DlqRow:
    ts = r["record_timestamp"]
    headers = headers_from_json(r["headers"])
    record = Record(
        r["topic"], r["partition"], r["offset"],
        bytes(r["key"]) if r["key"] is not None else None,
        bytes(r["value"]) if r["value"] is not None else None,
        int(ts.timestamp() * 1000) if ts is not None else None,
        headers, origin_of(headers),
    )
    return DlqRow(
        id=r["id"], record=record,
        failure=Failure(r["stage"], r["error_class"], r["error_message"], r["sqlstate"]),
        attempts=r["attempts"], replays=r["replays"], status=r["status"],
        first_failed_at=r["first_failed_at"], last_failed_at=r["last_failed_at"],
    )
