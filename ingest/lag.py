"""Consumer lag of each pipeline's consumer group, per partition, in records and in time.

For every partition of a pipeline's topics (from broker metadata):

- ``committed``: the group's committed offset (the next offset to read), read
  with a consumer that carries the group's ``group.id`` and calls
  ``committed()`` but never subscribes, so it does not join, rebalance or
  otherwise disturb the running group;
- ``low`` / ``end``: the low and high watermarks (``get_watermark_offsets(cached=False)``);
- ``lag`` (records) = ``max(0, end - position)`` where ``position`` is the
  committed offset, or the low watermark when the group has no commit for the
  partition (the pipeline starts from ``earliest``) or its commit fell below
  the low watermark (retention deleted those records). Clamped at 0 because
  some brokers (Tansu: base offset of the last batch + 1) report a high
  watermark below the true log end;
- ``lag_s`` (time) = now − timestamp of the oldest unconsumed record, i.e. the
  record at ``position``, read with a separate consumer that never joins any
  group (``assign`` + ``consume``). ``None`` when the lag is 0, when the broker
  gives no timestamp, or when the record could not be read within the timeout.

Hot partitions. A partition is flagged *hot* when it dominates its pipeline's
backlog: its lag is more than :data:`HOT_SHARE` (half) of the pipeline's total
lag, the pipeline's total lag is at least :data:`HOT_MIN_LAG` records (a tiny
backlog is noise), and the pipeline has at least two partitions (a lone
partition trivially holds all the lag). At most one partition per pipeline can
be hot. A hot partition usually means a skewed key or a stuck lane.

Every call opens its own short-lived clients and closes them. Nothing here
prints or logs client configuration (it may hold credentials); errors name the
bootstrap servers and librdkafka's message only.

:func:`summarize`, :func:`records_behind`, :func:`is_hot` and the renderers
are pure; :func:`measure_partitions` needs only duck-typed consumer handles;
:func:`collect_lag` builds the real clients.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Protocol

from ingest.config import KafkaSettings, PipelineSettings
from ingest.errors import IngestError, ServiceUnreachable

log = logging.getLogger(__name__)

#: A partition is hot when it holds more than this share of its pipeline's lag ...
HOT_SHARE = 0.5
#: ... and the pipeline's lag is at least this many records.
HOT_MIN_LAG = 100

#: Default per-request timeout against the broker.
DEFAULT_TIMEOUT_S = 10.0

PartitionKey = tuple[str, int]


# --------------------------------------------------------------------------- values
@dataclass(frozen=True, slots=True)
class PartitionLag:
    """Lag of one partition for one consumer group."""

    topic: str
    partition: int
    #: The group's committed offset (next offset to read); ``None``: no commit.
    committed: int | None
    low: int
    #: High watermark as the broker reports it.
    end: int
    #: Records behind: ``max(0, end - position)``.
    lag: int
    #: Timestamp (ms since the epoch) of the oldest unconsumed record, when known.
    oldest_ts_ms: int | None = None
    #: Age of the oldest unconsumed record in seconds, when known.
    lag_s: float | None = None
    hot: bool = False

    @property
    def key(self) -> PartitionKey:
        return (self.topic, self.partition)

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "committed": self.committed,
            "low": self.low,
            "end": self.end,
            "lag": self.lag,
            "oldest_ts_ms": self.oldest_ts_ms,
            "lag_s": None if self.lag_s is None else round(self.lag_s, 3),
            "hot": self.hot,
        }


@dataclass(frozen=True, slots=True)
class PipelineLag:
    """One pipeline's partitions (sorted by topic, partition) and their totals."""

    pipeline: str
    group_id: str
    topics: tuple[str, ...]
    partitions: tuple[PartitionLag, ...]
    #: Sum of the partitions' lag in records.
    lag: int
    #: Age of the oldest unconsumed record over all partitions (seconds), when known.
    max_lag_s: float | None
    #: Partitions the group has no committed offset for.
    uncommitted: int
    #: Partitions that could not be measured (e.g. a topic missing on the broker).
    errors: tuple[str, ...] = ()

    @property
    def hot(self) -> tuple[PartitionLag, ...]:
        return tuple(p for p in self.partitions if p.hot)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "group_id": self.group_id,
            "topics": list(self.topics),
            "partitions": [p.as_dict() for p in self.partitions],
            "totals": {
                "partitions": len(self.partitions),
                "lag": self.lag,
                "end": sum(p.end for p in self.partitions),
                "max_lag_s": None if self.max_lag_s is None else round(self.max_lag_s, 3),
                "uncommitted_partitions": self.uncommitted,
                "hot_partitions": [
                    {"topic": p.topic, "partition": p.partition, "lag": p.lag,
                     "share": round(p.lag / self.lag, 4) if self.lag else 0.0}
                    for p in self.hot
                ],
            },
            "errors": list(self.errors),
        }


@dataclass(frozen=True, slots=True)
class LagReport:
    """Everything one ``ingest lag`` pass measured."""

    at_ms: int
    pipelines: tuple[PipelineLag, ...] = field(default_factory=tuple)

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.pipelines)

    @property
    def errors(self) -> list[str]:
        return [f"pipeline {p.pipeline}: {e}" for p in self.pipelines for e in p.errors]

    def as_dict(self) -> dict[str, Any]:
        ages = [p.max_lag_s for p in self.pipelines if p.max_lag_s is not None]
        return {
            "at": _iso(self.at_ms),
            "pipelines": {p.pipeline: p.as_dict() for p in self.pipelines},
            "totals": {
                "pipelines": len(self.pipelines),
                "partitions": sum(len(p.partitions) for p in self.pipelines),
                "lag": self.lag,
                "max_lag_s": round(max(ages), 3) if ages else None,
                "hot_partitions": sum(len(p.hot) for p in self.pipelines),
                "errors": len(self.errors),
            },
        }


# --------------------------------------------------------------------------- pure rules
def consume_position(committed: int | None, low: int) -> int:
    """Where the group resumes: its commit, or the low watermark without one (or below it)."""
    return low if committed is None else max(committed, low)


def records_behind(committed: int | None, low: int, end: int) -> int:
    """Lag in records, clamped at 0 (a broker may report a high watermark below the log end)."""
    return max(0, end - consume_position(committed, low))


def age_seconds(ts_ms: int | None, now_ms: int) -> float | None:
    """Seconds since ``ts_ms``, never negative (clock skew between producer and us)."""
    if ts_ms is None:
        return None
    return max(0.0, (now_ms - ts_ms) / 1000.0)


def is_hot(lag: int, total: int, partitions: int, *, share: float = HOT_SHARE, min_lag: int = HOT_MIN_LAG) -> bool:
    """The hot-partition rule (see the module docstring)."""
    return partitions >= 2 and total >= min_lag and total > 0 and lag > share * total


def summarize(
    pipeline: str,
    group_id: str,
    topics: Iterable[str],
    rows: Iterable[PartitionLag],
    errors: Iterable[str] = (),
    *,
    hot_share: float = HOT_SHARE,
    hot_min_lag: int = HOT_MIN_LAG,
) -> PipelineLag:
    """Sort the rows, flag hot partitions and compute the pipeline's totals."""
    ordered = sorted(rows, key=lambda r: r.key)
    total = sum(r.lag for r in ordered)
    n = len(ordered)
    flagged = tuple(
        replace(r, hot=is_hot(r.lag, total, n, share=hot_share, min_lag=hot_min_lag)) for r in ordered
    )
    ages = [r.lag_s for r in flagged if r.lag_s is not None]
    return PipelineLag(
        pipeline=pipeline,
        group_id=group_id,
        topics=tuple(topics),
        partitions=flagged,
        lag=total,
        max_lag_s=max(ages) if ages else None,
        uncommitted=sum(1 for r in flagged if r.committed is None),
        errors=tuple(errors),
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
    from confluent_kafka import OFFSET_INVALID, KafkaException, TopicPartition

    errors: list[str] = []
    parts: list[PartitionKey] = []
    for topic in dict.fromkeys(topics):
        md = consumer.list_topics(topic, timeout=timeout_s)  # raises when the broker does not answer
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None:
            errors.append(f"topic {topic}: {tmd.error.str() if tmd is not None else 'absent from metadata'}")
            continue
        parts.extend((topic, p) for p in sorted(tmd.partitions))
    if not parts:
        return [], errors

    committed: dict[PartitionKey, int | None] = {}
    if stored is not None:
        committed = {key: stored.get(key) for key in parts}
    for tp in ([] if stored is not None else consumer.committed([TopicPartition(t, p) for t, p in parts],
                                                                timeout=timeout_s)):
        if tp.error is not None:
            errors.append(f"{tp.topic}[{tp.partition}]: committed offset: {tp.error.str()}")
            continue
        committed[(tp.topic, tp.partition)] = tp.offset if tp.offset != OFFSET_INVALID and tp.offset >= 0 else None

    measured: list[tuple[PartitionKey, int | None, int, int]] = []
    for key in parts:
        if key not in committed:
            continue
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(*key), timeout=timeout_s, cached=False)
        except KafkaException as exc:
            code, msg = _kafka_error_text(exc)
            if code in _UNREACHABLE_CODES:
                raise
            errors.append(f"{key[0]}[{key[1]}]: watermarks: {msg}")
            continue
        measured.append((key, committed[key], low, high))

    behind = {key: consume_position(c, low) for key, c, low, high in measured if records_behind(c, low, high) > 0}
    stamps = oldest_timestamps(probe, behind, timeout_s=timeout_s) if probe is not None and behind else {}
    now_ms = int(clock() * 1000)
    rows = []
    for key, c, low, high in measured:
        ts = stamps.get(key)
        rows.append(PartitionLag(key[0], key[1], c, low, high, records_behind(c, low, high),
                                 oldest_ts_ms=ts, lag_s=age_seconds(ts, now_ms)))
    return rows, errors


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
    from ingest.sources.kafka import consumer_config

    return consumer_config(kafka, group_id)


def _probe_config(kafka: KafkaSettings) -> dict[str, Any]:
    from ingest.sources.kafka import consumer_config

    # group.id is mandatory for a librdkafka consumer; this one only assign()s, never
    # subscribes or commits, so it never becomes a member of that (throwaway) group.
    return {
        **consumer_config(kafka, f"ingest-lag-probe-{uuid.uuid4().hex[:12]}"),
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 100,
        # Small fetches: only the first record of each partition is wanted. (Do not
        # cap queued.min.messages: librdkafka then backs off fetching for 1 s.)
        "fetch.message.max.bytes": 65536,
        "fetch.queue.backoff.ms": 20,
    }


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
                rows, errors = measure_partitions(consumer, probe, list(p.topics), timeout_s=timeout_s,
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


# --------------------------------------------------------------------------- rendering
def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


def format_age(seconds: float | None) -> str:
    """``"-"``, ``"850ms"``, ``"12.3s"``, ``"4m05s"``, ``"2h07m"``, ``"3d04h"``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def render_json(report: LagReport, *, compact: bool = False) -> bytes:
    """The report as one JSON document (one line when ``compact``)."""
    import orjson

    return orjson.dumps(report.as_dict(), option=0 if compact else orjson.OPT_INDENT_2)


def render_tables(report: LagReport) -> list[Any]:
    """rich renderables: one table per pipeline, then a grand total line."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    for pl in report.pipelines:
        title = (f"pipeline {pl.pipeline}  group {pl.group_id}  lag {pl.lag:,} records"
                 f"  oldest {format_age(pl.max_lag_s)}")
        table = Table(title=title, title_justify="left", show_footer=True)
        table.add_column("topic", footer="total", no_wrap=True)
        table.add_column("partition", justify="right")
        table.add_column("committed", justify="right")
        table.add_column("end", justify="right", footer=f"{sum(p.end for p in pl.partitions):,}")
        table.add_column("lag", justify="right", footer=f"{pl.lag:,}")
        table.add_column("oldest", justify="right", footer=format_age(pl.max_lag_s))
        table.add_column("", no_wrap=True)
        for p in pl.partitions:
            style = "bold red" if p.hot else ("yellow" if p.lag else "")
            table.add_row(
                p.topic, str(p.partition), "-" if p.committed is None else f"{p.committed:,}", f"{p.end:,}",
                Text(f"{p.lag:,}", style=style), format_age(p.lag_s),
                Text("HOT", style="bold red") if p.hot else ("no commit" if p.committed is None else ""),
            )
        out.append(table)
        for err in pl.errors:
            out.append(Text(f"error: {err}", style="red"))
    out.append(Text(f"total lag {report.lag:,} records over {len(report.pipelines)} pipeline(s) at "
                    f"{_iso(report.at_ms)}"))
    return out
