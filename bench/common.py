"""Shared pieces of the benchmark scripts: the sample stream, topic creation, reading it back."""

from __future__ import annotations

import bisect
import datetime as dt
import json
import math
import os
import resource
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

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


_AGENTS = ["Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Safari/537.36",
           "Mozilla/5.0 (iPhone; CPU iPhone OS 18_1 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like Gecko) "
           "Version/18.1 Mobile/15E148 Safari/604.1"]


def wide_event(i: int, key: int) -> bytes:
    """A wide record (~750 B of JSON, nested objects and an array): the shape of a web analytics event,
    as the figures clickhouse_sinker publishes are for. ``id`` = its key, like :func:`event`."""
    return orjson.dumps({
        "id": key, "ts": 1764460800000 + i, "kind": ("click", "view", "scroll")[i % 3],
        "user": {"id": i % 99_991, "name": f"user-{i % 99_991:05d}", "country": ("DE", "IT", "FR", "PL")[i % 4],
                 "new": i % 7 == 0},
        "session": f"{i * 2654435761 % 2**64:016x}-{key:08x}-4a1b-9c2d-{i:012x}",
        "amount": round(i % 10000 / 100, 2), "currency": "EUR", "ip": f"10.{i % 256}.{i // 256 % 256}.{i % 251}",
        "ua": _AGENTS[i % 2],
        "page": {"url": f"https://shop.example.com/catalogue/category-{i % 50}/product-{i % 5000}?ref=campaign-{i % 9}",
                 "referrer": f"https://www.search.example/results?q=product+{i % 5000}&page={i % 5}",
                 "title": f"Product {i % 5000} - Category {i % 50} - Example Shop"},
        "latency_ms": i % 1500, "score": (i % 1000) / 7, "tags": ["promo", f"cat-{i % 50}", "mobile" if i % 2 else "desktop"],
        "meta": {"app": "web", "version": "4.12.0", "experiment": f"exp-{i % 4}", "build": 20261201,
                 "screen": "1920x1080", "lang": "de-DE,de;q=0.9,en;q=0.8"},
    })


#: The wide record's columns (16; nested paths, a jsonb array) in the benches' configuration form.
WIDE_COLUMNS = {
    "event_id": {"type": "bigint", "source": "$.id", "required": True},
    "ts": {"type": "timestamptz", "source": "$.ts"},
    "kind": {"type": "text", "source": "$.kind"},
    "user_id": {"type": "bigint", "source": "$.user.id"},
    "user_name": {"type": "text", "source": "$.user.name"},
    "country": {"type": "text", "source": "$.user.country"},
    "is_new": {"type": "boolean", "source": "$.user.new"},
    "session": {"type": "text", "source": "$.session"},
    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
    "currency": {"type": "text", "source": "$.currency"},
    "ip": {"type": "text", "source": "$.ip"},
    "user_agent": {"type": "text", "source": "$.ua"},
    "url": {"type": "text", "source": "$.page.url"},
    "referrer": {"type": "text", "source": "$.page.referrer"},
    "latency_ms": {"type": "integer", "source": "$.latency_ms"},
    "tags": {"type": "jsonb", "source": "$.tags"},
}


#: One record in this many of the poison stream is poison (0.1 %).
POISON_EVERY = 1000


def poison_event(i: int, key: int) -> bytes:
    """:func:`event`, except that every :data:`POISON_EVERY`-th record is poison, alternately not JSON
    and with an ``id`` that is not a number (the two commonest kinds): a dirty stream must not send
    its clean records down the slow path."""
    if i % POISON_EVERY != POISON_EVERY - 1:
        return event(i, key)
    if (i // POISON_EVERY) % 2:
        return b'{"id": ' + str(key).encode() + b', "user": '  # truncated: not JSON
    return orjson.dumps({"id": f"id-{key}", "user": i % 997, "kind": "click", "amount": 1.5, "ts": 1764460800000 + i})


def hit_rate(stats: dict[str, Any], misses: str = "fast_path_misses") -> float | None:
    """The share of mapped records a tier of the mapper took, in a pipeline's ``--summary-json`` stats:
    ``misses`` names the tier's counter (``fast_path_misses``: the compiled fast path;
    ``typed_misses``: its typed tier, msgspec on JSON). None: nothing mapped."""
    mapped = stats.get("records_mapped") or 0
    return 1 - stats.get(misses, 0) / mapped if mapped else None


def paths(runs: list[dict]) -> str:
    """Which path the runs' records took (the worst run): the share written by the columnar tier, or,
    by rows, the fast path's and the typed tier's hit rates."""
    share = min(r["columnar_share"] or 0.0 for r in runs)
    if any(r["columnar_share"] for r in runs):
        return f"written columnar {share * 100:.2f} %"
    hits = [r["hit_rate"] for r in runs if r.get("hit_rate") is not None]
    if not hits:
        return "no records mapped"
    typed = [r["typed_hit_rate"] for r in runs if r.get("typed_hit_rate") is not None]
    return f"fast path {min(hits) * 100:.2f} %" + (f" (typed {min(typed) * 100:.2f} %)" if typed else "")


def poison_count(n: int) -> int:
    """How many of the first ``n`` records of the poison stream are poison."""
    return n // POISON_EVERY


#: The benchmark record as Avro, with the natural type of each field: ``amount`` a decimal(12,2), ``ts`` a
#: timestamp-millis. The columns the benches map it to are the same as for JSON (bigint, bigint, text,
#: numeric(12,2), timestamptz).
EVENT_AVRO_SCHEMA = json.dumps({
    "type": "record", "name": "BenchEvent", "namespace": "bench.ingest",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "user", "type": "long"},
        {"name": "kind", "type": "string"},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
})

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_CENTS = Decimal("0.01")


def event_avro_doc(i: int, key: int) -> dict[str, Any]:
    """:func:`event`'s record as the datum of :data:`EVENT_AVRO_SCHEMA`: made from the JSON record itself, so
    the two streams carry the same values -- ``amount`` as the Decimal a numeric column gets from the JSON
    number, ``ts`` as the UTC datetime a timestamptz column gets from its epoch milliseconds."""
    doc = orjson.loads(event(i, key))
    doc["amount"] = Decimal(repr(doc["amount"])).quantize(_CENTS)
    doc["ts"] = _EPOCH + dt.timedelta(milliseconds=doc["ts"])
    return doc


def event_message_class() -> Any:
    """The benchmark record as a Protobuf message class ``bench.Event`` (proto3; built from a descriptor, as
    there is no protoc here): ``id`` and ``user`` int64, ``kind`` string, ``amount`` string (the decimal as
    text), ``ts`` a ``google.protobuf.Timestamp``. The columns the benches map it to are the same as for
    JSON (bigint, bigint, text, numeric(12,2), timestamptz)."""
    from google.protobuf import (
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        timestamp_pb2,
    )

    field = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="bench/event.proto", package="bench", syntax="proto3",
                                            dependency=["google/protobuf/timestamp.proto"])
    msg = fd.message_type.add(name="Event")
    for number, (name, kind, type_name) in enumerate(
            [("id", field.TYPE_INT64, None), ("user", field.TYPE_INT64, None), ("kind", field.TYPE_STRING, None),
             ("amount", field.TYPE_STRING, None), ("ts", field.TYPE_MESSAGE, ".google.protobuf.Timestamp")], 1):
        f = msg.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
        if type_name:
            f.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Event"))


def event_message(cls: Any, i: int, key: int) -> Any:
    """:func:`event`'s record as a message of ``cls`` (:func:`event_message_class`), with exactly the values
    of :func:`event_avro_doc`: ``amount`` the text of its 2-decimal Decimal (``"0.29"``, ``"0.00"``), ``ts``
    its UTC datetime (whole milliseconds, so exact in a Timestamp)."""
    doc = event_avro_doc(i, key)
    message = cls(id=doc["id"], user=doc["user"], kind=doc["kind"], amount=str(doc["amount"]))
    message.ts.FromDatetime(doc["ts"])
    return message


def create_topic(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        fut.result()


#: The benchmarks' producer: idempotent, big batches, a local queue deep enough for a backlog.
PRODUCER = {"enable.idempotence": True, "linger.ms": 20, "batch.num.messages": 10000,
            "queue.buffering.max.messages": 1_000_000}


def send_all(bootstrap: str, messages: Iterable[tuple[str, bytes, bytes]], *,
             config: Mapping[str, Any] | None = None, flush_timeout_s: float = 60) -> None:
    """Produce ``(topic, key, value)`` messages, waiting whenever the local queue is full; then flush.

    ``config`` adds to or overrides :data:`PRODUCER`. Raises RuntimeError if the flush does not finish.
    """
    p = Producer({"bootstrap.servers": bootstrap, **PRODUCER, **(config or {})})
    for i, (topic, key, value) in enumerate(messages):
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.05)
        if i % 10000 == 0:
            p.poll(0)
    if p.flush(flush_timeout_s) != 0:
        raise RuntimeError("produce did not finish")


def produce(bootstrap: str, topic: str, n: int, value: Callable[[int, int], bytes] = event) -> None:
    """``n`` records over ``n // 3`` keys (Kafka key = str(key)), ``value(i, key)`` as the value."""
    keys = max(1, n // 3)
    send_all(bootstrap, ((topic, str(k).encode(), value(i, k)) for i, k in ((i, (i * 7919) % keys)
                                                                            for i in range(n))))


def children_cpu_s() -> float:
    """CPU-seconds (user + sys) of every child process this one has waited for, and their waited-for children."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_measured(cmd: list[str], **kwargs: Any) -> float:
    """Run ``cmd`` to completion (``check=True``); return the CPU-seconds it used, its children included
    (``ingest run --processes`` waits for its workers, so theirs count too)."""
    before = children_cpu_s()
    subprocess.run(cmd, check=True, **kwargs)
    return children_cpu_s() - before


def machine_busy_s() -> float:
    """CPU-seconds every process on this machine has used since boot (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class Window:
    """A measured interval: wall seconds and the machine's busy CPU-seconds in it (broker, database, us)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._t0: float | None = None
        self._c0 = 0.0

    def start(self) -> None:
        self._t0, self._c0 = time.perf_counter(), machine_busy_s()

    def stop(self) -> Window:
        assert self._t0 is not None, "stop() before start()"
        self.wall_s, self.cpu_s = time.perf_counter() - self._t0, machine_busy_s() - self._c0
        return self

    def cpu_us_per_record(self, n: int) -> float:
        return self.cpu_s / n * 1e6


class BusySampler:
    """Samples the machine's busy CPU-seconds (:func:`machine_busy_s`) every ``interval_s`` on the
    system-wide monotonic clock, so the CPU used inside a window that another process reports on that
    clock (``ingest run``'s ``busy_window_s``) can be read off afterwards. Use as a context manager."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self._interval_s = interval_s
        self._times: list[float] = []
        self._busy: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self._times.append(time.monotonic())
            self._busy.append(machine_busy_s())
            if self._stop.wait(self._interval_s):
                return

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _at(self, t: float) -> float:
        """Busy CPU-seconds at monotonic time ``t``, interpolated between the two samples around it."""
        i = min(max(bisect.bisect_left(self._times, t), 1), len(self._times) - 1)
        t0, t1 = self._times[i - 1], self._times[i]
        b0, b1 = self._busy[i - 1], self._busy[i]
        return b0 + (b1 - b0) * min(max((t - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else b1

    def cpu_s(self, start: float, end: float) -> float:
        """The machine's busy CPU-seconds between monotonic times ``start`` and ``end``."""
        return self._at(end) - self._at(start)


def cpu_cap(n: int, *windows: Window) -> tuple[list[float], int, float]:
    """Machine CPU µs per record of each window, the core count, and the records/s cap of doing all of them
    on these cores: ``cores / sum(cpu per record)`` (infinite when the windows were too short for
    /proc/stat's 10 ms ticks to see any CPU, as in a smoke run of a few thousand records)."""
    per_record = [w.cpu_us_per_record(n) for w in windows]
    cores = os.cpu_count() or 1
    return per_record, cores, records_cap(cores, sum(per_record))


def records_cap(cores: int, cpu_us_per_record: float) -> float:
    """Records/s that ``cores`` can do at ``cpu_us_per_record`` (infinite when nothing was measured)."""
    return cores * 1e6 / cpu_us_per_record if cpu_us_per_record > 0 else math.inf


def consume_all(bootstrap: str, topic: str, n: int) -> tuple[list[Record], Window]:
    """Read ``n`` records back with one group-less consumer; returns them and the window (first record → last)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}", **CONSUMER})
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    out: list[Record] = []
    window = Window()
    started = False
    while len(out) < n:
        msgs = c.consume(10000, timeout=1.0)
        if not started and msgs:
            window.start()
            started = True
        for m in msgs:
            if m.error() is None:
                out.append(Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1]))
    window.stop()
    c.close()
    return out, window
