"""Reading the head of partitions without joining a group: what lies at or after an offset.

A *probe* is a confluent-kafka consumer that only ``assign()``\\ s (never
subscribes or commits), so it never becomes a member of any group -- safe
beside a running pipeline, and no group-join quirk of a broker applies to it.
With ``enable.partition.eof`` it learns for each partition either the first
record at or after a position, or that the position is the log end: exact even
where a broker reports a high watermark below the true log end (Tansu reports
the base offset of the last batch + 1).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from ingest.config import KafkaSettings
from ingest.errors import ServiceUnreachable
from ingest.sources.kafka_config import consumer_config
from ingest.types import Partition, Record, origin_of


def probe_config(kafka: KafkaSettings, purpose: str) -> dict[str, Any]:
    """librdkafka settings of a probe (contains secrets: never log it)."""
    # group.id is mandatory for a librdkafka consumer; a probe only assign()s, never
    # subscribes or commits, so it never becomes a member of that (throwaway) group.
    return {
        **consumer_config(kafka, f"ingest-{purpose}-probe-{uuid.uuid4().hex[:12]}"),
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,
        "fetch.wait.max.ms": 100,
        # Small fetches: only the first record of each partition is wanted. (Do not
        # cap queued.min.messages: librdkafka then backs off fetching for 1 s.)
        "fetch.message.max.bytes": 65536,
        "fetch.queue.backoff.ms": 20,
    }


@dataclass(frozen=True, slots=True)
class Head:
    """What a probe found at a position: the first record there (``offset``, ``timestamp_ms``), or the
    log end (``at_end``: nothing at or after the position; ``offset`` is the end)."""

    offset: int
    at_end: bool
    timestamp_ms: int | None = None


def read_heads(probe: Any, positions: Mapping[Partition, int], timeout_s: float) -> dict[Partition, Head]:
    """The :class:`Head` of each partition at its position; partitions not answered in time are left out.

    ``probe`` is a consumer built with :func:`probe_config`; it is assigned the positions and
    unassigned again before returning.
    """
    if not positions:
        return {}
    probe.assign([TopicPartition(tp.topic, tp.partition, off) for tp, off in positions.items()])
    out: dict[Partition, Head] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(positions):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            answered: list[TopicPartition] = []
            # consume() waits for all num_messages or the timeout: keep each call short.
            for msg in probe.consume(1000, min(left, 0.05)):
                tp = Partition(msg.topic(), msg.partition())
                if tp not in positions or tp in out:
                    continue
                err = msg.error()
                if err is None:
                    ts_type, ts = msg.timestamp()
                    out[tp] = Head(msg.offset(), False, ts if ts_type != TIMESTAMP_NOT_AVAILABLE and ts >= 0 else None)
                elif err.code() == KafkaError._PARTITION_EOF:
                    out[tp] = Head(msg.offset(), True)
                else:
                    continue
                answered.append(TopicPartition(tp.topic, tp.partition))
            if answered and len(out) < len(positions):
                probe.pause(answered)  # stop fetching partitions already answered
    finally:
        probe.unassign()
    return out


def new_probe(kafka: KafkaSettings, purpose: str, logger: Any = None) -> Consumer:
    """A probe consumer; the caller closes it."""
    return Consumer(probe_config(kafka, purpose), **({"logger": logger} if logger is not None else {}))


def sample_records(kafka: KafkaSettings, topics: list[str], limit: int, timeout_s: float = 10.0) -> list[Record]:
    """Up to ``limit`` records from the start of every partition of ``topics`` (``ingest preview
    --from-topic``), read by a probe: no group joined, nothing committed. Stops at ``limit``, when
    every partition reached its log end, or after ``timeout_s``. Ordered by topic, partition,
    offset. Raises ServiceUnreachable when the topics' metadata does not come."""
    probe = new_probe(kafka, "preview")
    try:
        assigned: list[TopicPartition] = []
        for topic in topics:
            try:
                meta = probe.list_topics(topic, timeout=timeout_s).topics.get(topic)
            except KafkaException as exc:
                raise ServiceUnreachable("kafka", f"no metadata for topic {topic!r}: {exc}") from None
            if meta is None or meta.error is not None or not meta.partitions:
                raise ServiceUnreachable("kafka", f"topic {topic!r} has no partitions (does it exist?)")
            assigned += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
        probe.assign(assigned)
        records: list[Record] = []
        at_end: set[tuple[str, int]] = set()
        deadline = time.monotonic() + timeout_s
        while len(records) < limit and len(at_end) < len(assigned) and time.monotonic() < deadline:
            for msg in probe.consume(min(1000, limit - len(records)), 0.1):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        at_end.add((msg.topic(), msg.partition()))
                    continue
                _, ts = msg.timestamp()
                headers = tuple(msg.headers() or ())
                records.append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                                      ts if ts >= 0 else None, headers, origin_of(headers)))
                if len(records) >= limit:
                    break
        return sorted(records, key=lambda r: (r.topic, r.partition, r.offset))
    finally:
        probe.close()
