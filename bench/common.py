"""Shared pieces of the benchmark scripts: the sample stream, topic creation, reading it back."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from ingest.types import Record

PARTITIONS = 6
CONSUMER = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "auto.offset.reset": "earliest",
            "enable.auto.commit": False}


def event(i: int, key: int) -> bytes:
    """The benchmark record (~110 B of JSON): id = its key, so a third of the records are updates."""
    return orjson.dumps({"id": key, "user": i % 997, "kind": "click" if i % 3 else "view",
                         "amount": round(i % 10000 / 100, 2), "ts": 1764460800000 + i})


def create_topic(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        fut.result()


def produce(bootstrap: str, topic: str, n: int, value: Callable[[int, int], bytes] = event) -> None:
    """``n`` records over ``n // 3`` keys (Kafka key = str(key)), ``value(i, key)`` as the value."""
    keys = max(1, n // 3)
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20,
                  "batch.num.messages": 10000, "queue.buffering.max.messages": 1_000_000})
    for i in range(n):
        k = (i * 7919) % keys
        payload = value(i, k)
        while True:
            try:
                p.produce(topic, key=str(k).encode(), value=payload)
                break
            except BufferError:
                p.poll(0.05)
        if i % 10000 == 0:
            p.poll(0)
    if p.flush(60) != 0:
        raise RuntimeError("produce did not finish")


def consume_all(bootstrap: str, topic: str, n: int) -> tuple[list[Record], float]:
    """Read ``n`` records back with one group-less consumer; returns them and the seconds it took."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}", **CONSUMER})
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    out: list[Record] = []
    start = None
    while len(out) < n:
        msgs = c.consume(10000, timeout=1.0)
        if start is None and msgs:
            start = time.perf_counter()
        for m in msgs:
            if m.error() is None:
                out.append(Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1]))
    elapsed = time.perf_counter() - (start or time.perf_counter())
    c.close()
    return out, elapsed
