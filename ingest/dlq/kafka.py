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

Large records. A record that fitted its source topic may not fit the DLQ
topic once the provenance headers are added. The producer compresses
(``dlq.compression``, zstd by default) and its own size check is set far above
the topic's limit, so the broker judges the *compressed* size against
``dlq.max_message_bytes`` (the DLQ topic's ``max.message.bytes``). Before
producing, a record larger than that limit is compressed once here (zlib, which
compresses no better than zstd) to tell whether it can fit at all; one that
cannot -- or that the broker still refuses as too large -- is *oversized*:

- ``dlq.oversized: stop`` (default): :class:`~ingest.errors.UnclassifiedError`,
  naming the record, its size, the limit and the fix; the pipeline stops
  without committing it (never dropped);
- ``dlq.oversized: postgres``: stored whole in the PostgreSQL DLQ table, and
  the topic gets a *reference*: no value, the provenance headers plus
  ``ingest.stored_in`` (``postgres:<schema>.<table>``), ``ingest.value_bytes``
  and ``ingest.value_sha256``.
"""

from __future__ import annotations

import hashlib
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import msgspec
from confluent_kafka import KafkaError, KafkaException, Producer

from ingest.config import DlqSettings, KafkaSettings
from ingest.dlq.base import DeadLetterQueue, DlqEntry
from ingest.errors import TransientError, UnclassifiedError
from ingest.redact import scrub

PROVENANCE_PREFIX = "ingest."
#: The producer's own (uncompressed) size check: far above any topic's limit, so the broker decides.
PRODUCER_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Per-record framing of a single-record batch, roughly (record batch header + record header).
_RECORD_OVERHEAD = 128

Headers = list[tuple[str, bytes]]


def provenance_headers(entry: DlqEntry, failed_at_ms: int) -> Headers:
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


def wire_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]) -> int:
    """Uncompressed size of one record on the wire, roughly (what a limit in bytes is compared with)."""
    size = _RECORD_OVERHEAD + len(key or b"") + len(value or b"")
    return size + sum(len(name) + len(val or b"") + 8 for name, val in headers)


def compressed_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]) -> int:
    """An upper estimate of the record's compressed size (zlib level 1; zstd and lz4 do at least as well)."""
    body = b"".join([key or b"", value or b"", *(name.encode() + (val or b"") for name, val in headers)])
    return _RECORD_OVERHEAD + len(zlib.compress(body, 1))


class KafkaDlq:
    """Publishes DLQ entries to one topic. Thread-safe (confluent-kafka producers are).

    ``oversized``: where records too large for the topic go (a PostgreSQL DLQ table), or ``None``
    to stop the pipeline on one (see the module docstring). Owns its producer and ``oversized``
    (``close`` closes both).
    """

    def __init__(self, kafka: KafkaSettings, settings: DlqSettings, *, oversized: DeadLetterQueue | None = None,
                 stored_in: str = "", timeout_s: float = 30.0) -> None:
        assert settings.topic, "a Kafka DLQ needs dlq.topic"
        self._topic = settings.topic
        self._limit = settings.max_message_bytes
        self._oversized = oversized
        self._stored_in = stored_in
        self._timeout_s = timeout_s
        self._producer = Producer({
            **kafka.client_config(), "enable.idempotence": True, "acks": "all", "linger.ms": 5,
            "compression.type": settings.compression, "message.max.bytes": PRODUCER_MAX_MESSAGE_BYTES,
        })
        self._lock = threading.Lock()

    def put(self, entries: Sequence[DlqEntry]) -> None:
        """Produce every entry and wait for all acknowledgements (see the module docstring).

        Raises TransientError on a failure worth retrying, UnclassifiedError for an oversized
        record without a place for it.
        """
        if not entries:
            return
        now_ms = int(time.time() * 1000)
        prepared = [(entry, list(entry.record.headers) + provenance_headers(entry, now_ms)) for entry in entries]
        fits, oversized = [], []
        for entry, headers in prepared:
            (oversized if self._too_large(entry, headers) else fits).append((entry, headers))
        refused = self._produce(fits)
        self._store_oversized(oversized + refused, now_ms)

    def _too_large(self, entry: DlqEntry, headers: Headers) -> bool:
        rec = entry.record
        if wire_size(rec.key, rec.value, headers) <= self._limit:
            return False
        return compressed_size(rec.key, rec.value, headers) > self._limit

    def _produce(self, batch: list[tuple[DlqEntry, Headers]]) -> list[tuple[DlqEntry, Headers]]:
        """Produce and wait; return the entries the broker refused as too large."""
        if not batch:
            return []
        errors: list[KafkaError] = []
        refused: list[int] = []

        def on_delivery(index: int) -> Any:
            def report(err: KafkaError | None, _msg: Any) -> None:
                if err is None:
                    return
                if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    refused.append(index)
                else:
                    errors.append(err)
            return report

        with self._lock:  # one flush covers exactly this call's records
            for index, (entry, headers) in enumerate(batch):
                rec = entry.record
                while True:
                    try:
                        self._producer.produce(self._topic, key=rec.key, value=rec.value, headers=headers,
                                               on_delivery=on_delivery(index))
                        break
                    except BufferError:
                        self._producer.poll(0.1)
                    except KafkaException as exc:
                        if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                            raise TransientError(f"DLQ topic {self._topic!r}: {exc.args[0].str()}",
                                                 error_class="dlq_unavailable") from None
                        refused.append(index)
                        break
            remaining = self._producer.flush(self._timeout_s)
        if remaining:
            raise TransientError(f"DLQ topic {self._topic!r}: {remaining} records not acknowledged in time",
                                 error_class="dlq_unavailable")
        if errors:
            raise TransientError(f"DLQ topic {self._topic!r}: delivery failed: {errors[0].str()}",
                                 error_class="dlq_unavailable")
        return [batch[i] for i in sorted(set(refused))]

    def _store_oversized(self, batch: list[tuple[DlqEntry, Headers]], now_ms: int) -> None:
        if not batch:
            return
        if self._oversized is None:
            entry, headers = batch[0]
            rec = entry.record
            raise UnclassifiedError(
                f"the DLQ topic {self._topic!r} cannot take record {rec.tp}@{rec.offset}: "
                f"{wire_size(rec.key, rec.value, headers)} bytes with its provenance headers "
                f"(about {compressed_size(rec.key, rec.value, headers)} compressed), over dlq.max_message_bytes "
                f"{self._limit}; raise the DLQ topic's max.message.bytes and dlq.max_message_bytes, or set "
                f"dlq.oversized: postgres to keep such records in the PostgreSQL DLQ table")
        self._oversized.put([entry for entry, _ in batch])  # durable before the reference is published
        references = []
        for entry, headers in batch:
            value = entry.record.value or b""
            references.append((entry, [*headers, ("ingest.stored_in", self._stored_in.encode()),
                                       ("ingest.value_bytes", str(len(value)).encode()),
                                       ("ingest.value_sha256", hashlib.sha256(value).hexdigest().encode())]))
        refused = self._produce([(DlqEntry(e.pipeline, msgspec.structs.replace(e.record, value=None), e.failure), h)
                                 for e, h in references])
        if refused:
            raise UnclassifiedError(f"the DLQ topic {self._topic!r} refuses even the reference to record "
                                    f"{refused[0][0].record.tp}@{refused[0][0].record.offset}: raise "
                                    "dlq.max_message_bytes to the topic's max.message.bytes")

    def close(self) -> None:
        self._producer.flush(self._timeout_s)
        if self._oversized is not None:
            self._oversized.close()

