"""The DLQ ports: writing poison records (:class:`DeadLetterQueue`), and reading and resolving them
(:class:`DlqReader`, for ``ingest dlq`` and ``ingest replay-dlq``).

Entry life cycle (``status``), the same for every DLQ kind:

- ``pending``    -- dead-lettered, waiting for a fix and a replay;
- ``replayed``   -- written by ``replay-dlq`` (kept for audit; ``--purge`` deletes where the kind can);
- ``superseded`` -- resolved without writing: its row already holds a newer record;
- ``gave_up``    -- failed ``max_replays`` replays; the loop guard skips it from then on.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from ingest.types import Failure, Record

STATUSES = ("pending", "replayed", "superseded", "gave_up")


@dataclass(slots=True, frozen=True)
class DlqEntry:
    """A poison record with its provenance: the original bytes, unchanged, and why it failed."""

    pipeline: str
    record: Record
    failure: Failure


class DeadLetterQueue(Protocol):
    def put(self, entries: Sequence[DlqEntry]) -> None:
        """Store ``entries`` durably; return only once they are durable.

        Idempotent per (pipeline, topic, partition, offset) where the kind can be (the PostgreSQL
        table is; a topic is at-least-once). Blocks. Raises :class:`~ingest.errors.TransientError`
        if the backend is unreachable (the caller retries and must not count the records as done),
        :class:`~ingest.errors.UnclassifiedError` for an entry it can never take.
        """
        ...

    def close(self) -> None:
        """Release resources. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class DlqFilter:
    """Which DLQ entries a command looks at. Every field narrows the selection."""

    pipeline: str
    error_class: str | None = None
    stage: str | None = None
    since: datetime | None = None  # on last_failed_at, inclusive
    until: datetime | None = None  # on last_failed_at, exclusive
    partition: int | None = None  # of the original record
    offset_from: int | None = None  # inclusive
    offset_to: int | None = None  # inclusive
    statuses: tuple[str, ...] = ("pending",)

    def matches(self, row: DlqRow) -> bool:
        """Whether ``row`` is selected (the same rule the PostgreSQL reader puts in SQL)."""
        rec, f = row.record, row.failure
        return (row.status in self.statuses
                and (self.error_class is None or f.error_class == self.error_class)
                and (self.stage is None or f.stage == self.stage)
                and (self.since is None or row.last_failed_at >= self.since)
                and (self.until is None or row.last_failed_at < self.until)
                and (self.partition is None or rec.partition == self.partition)
                and (self.offset_from is None or rec.offset >= self.offset_from)
                and (self.offset_to is None or rec.offset <= self.offset_to))


@dataclass(slots=True)
class DlqRow:
    """One DLQ entry as read back. ``id`` orders entries and is what ``dlq show`` and replay take:
    an integer for the PostgreSQL table, ``"<partition>:<offset>"`` of the DLQ topic for Kafka."""

    id: int | str
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
        return "base64:" + base64.b64encode(raw).decode()


class DlqReader(Protocol):
    """A pipeline's dead-lettered entries, read and resolved. Each marking call is durable on return.

    Raise :class:`~ingest.errors.ServiceUnreachable` when the DLQ cannot be reached,
    :class:`~ingest.errors.ConfigError` when it was never created (``ingest migrate``).
    """

    #: ``--purge`` deletes replayed entries (a topic cannot delete: the Kafka reader says False)
    can_purge: bool

    def count(self, flt: DlqFilter) -> list[tuple[str, str, str, int]]:
        """``(stage, error_class, status, count)`` of the selected entries, sorted."""
        ...

    def fetch(self, flt: DlqFilter, *, limit: int, after: int | str | None = None) -> list[DlqRow]:
        """Selected entries in id order, after ``after`` (an id from an earlier page)."""
        ...

    def get(self, entry_id: str) -> DlqRow | None:
        """One entry by id (any status), or None."""
        ...

    def mark_replayed(self, ids: Sequence[int | str], *, purge: bool = False) -> None: ...

    def mark_superseded(self, ids: Sequence[int | str]) -> None: ...

    def mark_failed(self, failures: Sequence[tuple[int | str, Failure]], max_replays: int) -> None:
        """A replay failed again: count it, keep the newest error; give up at ``max_replays``."""
        ...

    def give_up(self, ids: Sequence[int | str]) -> None: ...

    def replayed_in(self, conn: Any, ids: Sequence[int | str], *, purge: bool = False) -> None:
        """:meth:`mark_replayed` inside the caller's open transaction on ``conn`` -- only for a reader
        whose table lives in that database (see :meth:`shares_database`)."""
        ...

    def shares_database(self, dsn: str | None) -> bool:
        """The entries live in the PostgreSQL database ``dsn``: marks can join a sink's transaction there."""
        ...

    def close(self) -> None: ...
