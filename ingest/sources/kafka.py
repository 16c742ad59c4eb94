"""confluent-kafka consumer adapter.

Translates librdkafka's world (Message, TopicPartition, KafkaError) into ours
(:class:`~ingest.types.Record`, :class:`~ingest.types.Partition`) and nothing
more: no batching, no commit policy. Owned by one pipeline thread; not
thread-safe (confluent-kafka consumers must be driven by one thread).

The consumer's librdkafka settings (the three safety settings it imposes, the
tunables) are :func:`ingest.sources.kafka_config.consumer_config`'s; what lies
beyond the committed offsets is read with a probe (:mod:`.kafka_probe`).

Rebalance callbacks run inside :meth:`KafkaSource.poll` on the calling thread.

A broker that stops answering (down, or its connections silent: a dropped NAT
flow) is noticed by librdkafka's own timeouts (``socket.timeout.ms`` for a
request, ``session.timeout.ms`` for the group), which give up the dead
connections and open new ones; the pipeline resumes on them when the broker is
back. librdkafka itself would wait for ever, so the source bounds the wait: once
every broker is down (``_ALL_BROKERS_DOWN``) it probes the cluster's metadata
every :data:`PROBE_INTERVAL_S`; when no probe has succeeded for
``kafka.outage_timeout_s`` (0: wait for ever), ``poll`` raises a transient error
naming the outage and the pipeline stops (exit 1), committing nothing more.
"""

from __future__ import annotations

import logging
import operator
import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from ingest.config import KafkaSettings
from ingest.core.topics import DEFAULT_EXCLUDE_TOPICS, TopicSelector
from ingest.errors import ServiceUnreachable, TransientError
from ingest.sources.base import Backlog, RebalanceListener
from ingest.sources.kafka_config import consumer_config
from ingest.sources.kafka_probe import new_probe, read_heads
from ingest.types import Partition, Record, origin_of

log = logging.getLogger(__name__)

# A message's fields, for C-level maps over a consumed chunk (``KafkaSource.poll``).
_error_of, _headers_of, _timestamp_of = Message.error, Message.headers, Message.timestamp
_topic_of, _partition_of, _offset_of = Message.topic, Message.partition, Message.offset
_key_of, _value_of = Message.key, Message.value
_stamp_of = operator.itemgetter(1)  # of Message.timestamp()'s (type, milliseconds)

#: How often a source that saw every broker down asks for metadata, to tell when they are back (s).
PROBE_INTERVAL_S = 5.0
#: How long one such probe waits (s).
PROBE_TIMEOUT_S = 2.0


class StallWatchdog:
    """Ends the process when one blocking broker call outlasts ``bound_s`` (0: never).

    Some librdkafka calls cannot be bounded from Python (a synchronous commit, ``close``) and hold
    the consumer while they wait, so the pipeline thread that made them can neither check nor give
    up. A daemon thread watches the call; past the bound it logs an error naming the call and the
    setting and calls ``os._exit(1)``. Nothing is committed by then that was not written (the stuck
    call is the commit itself, of written records only), and a database transaction in flight rolls
    back with the process: a restart re-delivers from the committed watermark.
    """

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        if not self.bound_s:
            yield
            return
        done = threading.Event()

        def guard() -> None:
            if not done.wait(self.bound_s):
                log.error("kafka: %s has waited %g s for the broker (kafka.outage_timeout_s): stopping (exit 1)",
                          what, self.bound_s)
                for handler in logging.getLogger().handlers:
                    with contextlib.suppress(Exception):
                        handler.flush()
                os._exit(1)

        threading.Thread(target=guard, name="kafka-stall-watchdog", daemon=True).start()
        try:
            yield
        finally:
            done.set()


def _tp(p: TopicPartition) -> Partition:
    return Partition(p.topic, p.partition)


class KafkaSource:
    """A subscribed consumer (the :class:`~ingest.sources.base.Source` protocol); the listener's
    callbacks run inside ``poll``."""

    def __init__(self, kafka: KafkaSettings, group_id: str, topics: list[str], listener: RebalanceListener, *,
                 exclude_topics: Sequence[str] = DEFAULT_EXCLUDE_TOPICS, topic_refresh_s: float = 30.0) -> None:
        """``topics``: names and patterns (:mod:`ingest.core.topics`). With a pattern among them the
        broker's topics are listed now and every ``topic_refresh_s`` (in :meth:`poll`), and the
        subscription follows the matching set. Does not block on the broker otherwise."""
        self._listener = listener
        self._kafka = kafka
        self._group_id = group_id
        self._selector = TopicSelector(topics, exclude_topics)
        self._topic_refresh_s = topic_refresh_s
        #: the topics subscribed to now (literal names, plus what the patterns matched at the last listing)
        self._topics: list[str] = []
        self._next_listing_s = 0.0
        #: monotonic time since when every broker is down (None: reachable, as far as we know)
        self._unreachable_since: float | None = None
        self._probed_at = 0.0
        self._consumer = Consumer({**consumer_config(kafka, group_id), "error_cb": self._on_error}, logger=log)
        self._cooperative = "cooperative" in str(kafka.client.get("partition.assignment.strategy", ""))
        self._closed = False
        self._watchdog = StallWatchdog(kafka.outage_timeout_s)
        if self._selector.has_patterns:
            self._list_topics()
        else:
            self._subscribe(list(self._selector.literals))

    # -- the subscription ------------------------------------------------------
    def _subscribe(self, topics: list[str]) -> None:
        if topics:
            self._consumer.subscribe(
                topics, on_assign=self._assign_cb, on_revoke=self._revoke_cb, on_lost=self._lost_cb
            )
        elif self._topics:
            self._consumer.unsubscribe()
        self._topics = topics

    def _list_topics(self) -> None:
        """Topic patterns: list the broker's topics and subscribe again when the matching set changed
        (a rebalance follows). A broker that does not answer is asked again at the next probe interval."""
        now = time.monotonic()
        try:
            listed = self._consumer.list_topics(timeout=PROBE_TIMEOUT_S).topics
        except KafkaException as exc:
            log.warning("kafka: cannot list topics for the topic patterns; trying again",
                        extra={"error": exc.args[0].str() if exc.args else str(exc)})
            self._next_listing_s = now + PROBE_INTERVAL_S
            if not self._topics and self._unreachable_since is None:
                # Nothing subscribed yet, so librdkafka reports no outage: count it here (_check_outage).
                self._unreachable_since = self._probed_at = now
            return
        self._next_listing_s = now + self._topic_refresh_s
        self._unreachable_since = None
        topics = self._selector.select(listed)
        if topics != self._topics:
            log.info("kafka: the topic patterns match a new set of topics", extra={
                "added": sorted(set(topics) - set(self._topics)), "removed": sorted(set(self._topics) - set(topics))})
            self._subscribe(topics)

    # -- rebalance -------------------------------------------------------------
    def _assign_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        seek_to = self._listener.on_assign([_tp(p) for p in partitions]) or {}
        if seek_to:
            for p in partitions:
                target = seek_to.get(_tp(p))
                if target is not None:
                    p.offset = target
            if self._cooperative:
                consumer.incremental_assign(partitions)
            else:
                consumer.assign(partitions)

    # -- broker outages (see the module docstring) -------------------------------
    def _on_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (runs inside ``poll`` on the calling thread)."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            if self._unreachable_since is None:
                self._unreachable_since = self._probed_at = time.monotonic()
            log.warning("kafka: every broker is down or silent; waiting for them",
                        extra={"error": err.str(), "outage_timeout_s": self._kafka.outage_timeout_s})
        else:
            log.warning("kafka client error: %s", err.str())

    def _check_outage(self) -> None:
        """While every broker is down: probe now and then; raise TransientError past the bound."""
        since = self._unreachable_since
        now = time.monotonic()
        if since is None or now - self._probed_at < PROBE_INTERVAL_S:
            return
        self._probed_at = now
        try:
            self._consumer.list_topics(timeout=PROBE_TIMEOUT_S)
        except KafkaException as exc:
            bound = self._kafka.outage_timeout_s
            if bound and now - since >= bound:
                raise TransientError(
                    f"the Kafka brokers have not answered for {now - since:.0f} s (kafka.outage_timeout_s "
                    f"{bound:g}): {exc.args[0].str() if exc.args else exc}", error_class="broker_outage") from None
            return
        log.info("kafka: the brokers answer again", extra={"outage_s": round(now - since, 1)})
        self._unreachable_since = None

    def _revoke_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._listener.on_revoke([_tp(p) for p in partitions])

    def _lost_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._listener.on_lost([_tp(p) for p in partitions])

    # -- consuming -------------------------------------------------------------
    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        """Fetch up to ``max_records`` records, waiting at most ``timeout_s``.

        Runs rebalance callbacks. Per-partition errors are logged and skipped;
        a fatal client error, or every broker unreachable for longer than
        ``kafka.outage_timeout_s``, raises TransientError (the process should restart).
        """
        if self._unreachable_since is not None:
            self._check_outage()
        if self._selector.has_patterns and time.monotonic() >= self._next_listing_s:
            self._list_topics()
        if not self._topics:  # patterns that match nothing yet: nothing to consume
            time.sleep(timeout_s)
            return []
        messages = self._consumer.consume(num_messages=max_records, timeout=timeout_s)
        if not messages:
            return []
        self._unreachable_since = None
        n = len(messages)
        # The common chunk -- no errors, no headers -- field by field with C-level maps, not a Python
        # loop over the messages (each method call costs the same either way, the loop does not).
        if list(map(_error_of, messages)).count(None) == n and list(map(_headers_of, messages)).count(None) == n:
            stamps = list(map(_stamp_of, map(_timestamp_of, messages)))
            if min(stamps) < 0:  # a message without a timestamp (-1): None
                stamps = [ts if ts >= 0 else None for ts in stamps]
            return list(map(Record, map(_topic_of, messages), map(_partition_of, messages),
                            map(_offset_of, messages), map(_key_of, messages), map(_value_of, messages), stamps))
        return self._records(messages)

    @staticmethod
    def _records(messages: list[Message]) -> list[Record]:
        """The records of a chunk that holds errors or headers, one message at a time."""
        records: list[Record] = []
        append = records.append
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise TransientError(f"kafka consumer fatal error: {err.str()}", error_class="kafka_fatal")
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("kafka consumer error: %s", err.str())
                continue
            _, ts = msg.timestamp()
            headers = msg.headers()
            if headers:
                header_tuple = tuple(headers)
                append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                              ts if ts >= 0 else None, header_tuple, origin_of(header_tuple)))
            else:
                append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                              ts if ts >= 0 else None))
        return records

    def assignment(self) -> list[Partition]:
        return [_tp(p) for p in self._consumer.assignment()]

    def pause(self, partitions: Iterable[Partition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        if tps:
            self._consumer.pause(tps)

    def resume(self, partitions: Iterable[Partition]) -> None:
        """Resume fetching ``partitions`` from where this consumer stands, at once.

        librdkafka restarts fetching a resumed partition only at its broker thread's
        next wake-up: measured here, the first record came ≈ 0.9 s after ``resume``
        (so every backpressure pause cost almost a second of idle lanes). A seek to the
        consumer's own position -- the next offset it would deliver, which is where the
        resumed fetch would start anyway -- starts the fetch immediately (≈ 0.02 s).
        Partitions without a position yet (nothing delivered since assignment) are left
        to the plain resume.
        """
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        if not tps:
            return
        self._consumer.resume(tps)
        try:
            positions = self._consumer.position(tps)
        except KafkaException as exc:
            log.debug("no positions after resume: %s", exc)
            return
        for tp in positions:
            if tp.offset >= 0 and tp.error is None:
                try:
                    self._consumer.seek(tp)
                except KafkaException as exc:  # e.g. revoked meanwhile: the plain resume stands
                    log.debug("seek after resume failed for %s[%d]: %s", tp.topic, tp.partition, exc)

    def commit(self, offsets: dict[Partition, int]) -> None:
        """Synchronously commit watermarks (next offsets to read). Raises TransientError on failure.

        librdkafka's synchronous commit has no timeout: it waits for a group coordinator that does
        not answer (every broker down or silent) for as long as the outage lasts, and other calls on
        the consumer wait behind it. When the broker comes back it returns and the pipeline goes on;
        when it has waited ``kafka.outage_timeout_s``, the :class:`StallWatchdog` ends the process
        (exit 1), committing nothing more.
        """
        if not offsets:
            return
        tps = [TopicPartition(p.topic, p.partition, off) for p, off in offsets.items()]
        try:
            with self._watchdog.watch("an offset commit"):
                result = self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            raise TransientError(f"offset commit failed: {exc.args[0].str()}", error_class="commit") from None
        for tp in result or []:
            if tp.error is not None:
                raise TransientError(f"offset commit failed for {_tp(tp)}: {tp.error.str()}", error_class="commit")

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """librdkafka's position: one past the last record handed to us, and past any transaction
        marker or aborted record it skipped after it. Local, no broker round trip."""
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        if not tps:
            return {}
        try:
            result = self._consumer.position(tps)
        except KafkaException as exc:
            log.debug("no positions: %s", exc)
            return {}
        return {_tp(tp): tp.offset for tp in result if tp.error is None and tp.offset >= 0}

    def backlog(self, timeout_s: float) -> list[Backlog]:
        """Partitions of the subscribed topics with records at or after the group's committed offset.

        The committed offsets come from the group coordinator (any member's partitions); whether
        records lie beyond them is read with a probe (:mod:`ingest.sources.kafka_probe`), not judged
        from the reported high watermark alone. Raises TransientError when the broker cannot tell.
        """
        try:
            metadata = self._consumer.list_topics(timeout=timeout_s)
            tps: list[TopicPartition] = []
            for topic in self._topics:
                info = metadata.topics.get(topic)
                if info is None or info.error is not None:
                    raise TransientError(f"no metadata for topic {topic!r}", error_class="metadata")
                tps += [TopicPartition(topic, p) for p in sorted(info.partitions)]
            committed = {_tp(tp): (tp.offset if tp.offset >= 0 else None)
                         for tp in self._consumer.committed(tps, timeout=timeout_s)}
            starts: dict[Partition, int] = {}
            highs: dict[Partition, int] = {}
            for tp, offset in committed.items():
                low, high = self._consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition),
                                                                 timeout=timeout_s, cached=False)
                starts[tp] = offset if offset is not None and offset >= low else low
                highs[tp] = high
        except KafkaException as exc:
            raise TransientError(f"cannot read the group's offsets: {exc.args[0].str()}", error_class="backlog") from None
        probe = new_probe(self._kafka, "drain", logger=log)
        try:
            heads = read_heads(probe, starts, timeout_s)
        finally:
            probe.close()
        unknown = sorted(set(starts) - set(heads))
        if unknown:
            raise TransientError(f"no answer in {timeout_s} s for {', '.join(map(str, unknown))}",
                                 error_class="backlog")
        return [Backlog(tp, committed[tp], max(highs[tp], head.offset + 1) - starts[tp])
                for tp, head in sorted(heads.items()) if not head.at_end]

    def committed(self, partitions: Iterable[Partition], timeout_s: float = 10.0) -> dict[Partition, int | None]:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        try:
            result = self._consumer.committed(tps, timeout=timeout_s)
        except KafkaException as exc:
            raise TransientError(f"cannot read committed offsets: {exc.args[0].str()}", error_class="commit") from None
        return {_tp(tp): (tp.offset if tp.offset != OFFSET_INVALID and tp.offset >= 0 else None) for tp in result}

    def watermarks(self, partition: Partition, timeout_s: float = 5.0) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            TopicPartition(partition.topic, partition.partition), timeout=timeout_s, cached=False
        )
        return low, high

    def cached_high(self, partition: Partition) -> int | None:
        """The high watermark from the last fetch response (no broker round trip); None if unknown."""
        try:
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(partition.topic, partition.partition), cached=True
            )
        except KafkaException:
            return None
        return high if high is not None and high >= 0 else None

    def close(self) -> None:
        """Leave the group (runs revoke callbacks). Idempotent."""
        if not self._closed:
            self._closed = True
            with self._watchdog.watch("leaving the consumer group"):
                self._consumer.close()


def check_broker(kafka: KafkaSettings, timeout_s: float = 5.0) -> list[str]:
    """List topics once; returns their names. Raises ServiceUnreachable naming the bootstrap servers
    (never the credentials)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**kafka.client_config(), "socket.timeout.ms": int(timeout_s * 1000)})
    try:
        return sorted(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException as exc:
        err = exc.args[0]
        msg = err.str() if hasattr(err, "str") else str(err)
        raise ServiceUnreachable(f"kafka {kafka.bootstrap_servers}", msg) from None
