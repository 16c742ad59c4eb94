"""Reading and resolving a Kafka DLQ topic: the :class:`~ingest.dlq.base.DlqReader` of ``dlq.kind: kafka``.

A topic cannot be updated, so an entry's status is kept in the topic itself, as
*markers*: small records (no key, no value) on the entry's own DLQ partition whose
headers say ``ingest.marker`` (``replayed``, ``superseded``, ``gave_up`` or
``failed`` with the new error) and ``ingest.marker_of`` (the entry's id). An
entry's status is its last marker's (``pending`` without one); a ``failed``
marker counts an attempt and a replay. Reading replays the log: the topic is
read whole, from its start to its end (partition EOF, which is exact whatever
high watermark a broker reports), by a consumer that never joins a group.

- Entry ids are ``"<partition>:<offset>"`` of the entry in the DLQ topic.
- The same record dead-lettered twice (at-least-once, a crash before the commit)
  is one entry: the first copy; copies count as attempts.
- A *reference* (an oversized record kept in the PostgreSQL DLQ table, header
  ``ingest.stored_in``) is read with its value from that table.
- ``--purge`` cannot delete from a topic: ``can_purge`` is False; the topic's
  retention removes replayed entries.
- Markers are produced with an idempotent producer and flushed: each marking
  call is durable on return.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import msgspec
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)

from ingest.config import DlqSettings, KafkaSettings
from ingest.dlq.base import DlqFilter, DlqRow
from ingest.dlq.postgres import REPLAYS_HEADER, replays_of
from ingest.dlq.store import DlqStore
from ingest.errors import ServiceUnreachable, TransientError
from ingest.redact import scrub
from ingest.types import Failure, Record, origin_of

MARKER = "ingest.marker"
MARKER_OF = "ingest.marker_of"
_EPOCH = datetime.fromtimestamp(0, tz=timezone.utc)


def _headers(msg: Any) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in (msg.headers() or [])}


def _time(ms: str | None) -> datetime:
    try:
        return datetime.fromtimestamp(int(ms or "") / 1000, tz=timezone.utc)
    except ValueError:
        return _EPOCH


class KafkaDlqReader:
    """The DLQ topic of one pipeline; see the module docstring."""

    can_purge = False

    def __init__(self, kafka: KafkaSettings, dlq: DlqSettings, pipeline: str, *, table: DlqStore | None = None,
                 timeout_s: float = 30.0) -> None:
        assert dlq.topic, "a Kafka DLQ has a topic (validated)"
        self._kafka = kafka
        self._topic = dlq.topic
        self._pipeline = pipeline
        self._table = table
        self._timeout_s = timeout_s
        self._producer: Producer | None = None

    # -- reading the log ------------------------------------------------------------------
    def _read_log(self) -> list[Any]:
        """Every message of the DLQ topic, in (partition, offset) order."""
        from ingest.sources.kafka_probe import probe_config

        consumer = Consumer(probe_config(self._kafka, "dlq"))
        try:
            try:
                meta = consumer.list_topics(self._topic, timeout=self._timeout_s).topics.get(self._topic)
            except KafkaException as exc:
                raise ServiceUnreachable(f"kafka {self._kafka.bootstrap_servers}", exc.args[0].str()) from None
            if meta is None or meta.error is not None or not meta.partitions:
                return []  # no DLQ topic yet: nothing was dead-lettered
            consumer.assign([TopicPartition(self._topic, p, -2) for p in meta.partitions])  # -2: the beginning
            pending = set(meta.partitions)
            out: list[Any] = []
            deadline = time.monotonic() + self._timeout_s
            while pending:
                if time.monotonic() > deadline:
                    raise ServiceUnreachable(f"kafka {self._kafka.bootstrap_servers}",
                                             f"DLQ topic {self._topic!r} not read to its end in {self._timeout_s} s")
                for msg in consumer.consume(1000, 0.2):
                    err = msg.error()
                    if err is None:
                        out.append(msg)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
            return sorted(out, key=lambda m: (m.partition(), m.offset()))
        finally:
            consumer.close()

    def _entries(self) -> list[DlqRow]:
        """The pipeline's entries with their status, in id order (markers applied)."""
        entries: dict[str, DlqRow] = {}
        by_record: dict[tuple[str, str, str], str] = {}
        for msg in self._read_log():
            h = _headers(msg)
            if h.get("ingest.pipeline") != self._pipeline:
                continue
            if MARKER in h:
                self._apply_marker(entries.get(h.get(MARKER_OF, "")), h)
                continue
            provenance = (h.get("ingest.topic", ""), h.get("ingest.partition", ""), h.get("ingest.offset", ""))
            if provenance in by_record:  # dead-lettered again (at-least-once): one entry
                entries[by_record[provenance]].attempts += 1
                continue
            row = self._row(msg, h)
            by_record[provenance] = str(row.id)
            entries[str(row.id)] = row
        return list(entries.values())

    @staticmethod
    def _apply_marker(row: DlqRow | None, h: dict[str, str]) -> None:
        if row is None:
            return
        kind = h[MARKER]
        at = _time(h.get("ingest.failed_at"))
        if kind == "failed":
            row.attempts += 1
            row.replays += 1
            row.failure = Failure(h.get("ingest.stage", ""), h.get("ingest.error_class", ""),
                                  h.get("ingest.error_message", ""), h.get("ingest.sqlstate") or None)
            row.last_failed_at = at
            row.status = "gave_up" if h.get("ingest.gave_up") == "1" else "pending"
        elif kind == "replayed":
            row.replays += 1
            row.status = "replayed"
        elif kind in ("superseded", "gave_up"):
            row.status = kind

    def _row(self, msg: Any, h: dict[str, str]) -> DlqRow:
        original = [(k, v) for k, v in (msg.headers() or []) if not k.startswith("ingest.") or k == REPLAYS_HEADER
                    or k == "ingest.replay_of"]
        headers = tuple(original)
        ts = h.get("ingest.timestamp")
        record = Record(h.get("ingest.topic", ""), int(h.get("ingest.partition") or -1), int(h.get("ingest.offset") or -1),
                        msg.key(), msg.value(), int(ts) if ts else None, headers, origin_of(headers))
        if "ingest.stored_in" in h and self._table is not None:
            record = msgspec.structs.replace(record, value=self._table.value_of(self._pipeline, record))
        failed_at = _time(h.get("ingest.failed_at"))
        return DlqRow(id=f"{msg.partition()}:{msg.offset()}", record=record,
                      failure=Failure(h.get("ingest.stage", ""), h.get("ingest.error_class", ""),
                                      h.get("ingest.error_message", ""), h.get("ingest.sqlstate") or None),
                      attempts=1, replays=replays_of(headers), status="pending",
                      first_failed_at=failed_at, last_failed_at=failed_at)

    # -- the DlqReader protocol ---------------------------------------------------------------
    def count(self, flt: DlqFilter) -> list[tuple[str, str, str, int]]:
        counts: dict[tuple[str, str, str], int] = {}
        for row in self._entries():
            if flt.matches(row):
                k = (row.failure.stage, row.failure.error_class, row.status)
                counts[k] = counts.get(k, 0) + 1
        return [(*k, n) for k, n in sorted(counts.items())]

    def fetch(self, flt: DlqFilter, *, limit: int, after: int | str | None = None) -> list[DlqRow]:
        rows = [r for r in self._entries() if flt.matches(r)]
        if after is not None:
            rows = [r for r in rows if _order(r.id) > _order(after)]
        return rows[:limit]

    def get(self, entry_id: str) -> DlqRow | None:
        return next((r for r in self._entries() if r.id == entry_id), None)

    def mark_replayed(self, ids: Sequence[int | str], *, purge: bool = False) -> None:
        self._mark("replayed", ids)

    def mark_superseded(self, ids: Sequence[int | str]) -> None:
        self._mark("superseded", ids)

    def give_up(self, ids: Sequence[int | str]) -> None:
        self._mark("gave_up", ids)

    def mark_failed(self, failures: Sequence[tuple[int | str, Failure]], max_replays: int) -> None:
        rows = {r.id: r for r in self._entries()} if failures else {}
        for entry_id, f in failures:
            gave_up = rows[entry_id].replays + 1 >= max_replays if entry_id in rows else False
            self._mark("failed", [entry_id], {
                "ingest.stage": f.stage, "ingest.error_class": f.error_class,
                "ingest.error_message": scrub(f.message)[:4000], "ingest.sqlstate": f.sqlstate or "",
                "ingest.gave_up": "1" if gave_up else "0"})

    def replayed_in(self, conn: Any, ids: Sequence[int | str], *, purge: bool = False) -> None:
        raise NotImplementedError("a Kafka DLQ shares no database with a sink")

    def shares_database(self, dsn: str | None) -> bool:
        return False

    def _mark(self, kind: str, ids: Sequence[int | str], extra: dict[str, str] | None = None) -> None:
        if not ids:
            return
        if self._producer is None:
            self._producer = Producer({**self._kafka.client_config(), "enable.idempotence": True, "acks": "all",
                                       "client.id": f"ingest-dlq-marker-{uuid.uuid4().hex[:8]}"})
        errors: list[Any] = []
        now_ms = str(int(time.time() * 1000))
        for entry_id in ids:
            partition = int(str(entry_id).split(":", 1)[0])
            headers = {"ingest.pipeline": self._pipeline, MARKER: kind, MARKER_OF: str(entry_id),
                       "ingest.failed_at": now_ms, **(extra or {})}
            self._producer.produce(self._topic, value=None, partition=partition,
                                   headers=[(k, v.encode()) for k, v in headers.items()],
                                   on_delivery=lambda err, _m: errors.append(err) if err else None)
        if self._producer.flush(self._timeout_s) or errors:
            raise TransientError(f"DLQ topic {self._topic!r}: marking entries failed: "
                                 f"{errors[0].str() if errors else 'not acknowledged in time'}",
                                 error_class="dlq_unavailable")

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(self._timeout_s)
            self._producer = None


def _order(entry_id: int | str) -> tuple[int, int]:
    partition, _, offset = str(entry_id).partition(":")
    return int(partition), int(offset or 0)
