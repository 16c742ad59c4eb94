"""The Source port's contract, run against every implementation: KafkaSource (a real broker) and MemorySource.

The pipeline loop is written against :class:`ingest.sources.base.Source`; the
model tests drive it with :class:`~ingest.sources.memory.MemorySource`. These
tests make sure the in-memory source keeps the promises the real one keeps
(and the other way round), so what the model tests prove holds for Kafka:

- ``on_assign`` runs inside ``poll``, before records of the partition;
- records of a partition arrive in offset order, each once, at most
  ``max_records`` per poll, in runs of one partition;
- ``on_assign`` may return start offsets that win over the committed ones;
- ``commit`` is read back by ``committed``; ``position`` is one past the last
  delivered record; a partition never committed reads as None;
- ``pause`` stops a partition (others go on), ``resume`` continues it without a
  gap or a repeat;
- ``backlog`` names the partitions with records at or past the committed offset;
- ``close`` revokes what is assigned (the last chance to commit) and is idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from harness.kafka import produce

from ingest.config import KafkaSettings
from ingest.sources.base import Source
from ingest.sources.kafka import KafkaSource
from ingest.sources.memory import MemoryLog, MemorySource
from ingest.types import Partition, Record

pytestmark = pytest.mark.timeout(180)

PARTITIONS = 2
TEST_CLIENT = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


@dataclass
class Listener:
    """Records every callback; ``seek`` is returned from ``on_assign``; ``commit_on_revoke`` commits there."""

    seek: dict[Partition, int] = field(default_factory=dict)
    events: list[tuple[str, list[Partition]]] = field(default_factory=list)
    source: Source | None = None
    commit_on_revoke: dict[Partition, int] = field(default_factory=dict)

    def on_assign(self, partitions: list[Partition]) -> dict[Partition, int] | None:
        self.events.append(("assign", sorted(partitions)))
        return {tp: off for tp, off in self.seek.items() if tp in partitions} or None

    def on_revoke(self, partitions: list[Partition]) -> None:
        self.events.append(("revoke", sorted(partitions)))
        if self.source is not None and self.commit_on_revoke:
            self.source.commit(self.commit_on_revoke)

    def on_lost(self, partitions: list[Partition]) -> None:
        self.events.append(("lost", sorted(partitions)))


class Backend:
    """One implementation under test: a topic to fill and sources (group members) to read it."""

    topic: str

    def produce(self, partition: int, n: int, start: int = 0) -> None:
        raise NotImplementedError

    def source(self, listener: Listener, group: str = "g") -> Source:
        raise NotImplementedError


class KafkaBackend(Backend):
    def __init__(self, bootstrap: str, topic: str, group_id: str) -> None:
        self.bootstrap, self.topic, self.group_id = bootstrap, topic, group_id

    def produce(self, partition: int, n: int, start: int = 0) -> None:
        produce(self.bootstrap, self.topic, [(f"k{i}".encode(), f'{{"i": {i}}}'.encode(), partition)
                                             for i in range(start, start + n)])

    def source(self, listener: Listener, group: str = "g") -> Source:
        settings = KafkaSettings(bootstrap_servers=self.bootstrap, client=TEST_CLIENT)
        src = KafkaSource(settings, f"{self.group_id}-{group}", [self.topic], listener)
        listener.source = src
        return src


class MemoryBackend(Backend):
    """A one-member group: the member is assigned every partition, as the broker would do."""

    def __init__(self) -> None:
        self.topic = "t"
        self.logs: dict[str, MemoryLog] = {}
        self.log = MemoryLog.with_topic(self.topic, PARTITIONS)

    def produce(self, partition: int, n: int, start: int = 0) -> None:
        for i in range(start, start + n):
            self.log.append(Partition(self.topic, partition), f"k{i}".encode(), f'{{"i": {i}}}'.encode())

    def source(self, listener: Listener, group: str = "g") -> Source:
        log = self.logs.setdefault(group, MemoryLog(self.log.partitions, {}, []))  # one log, a group's offsets
        src = MemorySource(log, listener, [self.topic])
        src.assign(list(self.log.partitions))
        listener.source = src
        return src


@pytest.fixture(params=["kafka", "memory"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    topic = request.getfixturevalue("new_topic")(PARTITIONS)
    yield KafkaBackend(bootstrap, topic, request.getfixturevalue("group_id"))


def poll_until(source: Source, done: Callable[[list[Record]], bool], *, max_records: int = 500,
               timeout_s: float = 60.0, on_chunk: Callable[[list[Record]], None] | None = None) -> list[Record]:
    """Poll until ``done(everything so far)``; fails after ``timeout_s``."""
    got: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while not done(got):
        assert time.monotonic() < deadline, f"timed out after {len(got)} records"
        chunk = source.poll(max_records, 0.2)
        assert len(chunk) <= max_records
        if on_chunk is not None:
            on_chunk(chunk)
        got.extend(chunk)
    return got


def by_partition(records: list[Record]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in records:
        out.setdefault(r.partition, []).append(r.offset)
    return out


def tp(backend: Backend, p: int) -> Partition:
    return Partition(backend.topic, p)


def test_assign_runs_inside_poll_and_records_come_in_order_once_in_partition_runs(backend: Backend) -> None:
    backend.produce(0, 30)
    backend.produce(1, 20)
    listener = Listener()
    src = backend.source(listener)
    chunks: list[list[Record]] = []
    try:
        got = poll_until(src, lambda g: len(g) >= 50, max_records=7, on_chunk=chunks.append)
        assert listener.events and listener.events[0][0] == "assign"
        assert sorted(src.assignment()) == [tp(backend, 0), tp(backend, 1)]
        assert by_partition(got) == {0: list(range(30)), 1: list(range(20))}
        for chunk in chunks:  # runs of one partition: a partition never comes back within a chunk
            runs = [r.partition for i, r in enumerate(chunk) if i == 0 or chunk[i - 1].partition != r.partition]
            assert len(runs) == len(set(runs)), f"partition runs interleave: {runs}"
        assert src.position([tp(backend, 0), tp(backend, 1)]) == {tp(backend, 0): 30, tp(backend, 1): 20}
        for p, end in ((0, 30), (1, 20)):
            high = src.cached_high(tp(backend, p))
            assert high is None or 0 < high <= end  # Tansu reports a lower bound of the log end
    finally:
        src.close()


def test_start_offsets_from_on_assign_win_over_the_committed_ones(backend: Backend) -> None:
    backend.produce(0, 10)
    backend.produce(1, 10)
    first = Listener()
    src = backend.source(first)
    try:
        poll_until(src, lambda g: len(g) >= 20)
        src.commit({tp(backend, 0): 2, tp(backend, 1): 3})
        assert src.committed([tp(backend, 0), tp(backend, 1)]) == {tp(backend, 0): 2, tp(backend, 1): 3}
    finally:
        src.close()
    seek = Listener(seek={tp(backend, 0): 7})  # partition 1 keeps its committed offset
    src = backend.source(seek)
    try:
        got = poll_until(src, lambda g: len(g) >= 3 + 7)
        assert by_partition(got) == {0: [7, 8, 9], 1: list(range(3, 10))}
    finally:
        src.close()


def test_a_partition_never_committed_reads_as_none_and_commits_read_back(backend: Backend) -> None:
    backend.produce(0, 5)
    listener = Listener()
    src = backend.source(listener)
    try:
        poll_until(src, lambda g: len(g) >= 5)
        assert src.committed([tp(backend, 0), tp(backend, 1)]) == {tp(backend, 0): None, tp(backend, 1): None}
        src.commit({tp(backend, 0): 5})
        assert src.committed([tp(backend, 0)]) == {tp(backend, 0): 5}
    finally:
        src.close()


def test_pause_stops_one_partition_and_resume_continues_it_without_gap_or_repeat(backend: Backend) -> None:
    backend.produce(0, 40)
    backend.produce(1, 40)
    listener = Listener()
    src = backend.source(listener)
    try:
        got = poll_until(src, lambda g: len(g) > 0 and bool(src.assignment()), max_records=5)
        src.pause([tp(backend, 0)])
        got += poll_until(src, lambda g: len([r for r in got + g if r.partition == 1]) >= 40, max_records=5)
        paused_seen = len([r for r in got if r.partition == 0])
        got += [r for _ in range(5) for r in src.poll(5, 0.1)]  # nothing more of partition 0 while paused
        assert len([r for r in got if r.partition == 0]) == paused_seen
        src.resume([tp(backend, 0)])
        got += poll_until(src, lambda g: len(got) + len(g) >= 80, max_records=5)
        assert by_partition(got) == {0: list(range(40)), 1: list(range(40))}
    finally:
        src.close()


def test_backlog_names_partitions_with_records_past_the_committed_offset(backend: Backend) -> None:
    backend.produce(0, 10)
    backend.produce(1, 4)
    listener = Listener()
    src = backend.source(listener)
    try:
        poll_until(src, lambda g: len(g) >= 14)
        src.commit({tp(backend, 0): 6, tp(backend, 1): 4})
        backlog = src.backlog(10.0)
        assert [(b.partition, b.committed) for b in backlog] == [(tp(backend, 0), 6)]
        assert 1 <= backlog[0].behind <= 4  # exact on Kafka; a lower bound where the high watermark lags (Tansu)
        src.commit({tp(backend, 0): 10})
        assert src.backlog(10.0) == []
    finally:
        src.close()


def test_close_revokes_the_assignment_once_and_a_commit_there_lands(backend: Backend) -> None:
    backend.produce(0, 8)
    listener = Listener()
    src = backend.source(listener)
    poll_until(src, lambda g: len(g) >= 8)
    listener.commit_on_revoke = {tp(backend, 0): 8}
    src.close()
    src.close()
    revokes = [parts for kind, parts in listener.events if kind == "revoke"]
    assert revokes == [[tp(backend, 0), tp(backend, 1)]]
    reader = backend.source(Listener())
    try:
        poll_until(reader, lambda g: bool(reader.assignment()), timeout_s=60)
        assert reader.committed([tp(backend, 0)]) == {tp(backend, 0): 8}
    finally:
        reader.close()
