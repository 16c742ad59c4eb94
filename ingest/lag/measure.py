"""Measuring lag against the broker: committed offsets without joining the group, watermarks, and the
timestamp of the oldest unconsumed record read by a probe that never joins any group."""


from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ingest.config import KafkaSettings, PipelineSettings
from ingest.errors import IngestError, ServiceUnreachable

log = logging.getLogger(__name__)



from ingest.lag.model import (
    DEFAULT_TIMEOUT_S,
    LagReport,
    PartitionKey,
    PartitionLag,
    PipelineLag,
    age_seconds,
    consume_position,
    records_behind,
    summarize,
)


# --------------------------------------------------------------------------- measuring
class _ConsumerLike(Protocol):  # the parts of confluent_kafka.Consumer used here
    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any: ...
    def get_watermark_offsets(self, partition: Any, timeout: float = -1, cached: bool = False) -> tuple[int, int]: ...
    def committed(self, partitions: list[Any], timeout: float = -1) -> list[Any]: ...


class _ProbeLike(Protocol):
    def assign(self, partitions: list[Any]) -> None: ...
    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]: ...
    def pause(self, partitions: list[Any]) -> None: ...
    def unassign(self) -> None: ...


_UNREACHABLE_CODES = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_RESOLVE", "_AUTHENTICATION",
                                "_SSL", "_WAIT_COORD", "COORDINATOR_NOT_AVAILABLE"})


def _kafka_error_text(exc: BaseException) -> tuple[str, str]:
    """``(code name, message)`` of a KafkaException, without anything from the client config."""
    err = exc.args[0] if exc.args else exc
    name = err.name() if hasattr(err, "name") else type(exc).__name__
    msg = err.str() if hasattr(err, "str") else str(err)
    return name, msg


def measure_partitions(
    consumer: _ConsumerLike,
    probe: _ProbeLike | None,
    topics: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    clock: Any = time.time,
    stored: Mapping[PartitionKey, int] | None = None,
) -> tuple[list[PartitionLag], list[str]]:
    """Measure every partition of ``topics`` for the group ``consumer`` was created with.

    ``consumer`` must carry the group's ``group.id`` and must never subscribe;
    ``probe`` (a consumer that joins no group) reads the oldest unconsumed record
    of each lagging partition for its timestamp; ``None`` skips the time lag.

    ``stored``: offsets kept in the sink database (exactly-once delivery); when
    given, they are the committed positions and Kafka's commits are ignored.

    Returns ``(rows, errors)``; a topic missing on the broker is an error, not
    a row. Raises ``KafkaException`` when the broker does not answer.
    """
    errors: list[str] = []
    parts = _partitions(consumer, topics, timeout_s, errors)
    if not parts:
        return [], errors
    committed = ({key: stored.get(key) for key in parts} if stored is not None
                 else _committed(consumer, parts, timeout_s, errors))
    measured = _watermarks(consumer, [key for key in parts if key in committed], committed, timeout_s, errors)

    behind = {key: consume_position(c, low) for key, c, low, high in measured if records_behind(c, low, high) > 0}
    stamps = oldest_timestamps(probe, behind, timeout_s=timeout_s) if probe is not None and behind else {}
    now_ms = int(clock() * 1000)
    rows = []
    for key, c, low, high in measured:
        ts = stamps.get(key)
        rows.append(PartitionLag(key[0], key[1], c, low, high, records_behind(c, low, high),
                                 oldest_ts_ms=ts, lag_s=age_seconds(ts, now_ms)))
    return rows, errors

def _partitions(consumer: _ConsumerLike, topics: Sequence[str], timeout_s: float,
                errors: list[str]) -> list[PartitionKey]:
    """Every partition of ``topics`` in the broker's metadata; a missing topic is appended to ``errors``."""
    parts: list[PartitionKey] = []
    for topic in dict.fromkeys(topics):
        md = consumer.list_topics(topic, timeout=timeout_s)  # raises when the broker does not answer
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None:
            errors.append(f"topic {topic}: {tmd.error.str() if tmd is not None else 'absent from metadata'}")
            continue
        parts.extend((topic, p) for p in sorted(tmd.partitions))
    return parts


def _committed(consumer: _ConsumerLike, parts: Sequence[PartitionKey], timeout_s: float,
               errors: list[str]) -> dict[PartitionKey, int | None]:
    """The group's committed offset per partition (None: nothing committed); a per-partition error is skipped."""
    from confluent_kafka import OFFSET_INVALID, TopicPartition

    committed: dict[PartitionKey, int | None] = {}
    for tp in consumer.committed([TopicPartition(t, p) for t, p in parts], timeout=timeout_s):
        if tp.error is not None:
            errors.append(f"{tp.topic}[{tp.partition}]: committed offset: {tp.error.str()}")
            continue
        committed[(tp.topic, tp.partition)] = tp.offset if tp.offset != OFFSET_INVALID and tp.offset >= 0 else None
    return committed


def _watermarks(consumer: _ConsumerLike, parts: Sequence[PartitionKey], committed: Mapping[PartitionKey, int | None],
                timeout_s: float, errors: list[str]) -> list[tuple[PartitionKey, int | None, int, int]]:
    """``(partition, committed, low, high)`` per partition; an unreachable broker raises, other errors are kept."""
    from confluent_kafka import KafkaException, TopicPartition

    measured: list[tuple[PartitionKey, int | None, int, int]] = []
    for key in parts:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(*key), timeout=timeout_s, cached=False)
        except KafkaException as exc:
            code, msg = _kafka_error_text(exc)
            if code in _UNREACHABLE_CODES:
                raise
            errors.append(f"{key[0]}[{key[1]}]: watermarks: {msg}")
            continue
        measured.append((key, committed[key], low, high))
    return measured



def oldest_timestamps(probe: _ProbeLike, positions: Mapping[PartitionKey, int], *,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[PartitionKey, int | None]:
    """Timestamp (ms) of the first record at or after each position; missing keys were not read in time.

    ``None`` for a record without a timestamp. ``probe`` is assigned (never
    subscribed) and unassigned again before returning.
    """
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, TopicPartition

    if not positions:
        return {}
    probe.assign([TopicPartition(t, p, off) for (t, p), off in positions.items()])
    out: dict[PartitionKey, int | None] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(positions):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(positions) - set(out))
                log.debug("no record read in time for the time lag of %s", missing)
                break
            # consume() waits for all num_messages or the timeout: keep each call short.
            done: list[Any] = []
            for msg in probe.consume(1000, min(left, 0.05)):
                if msg.error() is not None:
                    continue
                key = (msg.topic(), msg.partition())
                if key in positions and key not in out:
                    ts_type, ts = msg.timestamp()
                    out[key] = ts if ts_type != TIMESTAMP_NOT_AVAILABLE and ts >= 0 else None
                    done.append(TopicPartition(*key))
            if done and len(out) < len(positions):
                probe.pause(done)  # stop fetching partitions already answered
    finally:
        probe.unassign()
    return out


class _QuietLog:
    """librdkafka's own log lines (connection refused, retries ...) at debug level only:
    the command reports broker failures itself, once, in its error message."""

    def log(self, level: int, msg: str, *args: Any) -> None:
        log.debug(msg, *args)


def _group_config(kafka: KafkaSettings, group_id: str) -> dict[str, Any]:
    from ingest.sources.kafka_config import consumer_config

    return consumer_config(kafka, group_id)


def _probe_config(kafka: KafkaSettings) -> dict[str, Any]:
    from ingest.sources.kafka_probe import probe_config

    return probe_config(kafka, "lag")


def collect_lag(
    kafka: KafkaSettings,
    pipelines: Sequence[PipelineSettings],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    time_lag: bool = True,
) -> LagReport:
    """Measure the lag of ``pipelines`` with short-lived clients (closed before returning).

    Raises :class:`ServiceUnreachable` (naming the bootstrap servers, never
    credentials) when the broker does not answer.
    """
    from confluent_kafka import Consumer, KafkaException

    quiet = _QuietLog()
    service = f"kafka {kafka.bootstrap_servers}"
    results: list[PipelineLag] = []
    probe = None
    try:
        if time_lag:
            probe = Consumer(_probe_config(kafka), logger=quiet)
        for p in pipelines:
            group_id = p.effective_group_id
            consumer = Consumer(_group_config(kafka, group_id), logger=quiet)
            try:
                stored = _stored_offsets(p)
                topics = list(p.topics)
                if p.topic_selector.has_patterns:  # the topics the patterns match today
                    topics = p.topic_selector.select(consumer.list_topics(timeout=timeout_s).topics)
                rows, errors = measure_partitions(consumer, probe, topics, timeout_s=timeout_s,
                                                  stored=stored)
            except KafkaException as exc:
                code, msg = _kafka_error_text(exc)
                if code in _UNREACHABLE_CODES:
                    raise ServiceUnreachable(service, msg) from None
                rows, errors = [], [msg]  # e.g. not authorised for this group: report, go on
            finally:
                consumer.close()  # never subscribed: leaves no trace in the group
            results.append(summarize(p.name, group_id, p.topics, rows, errors))
    finally:
        if probe is not None:
            probe.close()
    return LagReport(at_ms=int(time.time() * 1000), pipelines=tuple(results))


def _stored_offsets(p: PipelineSettings) -> dict[PartitionKey, int] | None:
    """Exactly-once pipelines keep their offsets in the sink database: read those (None otherwise)."""
    from ingest.sinks import registry

    store = registry.backend(p.sink.kind).offset_store(p)
    if store is None:
        return None
    try:
        return {(tp.topic, tp.partition): off for tp, off in store.load_all().items()}
    except IngestError as exc:
        raise ServiceUnreachable(f"the offsets of pipeline {p.name!r}", str(exc)) from None
    finally:
        store.close()


