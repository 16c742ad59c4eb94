"""Kafka DLQ backend: poison records republished to a dead-letter topic.

What a consumer of the DLQ topic sees:

- the record's **key and value bytes unchanged**, and its original headers;
- provenance in extra headers, all UTF-8 text: ``ingest.pipeline``,
  ``ingest.topic``, ``ingest.partition``, ``ingest.offset``,
  ``ingest.timestamp`` (ms, may be absent), ``ingest.stage``,
  ``ingest.error_class``, ``ingest.error_message``, ``ingest.sqlstate`` (when
  known), ``ingest.failed_at`` (ms);
- **at least once**: the producer is idempotent (no duplicates from producer
  retries), and ``put`` returns only when the broker acknowledged every record
  (``acks=all``), so the offset of a dead-lettered record counts as done only
  after that. A crash between the DLQ write and the offset commit dead-letters
  the record again: the DLQ topic then holds two copies with the same
  (``ingest.topic``, ``ingest.partition``, ``ingest.offset``); consumers of the
  DLQ topic deduplicate on that triple. (The PostgreSQL backend dedupes itself.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError, Producer

from ingest.config import KafkaSettings
from ingest.dlq.base import DlqEntry
from ingest.errors import TransientError
from ingest.redact import scrub

PROVENANCE_PREFIX = "ingest."


def provenance_headers(entry: DlqEntry, failed_at_ms: int) -> list[tuple[str, bytes]]:
    rec, failure = entry.record, entry.failure
    headers = [
        ("ingest.pipeline", entry.pipeline),
        ("ingest.topic", rec.topic),
        ("ingest.partition", str(rec.partition)),
        ("ingest.offset", str(rec.offset)),
        ("ingest.stage", failure.stage),
        ("ingest.error_class", failure.error_class),
        ("ingest.error_message", scrub(failure.message)[:4000]),
        ("ingest.failed_at", str(failed_at_ms)),
    ]
    if rec.timestamp_ms is not None:
        headers.append(("ingest.timestamp", str(rec.timestamp_ms)))
    if failure.sqlstate:
        headers.append(("ingest.sqlstate", failure.sqlstate))
    return [(k, v.encode("utf-8", "replace")) for k, v in headers]


class KafkaDlq:
    """Publishes DLQ entries to one topic. Thread-safe (confluent-kafka producers are)."""

    def __init__(self, kafka: KafkaSettings, topic: str, *, timeout_s: float = 30.0) -> None:
        self._topic = topic
        self._timeout_s = timeout_s
        self._producer = Producer(
            {**kafka.client_config(), "enable.idempotence": True, "acks": "all", "linger.ms": 5}
        )
        self._lock = threading.Lock()

    def put(self, entries: Sequence[DlqEntry]) -> None:
        """Produce every entry and wait for all acknowledgements; raise TransientError on any failure."""
        if not entries:
            return
        errors: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        now_ms = int(time.time() * 1000)
        with self._lock:  # one flush covers exactly this call's records
            for entry in entries:
                rec = entry.record
                headers = list(rec.headers) + provenance_headers(entry, now_ms)
                while True:
                    try:
                        self._producer.produce(
                            self._topic, key=rec.key, value=rec.value, headers=headers, on_delivery=on_delivery
                        )
                        break
                    except BufferError:
                        self._producer.poll(0.1)
            remaining = self._producer.flush(self._timeout_s)
        if remaining:
            raise TransientError(f"DLQ topic {self._topic!r}: {remaining} records not acknowledged in time",
                                 error_class="dlq_unavailable")
        if errors:
            raise TransientError(f"DLQ topic {self._topic!r}: delivery failed: {errors[0].str()}",
                                 error_class="dlq_unavailable")

    def close(self) -> None:
        self._producer.flush(self._timeout_s)
