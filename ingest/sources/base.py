"""The source port: what the pipeline loop needs from a consumer of partitioned logs.

A :class:`Source` is a subscription of one consumer group member to some
topics. It is driven by exactly one thread (the pipeline thread), which calls
:meth:`Source.poll` in a loop; rebalances are reported *inside* ``poll``, on
that thread, through the :class:`RebalanceListener` the source was built with.
So the pipeline's own state never needs a lock.

Two implementations satisfy it: :class:`ingest.sources.kafka.KafkaSource`
(confluent-kafka) and :class:`ingest.sources.memory.MemorySource` (scripted,
for tests of the loop's rules without a broker).

Vocabulary (see :mod:`ingest.types`): an *offset* to commit is always the next
offset to read. A record's own offset is ``record.offset``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from ingest.types import Partition, Record


class RebalanceListener(Protocol):
    """Told about assignment changes; every method runs inside ``Source.poll`` on the polling thread."""

    def on_assign(self, partitions: list[Partition]) -> dict[Partition, int] | None:
        """``partitions`` were assigned. May return ``{partition: offset}`` to start reading from instead of
        the group's committed offsets (exactly-once mode resumes from the database). May block (retries)."""
        ...

    def on_revoke(self, partitions: list[Partition]) -> None:
        """``partitions`` are being taken away in an orderly rebalance: the last moment to commit them.
        May block until their in-flight records are handled (bounded by the caller's timeout)."""
        ...

    def on_lost(self, partitions: list[Partition]) -> None:
        """``partitions`` were lost (session timeout): another member may own them already, so nothing
        of them may be committed any more. Must not block."""
        ...


@dataclass(frozen=True, slots=True)
class Backlog:
    """A partition of the subscription whose records the group has not finished."""

    partition: Partition
    #: the group's committed offset (None: never committed)
    committed: int | None
    #: records between the committed offset and the log end: at least 1; exact on Kafka, a lower
    #: bound on brokers whose reported high watermark lags the log end (Tansu)
    behind: int


class Source(Protocol):
    """A consumer group member's subscription. Not thread-safe: one thread drives it."""

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        """Return up to ``max_records`` records, waiting at most ``timeout_s`` for the first.

        Records of one partition come in offset order, in runs of one partition.
        Rebalance callbacks run inside this call, before the records are returned.
        Raises :class:`~ingest.errors.TransientError` when the client failed fatally.
        """
        ...

    def assignment(self) -> list[Partition]:
        """The partitions assigned now. Never raises."""
        ...

    def pause(self, partitions: Iterable[Partition]) -> None:
        """Stop fetching ``partitions`` (the member stays in its group). Never raises."""
        ...

    def resume(self, partitions: Iterable[Partition]) -> None:
        """Fetch ``partitions`` again, from where the member stands. Never raises."""
        ...

    def commit(self, offsets: dict[Partition, int]) -> None:
        """Commit next offsets synchronously. Raises TransientError when the commit failed."""
        ...

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """The next offset the source would deliver for each partition it has one for.

        Past transaction markers and other records that are never delivered, so
        when everything delivered is handled this is a safe commit offset. Local:
        no broker round trip. Never raises.
        """
        ...

    def committed(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        """The group's committed offsets of ``partitions`` (None: none committed). May query the broker;
        raises TransientError when it cannot."""
        ...

    def cached_high(self, partition: Partition) -> int | None:
        """The partition's log end as last seen (no broker round trip), None if unknown. Never raises."""
        ...

    def backlog(self, timeout_s: float) -> list[Backlog]:
        """Partitions of the subscribed topics, assigned to any member, whose records the group has not
        finished: records exist at or after the group's committed offset. May query the broker.
        Raises TransientError when it cannot tell."""
        ...

    def close(self) -> None:
        """Leave the group (an orderly revoke runs first). Idempotent."""
        ...


#: Builds the pipeline's source, subscribed, with its rebalance listener.
SourceFactory = Callable[[RebalanceListener], Source]
