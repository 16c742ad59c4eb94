"""Values that flow through a pipeline.

Vocabulary used everywhere in this package:

- *offset* of a record: its position in the partition log.
- *next offset* / *watermark*: the offset of the next record to read, which is
  what Kafka commits. A committed watermark ``w`` means every record with
  offset ``< w`` is durably in the sink or in the DLQ.
- *epoch*: a counter bumped each time a partition is (re)assigned to this
  consumer, so completions from an earlier assignment are recognised as stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec


class Partition(NamedTuple):
    """A topic partition. Hashable, cheap, usable as a dict key."""

    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]"


Headers = tuple[tuple[str, bytes | None], ...]

#: The header ``replay-dlq --to topic`` adds: ``<topic>/<partition>/<offset>`` of the original record.
REPLAY_OF_HEADER = "ingest.replay_of"


def origin_of(headers: Headers) -> tuple[str, int, int] | None:
    """The original position a republished record carries (``ingest.replay_of``), or None. Never raises."""
    for name, value in headers:
        if name == REPLAY_OF_HEADER and value:
            topic, _, rest = value.decode("utf-8", "replace").rpartition("/")
            topic, _, partition = topic.rpartition("/")
            try:
                return topic, int(partition), int(rest)
            except ValueError:
                return None
    return None


class Record(msgspec.Struct, gc=False):
    """One consumed Kafka message, exactly as the broker delivered it.

    Treat as immutable; :func:`msgspec.structs.replace` makes a changed copy. A msgspec Struct, not
    a dataclass: one is built per consumed message, and a Struct is built in C (measured: 61 ns
    against 169 ns for a slotted dataclass of these fields) and, holding no reference cycles
    (``gc=False``: strings, numbers, bytes and tuples of them only), is never tracked by the
    garbage collector.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None
    headers: Headers = ()
    #: a record ``replay-dlq --to topic`` republished: where it was first read (topic, partition,
    #: offset), from its ``ingest.replay_of`` header. It stands in for that record: ``@topic``,
    #: ``@partition``, ``@offset`` and the row's source are the origin's; tracking and commits use
    #: the record's own position.
    origin: tuple[str, int, int] | None = None

    @property
    def tp(self) -> Partition:
        return Partition(self.topic, self.partition)

    @property
    def source_position(self) -> tuple[str, int, int]:
        """(topic, partition, offset) the record stands for: its origin when republished, else its own."""
        return self.origin if self.origin is not None else (self.topic, self.partition, self.offset)

    @property
    def size_bytes(self) -> int:
        """Approximate in-memory payload size: key + value + header bytes."""
        size = len(self.key or b"") + len(self.value or b"")
        for name, val in self.headers:
            size += len(name) + len(val or b"")
        return size


@dataclass(slots=True, frozen=True)
class Failure:
    """Why a record could not be written. Travels with the record to the DLQ.

    ``stage`` is where it failed: ``decode`` (bytes are not valid JSON /
    UTF-8), ``map`` (valid JSON that does not fit the columns) or ``write``
    (the database rejected the row on its own).
    """

    stage: str
    error_class: str
    message: str
    sqlstate: str | None = None

    @classmethod
    def from_write_error(cls, exc: Any) -> Failure:
        """The failure of a row the database rejected on its own (a PermanentError)."""
        return cls("write", exc.error_class, str(exc), exc.sqlstate)


class Item(msgspec.Struct, gc=False):
    """A record on its way through a lane: its mapped row, or why it has none.

    Exactly one of ``row`` and ``failure`` is set, or neither while the record is not mapped yet
    (the columnar tier maps a whole batch when it is handed to its lane: ``ingest.runner.columnar``). ``epoch`` is the
    assignment epoch of the record's partition when it was consumed. One is built per record: a
    C-built msgspec Struct like :class:`Record`, untracked by the garbage collector (its row holds
    column values, its failure strings: no cycles).
    """

    record: Record
    row: tuple[Any, ...] | None
    failure: Failure | None
    epoch: int
    size_bytes: int


class DeleteRow(tuple):  # type: ignore[type-arg]
    """A row that deletes its key: a change stream's delete (``ingest.cdc``).

    The same width and positions as the sink's rows, so collapsing and routing treat it like any
    row; only the key columns, the version column and the hidden source columns hold values (the
    rest is each column's filler: ``None``, or the zero value a ClickHouse column needs). A sink
    tells it from an upsert by ``isinstance(row, DeleteRow)``.
    """

    __slots__ = ()


class ImageDeleteRow(DeleteRow):
    """A soft delete that also carries the row's values: the batch held an upsert of the key before
    its delete (:mod:`ingest.core.collapse`, ``merge_deletes``), so the sink writes that row, marked
    deleted, as applying both one by one would have left it."""

    __slots__ = ()


class FamilyRow(tuple):  # type: ignore[type-arg]
    """A parent row and the child rows its record's ``explode`` steps made (``ingest.core.transforms``).

    The row itself is the parent table's, like any row; ``families`` holds, per explode step in order,
    None where the step did not apply to the record (its ``when`` did not hold: the parent's children
    are left as they are), else ``(link, rows)``: the parent link values in the order of the step's
    ``parent`` columns (coerced to their types) and the child rows (the child table's columns, one
    per element, keys distinct). The sink writes them all in one transaction (``ingest.sinks.postgres.children``).
    No ``__slots__``: instances carry ``families`` (set once, by the mapper).
    """

    families: tuple[tuple[tuple[Any, ...], list[tuple[Any, ...]]] | None, ...]
