"""The sink port: what the rest of ingest needs from a database backend, the same for every kind.

Two objects per sink kind:

- a :class:`SinkBackend` (one per kind, found in :mod:`ingest.sinks.registry`):
  builds sinks from settings, creates their tables (``migrate``), says which
  database they write (``identity``), and declares its :class:`Capabilities`
  instead of being probed for them;
- a :class:`Sink` (one per pipeline, built by the backend): writes batches;

and, for exactly-once kinds, the :class:`OffsetStore` a backend gives the committer
(:mod:`ingest.runner.commits`). The port imports no runner module: the runner depends on it.

Rows are tuples in the sink's column order (``settings.columns``); the table a
batch goes to is the sink's destination (``settings.table`` today). A batch has
already been collapsed to one row per key (:mod:`ingest.core.collapse`).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ingest.types import Failure, Item, Partition

if TYPE_CHECKING:
    from ingest.config import PipelineSettings
    from ingest.config.base import SinkSettingsBase
    from ingest.dlq.base import DeadLetterQueue

#: Runs inside the sink's transaction, after the rows (given the backend's connection object).
InTransaction = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class ExactlyOnceResult:
    """What one exactly-once lane transaction did."""

    rows_written: int
    #: the batch's poison records, dead-lettered in the same transaction
    dead_letters: list[Any]
    write_calls: int
    #: records an earlier incarnation had already written (skipped)
    already_written: int
    #: of rows_written, the rows that deleted their key (ingest.cdc)
    rows_deleted: int = 0
    #: the rows written (items), for per-table counts of pipelines that route to many tables
    written: Sequence[Any] = ()
    #: the items the database refused alone (dead-lettered at stage ``write``), for the same counts
    refused: Sequence[Any] = ()
    #: the batch's rows were written by its columnar write (:class:`ColumnarBatch`), not by rows
    columnar: bool = False


@dataclass(frozen=True, slots=True)
class ColumnarBatch:
    """A lane batch the columnar tier planned (``ingest.runner.columnar``), for the exactly-once
    transaction, whose items are unmapped: ``payload``, the sink's encoding of the batch's collapsed
    rows (``encode_columns``; ``rows`` of them); ``poison``, the records the row mapper refused, each
    with its failure; ``map_rows(items)``, the items mapped by the row mapper (with their row or
    failure; a transform's filter's drops left out), for when the transaction writes them by rows
    instead. The payload stands for every item of the batch: it may be written only when every
    item is to be written."""

    payload: Any
    rows: int
    poison: Sequence[tuple[Item, Failure]]
    map_rows: Callable[[Sequence[Item]], list[Item]]
    #: of ``rows``, the rows that delete their key (change events)
    deletes: int = 0


#: The exactly-once lane transaction: ``(lane, items, columnar=None)`` -> what it did; rows, DLQ rows and
#: offsets commit together. ``columnar``: the items are unmapped and the tier planned them (:class:`ColumnarBatch`).
ExactlyOnceFn = Callable[..., ExactlyOnceResult]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a sink kind can do; the rest of ingest reads these instead of probing adapters."""

    #: ``write(..., in_tx=fn)`` runs ``fn`` inside the rows' transaction (replay marks DLQ entries there).
    transactions: bool = False
    #: ``write(..., token=...)`` deduplicates a retried insert (the writer computes tokens only then).
    insert_tokens: bool = False
    #: ``sink.delivery: exactly_once`` is supported (offsets stored with the rows).
    exactly_once: bool = False
    #: ``sink.row_sources(keys)`` tells which record each row was last written from (replay's order
    #: guard), for tables whose settings say ``tracks_sources``.
    row_sources: bool = False
    #: ``write`` takes :class:`~ingest.types.DeleteRow` rows (change data capture, ``ingest.cdc``).
    deletes: bool = False
    #: ``use_columnar(columns)``, ``encode_columns(table) -> payload`` (pure, any thread) and
    #: ``write_encoded(payload, token=)`` write Arrow batches (``ingest.runner.columnar``);
    #: ``write_columns(table, token=)`` does both.
    columnar: bool = False


class OffsetStore(Protocol):
    """Where exactly-once offsets live (the sink's database; :meth:`SinkBackend.offset_store`); the
    committer (:mod:`ingest.runner.commits`) stores them there. Methods may raise TransientError."""

    def load(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """Stored next offsets of ``partitions`` (those without one are left out)."""
        ...

    def save(self, watermarks: dict[Partition, int]) -> None:
        """Store ``watermarks``; a stored offset never moves backwards."""
        ...

    def load_all(self) -> dict[Partition, int]:
        """Every stored offset of the pipeline (for ``ingest lag``)."""
        ...

    def close(self) -> None:
        """Release the connection. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class RowSource:
    """Which record a row in the table was last written from: its stream (topic and partition, hashed) and
    offset. ``None`` fields: the row exists but was written before ingest kept its source."""

    stream: int | None
    offset: int | None


class Sink(Protocol):
    """One pipeline's table. Safe to share between lanes (each call takes its own connection)."""

    def write(self, rows: Sequence[tuple[Any, ...]], *, token: str | None = None,
              in_tx: InTransaction | None = None) -> None:
        """Write ``rows`` in one transaction: all or nothing.

        ``token`` (see :func:`dedup_token`): identifies exactly which records the rows come
        from; passed only to sinks whose capabilities say ``insert_tokens``. ``in_tx``: runs
        inside the same transaction after the rows; only for ``transactions`` sinks.

        Blocks until committed. Raises :class:`~ingest.errors.TransientError` when retrying may
        help, :class:`~ingest.errors.PermanentError` when the data is at fault (both rolled
        back), :class:`~ingest.errors.UnclassifiedError` when neither; nothing else.
        """
        ...

    def warm_up(self) -> None:
        """Connect now so the first batch does not pay for it. Never raises (writes retry)."""
        ...

    def check(self) -> None:
        """Connect once and run a trivial query. Raises ServiceUnreachable (never naming a secret)."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


class SinkBackend(Protocol):
    """One sink kind: everything the CLI, the writer, replay and lag need to know about it."""

    kind: str
    capabilities: Capabilities

    def build(self, pipeline: PipelineSettings, *, lanes: int) -> Sink:
        """A sink for ``pipeline`` sized for ``lanes`` concurrent writers. No I/O yet."""
        ...

    def migrate(self, pipeline: PipelineSettings) -> list[str]:
        """Create (idempotently) the tables ``pipeline`` writes; returns lines of what was ensured.
        Raises ServiceUnreachable, ConfigError (an existing table that cannot work), MigrationError."""
        ...

    def identity(self, settings: SinkSettingsBase) -> str:
        """Which database the sink writes (pipelines sharing one share a write budget). Never printed."""
        ...

    def describe(self, settings: SinkSettingsBase) -> str:
        """A short, secret-free description for ``ingest check`` (e.g. ``table public.orders``)."""
        ...

    def offset_store(self, pipeline: PipelineSettings) -> OffsetStore | None:
        """Where exactly-once offsets live (None: the pipeline is not exactly-once)."""
        ...

    def exactly_once_writer(self, sink: Sink, pipeline: PipelineSettings, dlq: DeadLetterQueue) -> ExactlyOnceFn:
        """The exactly-once lane transaction (only for backends with ``capabilities.exactly_once``)."""
        ...


_tp_of = operator.attrgetter("record.topic", "record.partition")
_offset_of = operator.attrgetter("record.offset")


def dedup_token(pipeline: str, items: Iterable[Item]) -> str:
    """A deterministic insert token for the rows coming from ``items``.

    Derived from the pipeline name and the exact set of (topic, partition,
    offset) of the records: the same set gives the same token whatever the
    order, any other set another token. ``<pipeline>-<32 hex digits>``
    (BLAKE2b-128 over the sorted offsets per partition; see :func:`offsets_token`).
    """
    by_tp: dict[tuple[str, int], list[int]] = {}
    for tp, run in itertools.groupby(items, _tp_of):  # items come in runs of one partition
        offsets = by_tp.get(tp)
        if offsets is None:
            by_tp[tp] = list(map(_offset_of, run))
        else:
            offsets.extend(map(_offset_of, run))
    return offsets_token(pipeline, by_tp)


def offsets_token(pipeline: str, by_tp: Mapping[tuple[str, int], Sequence[int]]) -> str:
    """:func:`dedup_token` of the records at these offsets, given per (topic, partition) in any order
    (the lists are not changed)."""
    h = hashlib.blake2b(pipeline.encode(), digest_size=16)
    for (topic, partition) in sorted(by_tp):
        offsets = sorted(by_tp[(topic, partition)])  # already ascending within a lane batch: linear
        # Topic names cannot contain NUL; the fixed-width offsets make the encoding unambiguous.
        h.update(b"\0%s\0%d\0%d\0" % (topic.encode(), partition, len(offsets)))
        h.update(array("q", offsets).tobytes())
    return f"{pipeline}-{h.hexdigest()}"
