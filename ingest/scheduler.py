"""Process-wide write scheduler: a priority budget of concurrent batch writes per database.

Several pipelines of one process often write into one database. Each sink
database (identified by its DSN / URL) gets at most ``max_concurrent_writes``
batch writes at a time. A lane with a ready batch asks for a slot; when none
is free it waits in an :class:`~ingest.core.priority.AgingPriorityQueue`, and
each freed slot goes to the most urgent waiter: the highest pipeline
``priority``, improved by one level per ``aging_ms_per_level`` of waiting, so
a low-priority batch is overtaken only for a bounded time (see the queue's
docstring) and never starves.

- A lane holds at most one slot (it writes one batch at a time), so per-key
  order is untouched and the queue never holds more entries than there are
  lanes sharing the database. That number, not ``max_waiting``, is what the
  queue's ``max_wait_ms`` bound should be read with: a low-priority batch
  waits at most ``gap × aging_ms_per_level`` plus (lanes sharing the database)
  write times. A slot covers only the database work of a batch (its dedupe
  runs before the request).
- When pipelines sharing a database disagree on ``max_concurrent_writes``,
  the smallest wins (the budget protects the database, so the strictest
  setting is the one to honour).
- Bounded memory follows from the pipelines' own backpressure: a pipeline
  whose batches wait keeps more records in flight and pauses its partitions
  at ``max_buffered_records``; lower priorities wait longer, so they pause
  first.

Waits are measured and exported per pipeline (``ingest_write_queue_wait_seconds``)
along with the queue length per priority and the slots in use.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge, Histogram

from ingest.core.priority import AgingPriorityQueue

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(slots=True)
class _Waiter:
    event: threading.Event
    pipeline: str


class WriteScheduler:
    """Grants write slots for one database. Thread-safe; ``slot`` blocks the calling lane thread."""

    def __init__(
        self,
        name: str,
        slots: int,
        *,
        aging_ms_per_level: int = 1000,
        max_waiting: int = 100_000,
        clock: Callable[[], int] = monotonic_ms,
        metrics_registry: object | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.name = name
        self.slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self._in_use = 0
        self._queue: AgingPriorityQueue[_Waiter] = AgingPriorityQueue(aging_ms_per_level, max_waiting)
        self._wait_hist: Histogram | None = None
        self._queue_len: Gauge | None = None
        self._in_use_gauge: Gauge | None = None
        self._known_priorities: set[int] = set()
        if metrics_registry is not None:
            self._wait_hist = _metric(metrics_registry, "wait")
            self._queue_len = _metric(metrics_registry, "len")
            self._in_use_gauge = _metric(metrics_registry, "slots")

    @contextmanager
    def slot(self, pipeline: str, priority: int) -> Iterator[float]:
        """Hold one write slot for the duration of the block; yields the seconds waited for it."""
        waited_s = self.acquire(pipeline, priority)
        try:
            yield waited_s
        finally:
            self.release()

    def acquire(self, pipeline: str, priority: int) -> float:
        """Block until a slot is granted; return the wait in seconds."""
        started = self._clock()
        with self._lock:
            if self._in_use < self.slots and len(self._queue) == 0:
                self._in_use += 1
                self._publish()
                waiter = None
            else:
                waiter = _Waiter(threading.Event(), pipeline)
                self._queue.push(waiter, priority, started)
                self._publish()
        if waiter is not None:
            waiter.event.wait()
        waited_s = (self._clock() - started) / 1000
        if self._wait_hist is not None:
            self._wait_hist.labels(pipeline).observe(waited_s)
        return waited_s

    def release(self) -> None:
        """Give the slot to the most urgent waiter, or free it."""
        with self._lock:
            nxt = self._queue.pop(self._clock())
            if nxt is None:
                self._in_use -= 1
            else:
                nxt.event.set()  # the slot passes on; in_use unchanged
            self._publish()

    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    def _publish(self) -> None:
        if self._queue_len is not None:
            counts = self._queue.counts_by_priority()
            for priority in self._known_priorities:
                self._queue_len.labels(self.name, str(priority)).set(counts.get(priority, 0))
            for priority, n in counts.items():
                self._known_priorities.add(priority)
                self._queue_len.labels(self.name, str(priority)).set(n)
        if self._in_use_gauge is not None:
            self._in_use_gauge.labels(self.name).set(self._in_use)


_METRICS: weakref.WeakKeyDictionary[Any, dict[str, object]] = weakref.WeakKeyDictionary()


def _metric(registry: Any, kind: str) -> Any:
    """One set of scheduler metrics per registry, shared by every scheduler of the process."""
    per_registry = _METRICS.setdefault(registry, {})
    key = kind
    if key not in per_registry:
        if kind == "wait":
            per_registry[key] = Histogram("ingest_write_queue_wait_seconds", "Time a ready batch waited for a write slot.",
                                      ["pipeline"], buckets=_WAIT_BUCKETS, registry=registry)
        elif kind == "len":
            per_registry[key] = Gauge("ingest_write_queue_length", "Batches waiting for a write slot, by priority.",
                                  ["database", "priority"], registry=registry)
        else:
            per_registry[key] = Gauge("ingest_write_slots_in_use", "Write slots in use.", ["database"], registry=registry)
    return per_registry[key]
