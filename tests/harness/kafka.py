"""Kafka helpers for tests: produce, create topics, read offsets.

Every helper opens its own short-lived client and closes it, so they can be
called from any test or thread without shared state.

Broker quirks to keep in mind (Tansu, the local broker; see /work/shared/INFRA.md):

- the *reported* high watermark (:func:`end_offsets`) is the base offset of
  the last produced batch + 1, not the true log end. Use
  :func:`log_end_offsets` for the true end, or produce the last record of
  each partition on its own (a separate :func:`produce` call) when a test
  needs the reported watermark to be exact;
- a group join takes about ``session.timeout.ms / 2``: consumers in tests
  should use :data:`TEST_CONSUMER_SETTINGS`;
- a consumer that closes while its first group join is still in progress
  wedges that group: use a fresh group id per test, and let consumers get
  their assignment before closing them.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

TEST_CONSUMER_SETTINGS: dict[str, Any] = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}

Record = tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, int]


def unique_name(prefix: str, hint: str | None = None, *, max_len: int = 120) -> str:
    """``<prefix>-<sanitised hint>-<12 hex>``: legal as a topic and a group id."""
    parts = [prefix]
    if hint:
        clean = re.sub(r"[^A-Za-z0-9._-]+", "_", hint).strip("_.-")
        if clean:
            parts.append(clean[: max(1, max_len - len(prefix) - 14)])
    parts.append(uuid.uuid4().hex[:12])
    return "-".join(parts)


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def _throwaway_consumer(bootstrap: str, group: str | None = None) -> Consumer:
    # group.id is mandatory for a Consumer; without subscribe() nothing joins the group.
    return Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": group or unique_name("harness-probe"),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
    })


def _partitions(client: Consumer | AdminClient, topic: str, timeout_s: float) -> list[int]:
    md = client.list_topics(topic, timeout=timeout_s)
    tmd = md.topics.get(topic)
    if tmd is None:
        raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"no metadata for topic {topic}"))
    if tmd.error is not None:
        raise KafkaException(tmd.error)
    return sorted(tmd.partitions)


def create_topic(bootstrap: str, name: str, partitions: int = 6, *, timeout_s: float = 30.0,
                 config: Mapping[str, str] | None = None) -> str:
    """Create ``name`` and wait until metadata shows all its partitions with a leader."""
    admin = _admin(bootstrap)
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1, config=dict(config or {}))],
        operation_timeout=timeout_s, request_timeout=timeout_s,
    )
    futures[name].result(timeout_s)
    deadline = time.monotonic() + timeout_s
    seen: object = None
    while True:
        md = admin.list_topics(name, timeout=max(1.0, min(5.0, deadline - time.monotonic())))
        tmd = md.topics.get(name)
        if tmd is not None and tmd.error is None:
            seen = {p: pm.leader for p, pm in tmd.partitions.items()}
            if len(tmd.partitions) == partitions and all(pm.leader >= 0 for pm in tmd.partitions.values()):
                return name
        else:
            seen = tmd.error if tmd is not None else "absent"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"topic {name}: metadata shows {seen!r}, want {partitions} partitions "
                               f"after {timeout_s}s")
        time.sleep(0.05)


def delete_topics(bootstrap: str, names: Sequence[str], *, timeout_s: float = 10.0) -> None:
    if not names:
        return
    futures = _admin(bootstrap).delete_topics(list(names), operation_timeout=timeout_s,
                                               request_timeout=timeout_s)
    for fut in futures.values():
        fut.result(timeout_s)


_producers: dict[tuple[str, tuple[tuple[str, str], ...]], Producer] = {}
_producers_lock = threading.Lock()


def _producer(bootstrap: str, config: Mapping[str, Any] | None) -> tuple[tuple, Producer]:
    # Cached: a new idempotent producer spends ~0.5 s getting its producer id.
    key = (bootstrap, tuple(sorted((str(k), str(v)) for k, v in (config or {}).items())))
    with _producers_lock:
        producer = _producers.get(key)
        if producer is None:
            producer = Producer({
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "linger.ms": 5,
                **(config or {}),
            })
            _producers[key] = producer
    return key, producer


def _drop_producer(key: tuple) -> None:
    with _producers_lock:
        _producers.pop(key, None)


def close_producers(bootstrap: str | None = None) -> None:
    """Flush and drop the cached producers (of ``bootstrap``, or all). Call before
    stopping a broker so their connections do not log errors afterwards."""
    with _producers_lock:
        keys = [k for k in _producers if bootstrap is None or k[0] == bootstrap]
        dropped = [_producers.pop(k) for k in keys]
    for producer in dropped:
        producer.flush(5)


def produce(bootstrap: str, topic: str, records: Iterable[Record], *, partition: int | None = None,
            timeout_s: float = 60.0, config: Mapping[str, Any] | None = None) -> int:
    """Produce ``records`` with an idempotent producer (``linger.ms=5``); flush; return the count.

    ``records`` holds ``(key, value)``, ``(key, value, partition)`` or ``(key, value, partition,
    headers)`` tuples (``headers``: a list of ``(name, bytes)``; partition may be None); a
    per-record partition wins over ``partition``, and ``None`` for both lets the
    producer's partitioner choose by key. ``config`` adds or overrides producer
    settings. Raises if any delivery failed or did not complete within
    ``timeout_s``. Each call ends with a flush, so the records of two calls
    never share a batch.
    """
    errors: list[str] = []
    failed = 0

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        nonlocal failed
        if err is not None:
            failed += 1
            if len(errors) < 5:
                errors.append(f"partition {msg.partition()}: {err}")

    key_, producer = _producer(bootstrap, config)
    count = 0
    try:
        for rec in records:
            headers = None
            if len(rec) == 4:
                key, value, part, headers = rec  # type: ignore[misc]
                part = partition if part is None else part
            elif len(rec) == 3:
                key, value, part = rec  # type: ignore[misc]
            else:
                key, value = rec  # type: ignore[misc]
                part = partition
            kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": on_delivery}
            if part is not None:
                kwargs["partition"] = part
            if headers:
                kwargs["headers"] = headers
            while True:
                try:
                    producer.produce(topic, **kwargs)
                    break
                except BufferError:  # local queue full: serve delivery reports and retry
                    producer.poll(0.05)
                except KafkaException as exc:  # e.g. a partition the producer knows is missing
                    raise RuntimeError(f"produce to {topic}: record {count} not delivered: {exc}") from exc
            count += 1
            if count % 1000 == 0:
                producer.poll(0)
        remaining = producer.flush(timeout_s)
    except BaseException:
        _drop_producer(key_)
        raise
    if remaining or failed:
        _drop_producer(key_)  # do not reuse a producer in an unknown state
    if remaining:
        raise RuntimeError(f"produce to {topic}: {remaining} of {count} records still undelivered "
                           f"after {timeout_s}s")
    if failed:
        raise RuntimeError(f"produce to {topic}: {failed} of {count} deliveries failed, e.g. {errors}")
    return count


def end_offsets(bootstrap: str, topic: str, *, timeout_s: float = 10.0) -> dict[int, int]:
    """High watermarks as the broker reports them: ``{partition: high}``.

    On Tansu this is base offset of the last batch + 1 (a lower bound of the log
    end); see :func:`log_end_offsets`.
    """
    consumer = _throwaway_consumer(bootstrap)
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s, cached=False)[1]
            for p in _partitions(consumer, topic, timeout_s)
        }
    finally:
        consumer.close()


def log_end_offsets(bootstrap: str, topic: str, *, timeout_s: float = 20.0) -> dict[int, int]:
    """The true log end offset (last offset + 1) of each partition, brokers' quirks aside.

    Reads each partition from its reported high watermark - 1 (the start of the
    last batch) up to partition EOF. Exact on Kafka, Redpanda and Tansu.
    """
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": unique_name("harness-logend"),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "error",
        "fetch.wait.max.ms": 100,
    })
    try:
        result: dict[int, int] = {}
        starts: list[TopicPartition] = []
        for p in _partitions(consumer, topic, timeout_s):
            high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s, cached=False)[1]
            result[p] = high
            if high > 0:
                starts.append(TopicPartition(topic, p, high - 1))
        if not starts:
            return result
        consumer.assign(starts)
        pending = {tp.partition for tp in starts}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"log_end_offsets({topic}): no EOF on partitions {sorted(pending)}")
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            if err is None:
                result[msg.partition()] = max(result[msg.partition()], msg.offset() + 1)
            elif err.code() == KafkaError._PARTITION_EOF:
                result[msg.partition()] = max(result[msg.partition()], msg.offset())
                pending.discard(msg.partition())
            else:
                raise KafkaException(err)
        return result
    finally:
        consumer.close()


def committed_offsets(bootstrap: str, group: str, topic: str, *, timeout_s: float = 10.0) -> dict[int, int]:
    """``{partition: committed offset}`` of ``group`` on ``topic``.

    Partitions without a committed offset are left out. Uses a consumer with
    that group id that never subscribes, so it does not join (or disturb) the group.
    """
    consumer = _throwaway_consumer(bootstrap, group)
    try:
        parts = _partitions(consumer, topic, timeout_s)
        tps = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=timeout_s)
        out: dict[int, int] = {}
        for tp in tps:
            if tp.error is not None:
                raise KafkaException(tp.error)
            if tp.offset >= 0:
                out[tp.partition] = tp.offset
        return out
    finally:
        consumer.close()


def make_consumer(bootstrap: str, group: str, config: Mapping[str, Any] | None = None) -> Consumer:
    """A consumer for ``group`` with the test settings, ``earliest`` reset and manual commits."""
    return Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        **TEST_CONSUMER_SETTINGS,
        **(config or {}),
    })


def consume_n(consumer: Consumer, n: int, *, timeout_s: float = 30.0) -> list[Message]:
    """Consume until ``n`` messages arrived (raises on timeout or a consumer error)."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"consumed {len(out)} of {n} messages in {timeout_s}s")
        for msg in consumer.consume(min(1000, n - len(out)), min(0.5, left)):
            err = msg.error()
            if err is None:
                out.append(msg)
            elif err.code() != KafkaError._PARTITION_EOF:
                raise KafkaException(err)
    return out
