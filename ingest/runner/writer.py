"""The batch writer: what a lane does with one flushed batch.

For a batch of :class:`~ingest.types.Item`:

1. items that already failed (decode / map) are set aside for the DLQ;
2. the rest are collapsed by the sink's key (:mod:`ingest.core.collapse`: the
   record the sink would keep wins -- the latest, or the highest version, or the
   first for ``on_conflict: nothing``);
3. the rows are written with :func:`ingest.core.isolation.write_isolating`,
   each sink call retried on transient errors with exponential backoff and
   full jitter (tenacity); rows that fail alone become ``write`` failures;
4. every failure goes to the DLQ, retried the same way, and only when the DLQ
   write returned (durable) does the batch count as done;
5. a :class:`Completion` lists every (partition, epoch, offset) handled.

If retries run out (or the pipeline is aborting) the completion carries the
error and no offsets: nothing of that batch will be committed.

Steps 1-2 and the batch's bookkeeping (its size, its oldest timestamp, the
offsets it covers) need no database: :meth:`BatchWriter.prepare` does them, on
whichever thread calls it. The lane pool calls it on the pipeline thread when it
hands a batch over, so a lane spends its time on the database and the pipeline
thread plans the next batch while the lane waits for the server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager

from tenacity import Retrying

from ingest.config import RetrySettings
from ingest.core.collapse import CollapseRule, collapse
from ingest.core.isolation import write_groups_isolating
from ingest.dlq.base import DeadLetterQueue, DlqEntry
from ingest.errors import (
    FatalPipelineError,
    PermanentError,
    TransientError,
    UnclassifiedError,
)
from ingest.retry import retrying
from ingest.sinks.base import ColumnarBatch, ExactlyOnceFn, dedup_token, offsets_token
from ingest.types import DeleteRow, Failure, Item, Partition, Record

if TYPE_CHECKING:
    from ingest.runner.columnar import ColumnarPlanned, ColumnarTier

log = logging.getLogger(__name__)

#: A sink write: rows in one transaction (:meth:`ingest.sinks.base.Sink.write`).
WriteFn = Callable[..., None]


@dataclass(slots=True)
class Completion:
    """The outcome of one batch, reported by a lane to its pipeline thread."""

    lane: int
    reason: str
    #: offsets handled (written or durably dead-lettered), by (partition, epoch)
    done: dict[tuple[Partition, int], list[int]] = field(default_factory=dict)
    records: int = 0
    size_bytes: int = 0
    rows_written: int = 0
    #: of rows_written, the rows that deleted their key (ingest.cdc)
    rows_deleted: int = 0
    dead_lettered: Counter[tuple[str, str]] = field(default_factory=Counter)
    retries: int = 0
    write_calls: int = 0
    duration_s: float = 0.0
    #: of it, the seconds after planning: the writes (database round trips, retries, the DLQ) and their waits
    write_s: float = 0.0
    #: seconds planning the batch took (:meth:`BatchWriter.prepare`): in the pipeline thread, overlapping the
    #: lane's write of the batch before, when the lanes were handed a planned batch (else inside ``duration_s``)
    prepare_s: float = 0.0
    #: oldest record timestamp (ms) in the batch, for end-to-end latency
    min_timestamp_ms: int | None = None
    #: records found already written by an earlier run (exactly-once mode)
    skipped: int = 0
    #: seconds the batch waited for a write slot (None without a scheduler)
    queue_wait_s: float | None = None
    #: records of the batch written by the columnar tier (ingest.runner.columnar): all or none
    columnar_records: int = 0
    #: pipelines that route to many tables: rows written per table (None otherwise)
    rows_by_table: Counter[str] | None = None
    #: ... and the records of each table the database refused (dead-lettered at stage ``write``)
    refused_by_table: Counter[str] | None = None
    #: records of the batch a transform's filter dropped, by the filter's label (batches the columnar tier
    #: mapped: the row path drops them before batching); in ``done`` and ``records``
    filtered: Counter[str] = field(default_factory=Counter)
    #: records of the batch the row mapper handled without a row (ingest.cdc: a no-op tombstone, an ignored
    #: truncate) in a batch mapped at once: counted as ``skipped``, as the accept loop counts them; in ``done``
    unchanged: int = 0
    error: BaseException | None = None


@dataclass(slots=True)
class PreparedBatch:
    """A batch planned ahead of its write (:meth:`BatchWriter.prepare`); read-only once made."""

    items: Sequence[Item]
    size_bytes: int
    #: oldest record timestamp (ms) in the batch, for end-to-end latency
    min_timestamp_ms: int | None
    #: every item's offset by (partition, epoch): what the batch settles once written or dead-lettered
    done: dict[tuple[Partition, int], list[int]]
    #: at-least-once: the pre-failed items' DLQ entries and the groups to write (:meth:`BatchWriter.plan`);
    #: None with exactly-once, which plans inside its transaction (and for a batch the columnar tier took)
    failures: list[DlqEntry] | None
    groups: list[list[Item]] | None
    #: the columnar tier took the batch (its items are not mapped): the columnar write and its poison
    #: records (:meth:`ColumnarTier.build`); None: written by rows
    columnar: ColumnarPlanned | None = None
    #: unmapped items mapped here by rows: how many a transform's filter dropped (not in ``items``)
    filtered: Counter[str] = field(default_factory=Counter)
    #: ... and how many the row mapper handled without a row otherwise (not in ``items``)
    unchanged: int = 0
    #: seconds :meth:`BatchWriter.prepare` took (in the pipeline thread, while the lane wrote the batch before)
    prepare_s: float = 0.0


class BatchWriter:
    """Writes batches for one pipeline. Thread-safe: lanes share it, each call is independent."""

    def __init__(
        self,
        *,
        pipeline: str,
        write: WriteFn,
        dlq: DeadLetterQueue,
        retry: RetrySettings,
        collapse_rule: CollapseRule,
        abort: threading.Event,
        exactly_once: ExactlyOnceFn | None = None,
        insert_tokens: bool = False,
        columnar: ColumnarTier | None = None,
        routed: bool = False,
    ) -> None:
        """``insert_tokens``: the sink deduplicates inserts by token (its capabilities say so): pass
        ``token=`` (:func:`~ingest.sinks.base.dedup_token` of the records behind the rows) to ``write``.
        ``columnar``: the pipeline's columnar tier; its batches arrive unmapped (:attr:`maps_in_lane`) and
        :meth:`prepare` maps them (with ``exactly_once``, the batch the tier took is written in the
        exactly-once transaction: :class:`~ingest.sinks.base.ColumnarBatch`)."""
        self._columnar = columnar
        #: rows end with their table (ingest.mirror.router): completions count rows per table
        self._routed = routed
        self._pipeline = pipeline
        self._write = write
        self._pass_token = insert_tokens
        self._dlq = dlq
        self._retry = retry
        self._rule = collapse_rule
        self._abort = abort
        self._exactly_once = exactly_once
        self._dlq_lock = threading.Lock()
        self._dlq_pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: Called at every retry as it happens, on the retrying thread (the pipeline points it at
        #: ``ingest_retries_total``, so a batch that keeps retrying shows before it completes). Must not
        #: raise. A :class:`Completion`'s ``retries`` still counts the batch's retries for the summary.
        self.on_retry: Callable[[], None] | None = None

    @property
    def maps_in_lane(self) -> bool:
        """Items reach this writer unmapped (neither row nor failure): :meth:`prepare` maps them, a whole
        batch at once (the columnar tier) or record by record."""
        return self._columnar is not None

    @property
    def lane_keys(self) -> Callable[[Sequence[Record]], list[Any]] | None:
        """With :attr:`maps_in_lane`: what each of a chunk's records is routed to a lane by, as the row
        path routes it, or ``UNROUTED`` (:meth:`ColumnarPlan.lane_keys
        <ingest.core.mapping.columnar.ColumnarPlan.lane_keys>`); else None."""
        return self._columnar.lane_keys if self._columnar is not None else None

    def _retrying(self, what: str, counter: list[int]) -> Retrying:
        def count() -> None:
            counter[0] += 1
            if self.on_retry is not None:
                self.on_retry()

        return retrying(self._retry, what=what, context={"pipeline": self._pipeline}, on_retry=count,
                        should_stop=self._abort.is_set)

    # -- the batch -----------------------------------------------------------------
    def plan(self, items: Sequence[Item]) -> tuple[list[DlqEntry], list[list[Item]]]:
        """Split a batch into DLQ entries (pre-failed items) and candidate groups, one group per row to write.

        See :func:`ingest.core.collapse.collapse`: only a group's first candidate is written; the
        next is tried only if it fails alone (see ``write_groups_isolating``).
        """
        failed, groups = collapse(items, self._rule)
        pipeline = self._pipeline
        return [DlqEntry(pipeline, item.record, item.failure) for item in failed], groups  # type: ignore[arg-type]

    def prepare(self, items: Sequence[Item]) -> PreparedBatch:
        """Plan a batch without touching a database (pure; any thread): its bookkeeping and, at least
        once, its DLQ entries and groups -- or, unmapped items (:attr:`maps_in_lane`), the columnar
        tier's write, else the items mapped by rows and planned. :meth:`handle` takes the result (or
        plans there itself)."""
        started = time.perf_counter()
        prepared = self._prepare(items)
        prepared.prepare_s = time.perf_counter() - started
        return prepared

    def _prepare(self, items: Sequence[Item]) -> PreparedBatch:
        records = list(map(_record_of, items))
        # the records' fields the bookkeeping lists, which the columnar tier's plan reads too
        listed = {"topic": list(map(_topic_of, records)), "partition": list(map(_partition_of, records)),
                  "offset": list(map(_offset_of, records))}
        done: dict[tuple[Partition, int], list[int]] = {}
        _collect_done(listed["topic"], listed["partition"], listed["offset"], list(map(_epoch_of, items)), done)
        stamps = list(map(_timestamp_of, records))
        if None in stamps:
            stamps = [t for t in stamps if t is not None]
        size, oldest = sum(map(_size_of, items)), min(stamps, default=None)
        tier = self._columnar
        if tier is not None:
            planned = tier.build(items, records, listed)
            if planned is not None:
                return PreparedBatch(items, size, oldest, done, None, None, planned)
            items, filtered, unchanged = tier.map_items(items)
            failures, groups = self.plan(items) if self._exactly_once is None else (None, None)
            return PreparedBatch(items, size, oldest, done, failures, groups, filtered=filtered, unchanged=unchanged)
        failures, groups = self.plan(items) if self._exactly_once is None else (None, None)
        return PreparedBatch(items, size, oldest, done, failures, groups)

    def handle(self, lane: int, batch: Sequence[Item] | PreparedBatch, reason: str,
               slot: Callable[[], ContextManager[float]] | None = None) -> Completion:
        """Write one batch (its items, or what :meth:`prepare` made of them); never raises (errors are
        returned in the completion).

        ``slot``: the write scheduler's grant for this lane (a context manager
        yielding the seconds waited). Only the database part runs inside it;
        planning (dedupe) happens before, so a slot is held for writing only.
        """
        started = time.perf_counter()
        prepared = batch if isinstance(batch, PreparedBatch) else self.prepare(batch)
        writing = time.perf_counter()
        items = prepared.items
        result = Completion(lane=lane, reason=reason, records=len(items), prepare_s=prepared.prepare_s)
        if prepared.columnar is not None:
            result.filtered = prepared.columnar.filtered
            result.unchanged = len(prepared.columnar.unchanged)
        elif prepared.filtered or prepared.unchanged:  # not in the items, but in the batch (the in-flight count)
            result.filtered = prepared.filtered
            result.unchanged = prepared.unchanged
            result.records += sum(prepared.filtered.values()) + prepared.unchanged
        result.size_bytes = prepared.size_bytes
        result.min_timestamp_ms = prepared.min_timestamp_ms
        retries = [0]
        try:
            grant = slot or _no_slot
            if self._exactly_once is not None:
                with grant() as waited_s:  # planning runs inside its transaction (after the offset check)
                    result.queue_wait_s = waited_s if slot else None
                    failures = self._handle_exactly_once(lane, items, result, retries, prepared.columnar)
            elif prepared.columnar is not None:
                failures = self._handle_columnar(prepared.columnar, items, prepared.done, result, retries, grant,
                                                 slot is not None)
            else:
                assert prepared.failures is not None and prepared.groups is not None
                failures = self._handle_at_least_once(prepared.failures, prepared.groups, result, retries, grant,
                                                      slot is not None)
            for entry in failures:
                result.dead_lettered[(entry.failure.stage, entry.failure.error_class)] += 1
            result.done = prepared.done
        except (TransientError, PermanentError) as exc:
            result.done.clear()
            result.error = FatalPipelineError(
                f"pipeline {self._pipeline!r}: gave up after retries: {exc}"
                if not self._abort.is_set()
                else f"pipeline {self._pipeline!r}: aborted",
                error_class=exc.error_class if not self._abort.is_set() else "aborted",
            )
        except UnclassifiedError as exc:  # neither retried nor bisected: stop, naming it
            result.done.clear()
            result.error = FatalPipelineError(f"pipeline {self._pipeline!r}: stopped: {exc}",
                                              error_class="unclassified")
        except Exception as exc:  # noqa: BLE001 - a bug must stop the pipeline, not kill the lane silently
            result.done.clear()
            log.exception("unexpected error in batch writer")
            result.error = exc
        result.retries = retries[0]
        done = time.perf_counter()
        result.duration_s, result.write_s = done - started, done - writing
        return result

    def _handle_at_least_once(self, failures: list[DlqEntry], groups: list[list[Item]], result: Completion,
                              retries: list[int], grant: Callable[[], ContextManager[float]],
                              scheduled: bool) -> list[DlqEntry]:
        failures = list(failures)  # the prepared batch stays as it was made
        with self._writing(grant, result, scheduled):
            self._write_and_dead_letter(failures, groups, result, retries)
        return failures

    @contextlib.contextmanager
    def _writing(self, grant: Callable[[], ContextManager[float]], result: Completion,
                 scheduled: bool) -> Iterator[None]:
        """The write slot (its wait noted in ``result``); TransientError when the pipeline aborts first."""
        with grant() as waited_s:
            result.queue_wait_s = waited_s if scheduled else None
            if self._abort.is_set():
                raise TransientError("aborted before writing", error_class="aborted")
            yield

    def _handle_columnar(self, planned: ColumnarPlanned, items: Sequence[Item],
                         done: dict[tuple[Partition, int], list[int]], result: Completion, retries: list[int],
                         grant: Callable[[], ContextManager[float]], scheduled: bool) -> list[DlqEntry]:
        """The columnar tier's write, then its poison records to the DLQ; when the write raises, every
        item mapped by rows and written by the row path instead (see ingest.runner.columnar). ``done``:
        the batch's offsets (:meth:`prepare`)."""
        tier = self._columnar
        assert tier is not None
        failures = [DlqEntry(self._pipeline, item.record, failure) for item, failure in planned.poison]
        kwargs = {}
        if self._pass_token:  # the records behind the rows: the row path's token for the same rows
            kwargs["token"] = self._columnar_token(planned, done)
        with self._writing(grant, result, scheduled):
            # The poison records go to the DLQ while the rows are written: two commits at once, not
            # one after the other (the lane is a columnar pipeline's bottleneck).
            dead_lettered = self._dlq_writes().submit(self._dead_letter, failures, retries) if failures else None
            try:
                tier.write(planned.payload, **kwargs)
                written = True
            except Exception as exc:  # noqa: BLE001 - the row path retries, isolates and classifies
                written = False
                log.info("columnar write failed (%s); writing the batch by rows", type(exc).__name__,
                         extra={"pipeline": self._pipeline, "error_class": getattr(exc, "error_class", None)})
            finally:
                if dead_lettered is not None:
                    dead_lettered.result()  # durable, or the DLQ's error (retries spent): the batch fails
        if not written:  # by rows, but for the poison records already in the DLQ (and the filtered ones)
            poisoned = {id(item) for item, _ in planned.poison}
            mapped, _, _ = tier.map_items([item for item in items if id(item) not in poisoned])
            rest, groups = self.plan(mapped)
            return failures + self._handle_at_least_once(rest, groups, result, retries, grant, scheduled)
        result.write_calls = 1
        result.rows_written = planned.rows
        result.rows_deleted = planned.deletes
        result.columnar_records = len(items)
        if planned.rows_by_table is not None:  # a pipeline routing to many tables (RoutedColumnarTier)
            result.rows_by_table = planned.rows_by_table
        return failures

    def _columnar_token(self, planned: ColumnarPlanned, done: dict[tuple[Partition, int], list[int]]) -> str:
        """The insert token of a columnar batch: :func:`~ingest.sinks.base.dedup_token` of its records but
        the poison ones -- what the row path passes when it writes the same rows in one piece."""
        by_tp: dict[tuple[str, int], list[int]] = {}
        for (tp, _epoch), offsets in done.items():  # one epoch per partition, but for a rebalance
            by_tp.setdefault((tp.topic, tp.partition), []).extend(offsets)
        if planned.poison or planned.filtered_items or planned.unchanged:  # the rows come from the other records
            left_out: dict[tuple[str, int], set[int]] = {}
            for item in itertools.chain((item for item, _ in planned.poison), planned.filtered_items,
                                        planned.unchanged):
                left_out.setdefault((item.record.topic, item.record.partition), set()).add(item.record.offset)
            by_tp = {tp: [o for o in offsets if o not in left_out[tp]] if tp in left_out else offsets
                     for tp, offsets in by_tp.items()}
            by_tp = {tp: offsets for tp, offsets in by_tp.items() if offsets}
        return offsets_token(self._pipeline, by_tp)

    def _dlq_writes(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that writes a columnar batch's poison records while its lane writes the rows."""
        with self._dlq_lock:
            if self._dlq_pool is None:
                self._dlq_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"{self._pipeline}-dlq")
            return self._dlq_pool

    def _dead_letter(self, failures: list[DlqEntry], retries: list[int]) -> None:
        """``failures`` into the DLQ, retried on transient errors; returns once they are durable."""
        if failures:
            for attempt in self._retrying("dlq write", retries):
                with attempt:
                    self._dlq.put(failures)

    def _write_and_dead_letter(self, failures: list[DlqEntry], groups: list[list[Item]],
                               result: Completion, retries: list[int]) -> None:
        calls = [0]
        # The insert token covers every record behind the piece's rows (the whole key group), so the
        # same batch replayed in any order produces the same token.
        group_of: dict[int, list[Item]] = {}  # built only when a piece is smaller than the batch

        def records_behind(piece: Sequence[Item]) -> Iterable[Item]:
            if len(piece) == len(groups):  # one candidate of every group: the whole batch
                return itertools.chain.from_iterable(groups)
            if not group_of:
                group_of.update((id(item), group) for group in groups for item in group)
            return (it for c in piece for it in group_of[id(c)])

        def write_piece(piece: Sequence[Item]) -> None:
            batch_rows = [item.row for item in piece]
            kwargs = {}
            if self._pass_token:
                kwargs["token"] = dedup_token(self._pipeline, records_behind(piece))
            for attempt in self._retrying("sink write", retries):
                with attempt:
                    calls[0] += 1
                    self._write(batch_rows, **kwargs)

        written, poison = write_groups_isolating(groups, write_piece)
        result.write_calls = calls[0]
        for item, exc in poison:
            failures.append(DlqEntry(self._pipeline, item.record, Failure.from_write_error(exc)))
        result.rows_written = len(written)
        result.rows_deleted = sum(1 for item in written if isinstance(item.row, DeleteRow))
        if self._routed:
            result.rows_by_table = Counter(item.row[-1] for item in written)  # type: ignore[index]
            result.refused_by_table = Counter(item.row[-1] for item, _ in poison)  # type: ignore[index]
        self._dead_letter(failures, retries)

    def _handle_exactly_once(self, lane: int, items: Sequence[Item], result: Completion, retries: list[int],
                             planned: ColumnarPlanned | None = None) -> list[DlqEntry]:
        """One transaction for rows, DLQ entries and lane offsets (see ingest.sinks.postgres.exactly_once);
        ``planned``: the columnar tier took the batch (``items`` unmapped), written columnar in that
        transaction when it can be, else by rows there."""
        eo = self._exactly_once
        assert eo is not None
        kwargs = {}
        if planned is not None:
            tier = self._columnar
            assert tier is not None
            kwargs["columnar"] = ColumnarBatch(planned.payload, planned.rows, planned.poison,
                                               lambda unmapped: tier.map_items(unmapped)[0], planned.deletes)
        for attempt in self._retrying("exactly-once batch", retries):
            with attempt:
                done = eo(lane, items, **kwargs)
        result.rows_written = done.rows_written
        result.rows_deleted = done.rows_deleted
        if self._routed:
            result.rows_by_table = Counter(item.row[-1] for item in done.written)
            result.refused_by_table = Counter(item.row[-1] for item in done.refused)
        result.write_calls = done.write_calls
        result.skipped = done.already_written
        result.columnar_records = len(items) if done.columnar else 0
        return done.dead_letters


_size_of = operator.attrgetter("size_bytes")
_record_of = operator.attrgetter("record")
_epoch_of = operator.attrgetter("epoch")
_timestamp_of = operator.attrgetter("timestamp_ms")
_topic_of = operator.attrgetter("topic")
_partition_of = operator.attrgetter("partition")
_offset_of = operator.attrgetter("offset")


def _collect_done(topics: list[str], partitions: list[int], offsets: list[int], epochs: list[int],
                  done: dict[tuple[Partition, int], list[int]]) -> None:
    """Add every item's offset to ``done[(partition, epoch)]``, a run of one partition at a time
    (the batch's items' topics, partitions, offsets and epochs, in order). Per item, only C calls:
    the runs are found by comparing neighbours' partitions (and, when the batch mixes them, topics
    and epochs) with ``map``."""
    n = len(offsets)
    if n == 0:
        return
    changed = map(operator.ne, partitions, itertools.islice(partitions, 1, None))
    if epochs.count(epochs[0]) != n:
        changed = map(operator.or_, changed, map(operator.ne, epochs, itertools.islice(epochs, 1, None)))
    if topics.count(topics[0]) != n:
        changed = map(operator.or_, changed, map(operator.ne, topics, itertools.islice(topics, 1, None)))
    starts = [0, *itertools.compress(range(1, n), changed)]
    for start, end in zip(starts, [*starts[1:], n], strict=True):
        key = (Partition(topics[start], partitions[start]), epochs[start])
        known = done.get(key)
        if known is None:
            done[key] = offsets[start:end]
        else:
            known.extend(offsets[start:end])


@contextlib.contextmanager
def _no_slot() -> Iterator[float]:
    yield 0.0
