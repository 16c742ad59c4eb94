"""An in-memory, scripted :class:`~ingest.sources.base.Source`, for tests of the pipeline loop.

:class:`MemoryLog` plays the broker: partitioned logs (records, and transaction
markers that take an offset but are never delivered) and one consumer group's
committed offsets. :class:`MemorySource` is one member of that group. The test
decides the group's moves -- :meth:`MemorySource.assign`, :meth:`~MemorySource.revoke`,
:meth:`~MemorySource.lose` queue a rebalance that the next :meth:`~MemorySource.poll`
reports through the listener, before returning records, exactly where
confluent-kafka runs its callbacks.

Deterministic: no threads, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ingest.errors import TransientError
from ingest.sources.base import Backlog, RebalanceListener
from ingest.types import Headers, Partition, Record


@dataclass
class MemoryLog:
    """Partitioned logs and one group's committed offsets. ``None`` entries are transaction markers."""

    partitions: dict[Partition, list[Record | None]] = field(default_factory=dict)
    committed: dict[Partition, int] = field(default_factory=dict)
    #: every commit the group received, in order: (partition, offset)
    commits: list[tuple[Partition, int]] = field(default_factory=list)

    @classmethod
    def with_topic(cls, topic: str, partitions: int) -> MemoryLog:
        return cls({Partition(topic, p): [] for p in range(partitions)})

    def append(self, tp: Partition, key: bytes | None, value: bytes | None, *, headers: Headers = (),
               timestamp_ms: int | None = None) -> Record:
        log = self.partitions[tp]
        record = Record(tp.topic, tp.partition, len(log), key, value, timestamp_ms, headers)
        log.append(record)
        return record

    def append_marker(self, tp: Partition) -> int:
        """A transaction commit marker: takes the next offset, is never delivered. Returns its offset."""
        log = self.partitions[tp]
        log.append(None)
        return len(log) - 1

    def end(self, tp: Partition) -> int:
        """The log end offset (one past the last entry, markers included)."""
        return len(self.partitions[tp])


class MemorySource:
    """One group member reading a :class:`MemoryLog`; see the module docstring."""

    def __init__(self, log: MemoryLog, listener: RebalanceListener, topics: Iterable[str]) -> None:
        self.log = log
        self._listener = listener
        self._topics = set(topics)
        self._assigned: dict[Partition, int] = {}  # partition -> position (next offset to deliver)
        self._paused: set[Partition] = set()
        self._events: list[tuple[str, list[Partition]]] = []
        self.closed = False
        #: the next this-many commits raise TransientError (failure injection)
        self.fail_commits = 0

    # -- the test's side: the group's moves ---------------------------------------
    def assign(self, partitions: Iterable[Partition]) -> None:
        self._events.append(("assign", list(partitions)))

    def revoke(self, partitions: Iterable[Partition]) -> None:
        self._events.append(("revoke", list(partitions)))

    def lose(self, partitions: Iterable[Partition]) -> None:
        self._events.append(("lost", list(partitions)))

    def _rebalance(self) -> None:
        events, self._events = self._events, []
        for kind, parts in events:
            if kind == "assign":
                new = [tp for tp in parts if tp not in self._assigned]
                if not new:
                    continue
                seek = self._listener.on_assign(new) or {}
                for tp in new:
                    self._assigned[tp] = seek.get(tp, self.log.committed.get(tp, 0))
                continue
            gone = [tp for tp in parts if tp in self._assigned]
            if not gone:
                continue
            if kind == "revoke":
                self._listener.on_revoke(gone)
            else:
                self._listener.on_lost(gone)
            for tp in gone:
                del self._assigned[tp]
                self._paused.discard(tp)

    # -- the Source protocol -------------------------------------------------------
    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        self._rebalance()
        out: list[Record] = []
        for tp in list(self._assigned):
            if tp in self._paused:
                continue
            log = self.log.partitions[tp]
            pos = self._assigned[tp]
            while pos < len(log) and len(out) < max_records:
                entry = log[pos]
                pos += 1
                if entry is not None:
                    out.append(entry)
            self._assigned[tp] = pos
        return out

    def assignment(self) -> list[Partition]:
        return list(self._assigned)

    def pause(self, partitions: Iterable[Partition]) -> None:
        self._paused.update(tp for tp in partitions if tp in self._assigned)

    def resume(self, partitions: Iterable[Partition]) -> None:
        self._paused.difference_update(partitions)

    def commit(self, offsets: dict[Partition, int]) -> None:
        if self.fail_commits:
            self.fail_commits -= 1
            raise TransientError("offset commit failed (injected)", error_class="commit")
        for tp, offset in offsets.items():
            if tp not in self._assigned:
                raise TransientError(f"offset commit failed for {tp}: not assigned", error_class="commit")
        for tp, offset in offsets.items():
            self.log.committed[tp] = offset
            self.log.commits.append((tp, offset))

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        out: dict[Partition, int] = {}
        for tp in partitions:
            if tp not in self._assigned:
                continue
            pos = self._assigned[tp]
            log = self.log.partitions[tp]
            while pos < len(log) and log[pos] is None:  # a marker right at the position: skipped
                pos += 1
            out[tp] = pos
        return out

    def committed(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        return {tp: self.log.committed.get(tp) for tp in partitions}

    def cached_high(self, partition: Partition) -> int | None:
        return self.log.end(partition) if partition in self.log.partitions else None

    def backlog(self, timeout_s: float) -> list[Backlog]:
        out = []
        for tp, log in self.log.partitions.items():
            if tp.topic not in self._topics:
                continue
            committed = self.log.committed.get(tp)
            behind = sum(1 for entry in log[committed or 0:] if entry is not None)
            if behind:
                out.append(Backlog(tp, committed, behind))
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._assigned:
            self._listener.on_revoke(list(self._assigned))
            self._assigned.clear()
