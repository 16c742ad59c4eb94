"""Reading and updating the PostgreSQL DLQ table: filters, listing, replay bookkeeping.

Entry life cycle (column ``status``):

- ``pending``  -- dead-lettered, waiting for a fix and a replay;
- ``replayed`` -- written by ``ingest replay-dlq`` (kept for audit; ``--purge`` deletes instead);
- ``gave_up``  -- failed ``max_replays`` replays; the loop guard skips it from then on.

Every statement names the table through :class:`psycopg.sql.Identifier`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from ingest.dlq.postgres import headers_from_json
from ingest.errors import ConfigError
from ingest.redact import scrub
from ingest.types import Failure, Record

_OFFSET_RANGE = re.compile(r"^(?:(\d+):)?(\d+)?-(\d+)?$")


@dataclass(frozen=True, slots=True)
class DlqFilter:
    """Which DLQ entries a command looks at. Every field narrows the selection."""

    pipeline: str
    error_class: str | None = None
    stage: str | None = None
    since: datetime | None = None  # on last_failed_at, inclusive
    until: datetime | None = None  # on last_failed_at, exclusive
    partition: int | None = None
    offset_from: int | None = None  # inclusive
    offset_to: int | None = None  # inclusive
    statuses: tuple[str, ...] = ("pending",)


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


@dataclass(slots=True)
class DlqRow:
    id: int
    record: Record
    failure: Failure
    attempts: int
    replays: int
    status: str
    first_failed_at: datetime
    last_failed_at: datetime

    def as_dict(self, *, with_value: bool = True) -> dict[str, Any]:
        rec = self.record
        out: dict[str, Any] = {
            "id": self.id, "topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
            "timestamp_ms": rec.timestamp_ms, "stage": self.failure.stage, "error_class": self.failure.error_class,
            "error_message": self.failure.message, "sqlstate": self.failure.sqlstate, "attempts": self.attempts,
            "replays": self.replays, "status": self.status,
            "first_failed_at": self.first_failed_at.isoformat(), "last_failed_at": self.last_failed_at.isoformat(),
        }
        if with_value:
            out["key"] = _text(rec.key)
            out["value"] = _text(rec.value)
            out["headers"] = {k: _text(v) for k, v in rec.headers}
        return out


def _text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + __import__("base64").b64encode(raw).decode()


class DlqStore:
    """The DLQ table of one pipeline config. Opens short-lived connections; not a pool."""

    def __init__(self, dsn: str, schema: str, table: str) -> None:
        self._dsn = dsn
        self._table = sql.Identifier(schema, table)

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._dsn, connect_timeout=10)

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

    def count_by_class(self, f: DlqFilter) -> list[tuple[str, str, str, int]]:
        where, params = self._where(f)
        query = sql.SQL(
            "SELECT stage, error_class, status, count(*) FROM {t} WHERE {w} GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
        ).format(t=self._table, w=where)
        with self.connect() as conn:
            return [tuple(r) for r in conn.execute(query, params)]  # type: ignore[misc]

    def fetch(self, f: DlqFilter, *, limit: int, after_id: int = 0) -> list[DlqRow]:
        """Entries matching ``f`` with ``id > after_id``, oldest id first."""
        where, params = self._where(f)
        query = sql.SQL("SELECT * FROM {t} WHERE {w} AND id > %s ORDER BY id LIMIT %s").format(t=self._table, w=where)
        with self.connect() as conn, conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, [*params, after_id, limit])
            return [_row(r) for r in cur.fetchall()]

    def get(self, entry_id: int) -> DlqRow | None:
        query = sql.SQL("SELECT * FROM {t} WHERE id = %s").format(t=self._table)
        with self.connect() as conn, conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, [entry_id])
            row = cur.fetchone()
            return _row(row) if row else None

    # -- replay bookkeeping (each takes an open connection: callers choose the transaction) --
    def mark_replayed(self, conn: psycopg.Connection[Any], ids: Sequence[int], *, purge: bool) -> None:
        if not ids:
            return
        if purge:
            conn.execute(sql.SQL("DELETE FROM {t} WHERE id = ANY(%s)").format(t=self._table), [list(ids)])
        else:
            conn.execute(
                sql.SQL("UPDATE {t} SET status = 'replayed', replays = replays + 1, replayed_at = now() "
                        "WHERE id = ANY(%s)").format(t=self._table),
                [list(ids)],
            )

    def mark_failed(self, conn: psycopg.Connection[Any], failures: Sequence[tuple[int, Failure]], max_replays: int) -> None:
        """A replay failed again: bump attempts and replays, store the new error; give up at max_replays."""
        if not failures:
            return
        query = sql.SQL(
            "UPDATE {t} SET attempts = attempts + 1, replays = replays + 1, last_failed_at = now(), "
            "stage = %s, error_class = %s, error_message = %s, sqlstate = %s, "
            "status = CASE WHEN replays + 1 >= %s THEN 'gave_up' ELSE 'pending' END WHERE id = %s"
        ).format(t=self._table)
        with conn.cursor() as cur:
            cur.executemany(
                query,
                [(f.stage, f.error_class, scrub(f.message)[:4000], f.sqlstate, max_replays, i) for i, f in failures],
            )

    def give_up(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> None:
        if ids:
            conn.execute(sql.SQL("UPDATE {t} SET status = 'gave_up' WHERE id = ANY(%s)").format(t=self._table),
                         [list(ids)])


def _row(r: dict[str, Any]) -> DlqRow:
    ts = r["record_timestamp"]
    record = Record(
        r["topic"], r["partition"], r["offset"],
        bytes(r["key"]) if r["key"] is not None else None,
        bytes(r["value"]) if r["value"] is not None else None,
        int(ts.timestamp() * 1000) if ts is not None else None,
        headers_from_json(r["headers"]),
    )
    return DlqRow(
        id=r["id"], record=record,
        failure=Failure(r["stage"], r["error_class"], r["error_message"], r["sqlstate"]),
        attempts=r["attempts"], replays=r["replays"], status=r["status"],
        first_failed_at=r["first_failed_at"], last_failed_at=r["last_failed_at"],
    )
