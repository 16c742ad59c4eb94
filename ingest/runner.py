"""The pipeline loop: consume → map → route to lanes → write → commit watermarks.

Threads and ownership
---------------------
One *pipeline thread* owns the Kafka consumer, the mapper, the per-lane ring
batchers and the offset tracker; nothing else touches them, so none of them
needs a lock. Each of the pipeline's ``lanes`` is a worker thread with its own
FIFO inbox: it writes its batches strictly in order (one key always hashes to
the same lane, so one key is always written in order) and reports a
:class:`~ingest.writer.Completion` back through a queue. Writes wait on the
database with the GIL released, so lanes overlap with decoding and mapping.

Ordering that must hold (and does, by construction)
---------------------------------------------------
``track(offset)`` when consumed → batch written (transient errors retried) →
poison rows durably in the DLQ → completion → ``done(offset)`` → the commit of
the contiguous watermark, on a timer (``commit_interval_ms``), synchronously,
from the pipeline thread. An offset is never committed before every record
below it is in the sink or the DLQ.

Backpressure
------------
Records between ``track`` and ``done`` are *in flight*. When more than
``max_buffered_records`` / ``max_buffered_bytes`` are in flight the consumer
pauses every assigned partition and keeps polling (so it stays in its group);
it resumes below 80 % of both bounds. Memory is bounded by those limits plus
one ``consume`` batch and librdkafka's prefetch (``queued.max.messages.kbytes``).

Rebalance
---------
On revoke: every batcher is flushed, the pipeline waits (bounded by
``shutdown_timeout_s``) until the revoked partitions have nothing in flight,
commits their watermarks synchronously, then drops their tracker state. On
assign: a fresh tracker epoch per partition; completions stamped with an older
epoch are ignored. Works for eager and cooperative assignors.

Shutdown
--------
``stop`` (first SIGTERM/SIGINT): stop fetching, flush every batcher, wait for
the lanes (bounded by ``shutdown_timeout_s``), final synchronous commit, close
the consumer. ``abort`` (second signal, or the timeout): stop waiting, commit
only what is already done, close.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ingest.config import PipelineSettings
from ingest.core.batcher import FlushReason, RingBatcher
from ingest.core.dlq_guard import DlqGuard
from ingest.core.hotkeys import LaneLoad, key_label
from ingest.core.mapping import Mapper
from ingest.core.offsets import OffsetTracker
from ingest.core.routing import LaneRouter
from ingest.errors import FatalPipelineError, InvalidRecord, TransientError
from ingest.metrics import Metrics, PipelineMetrics
from ingest.retry import retrying
from ingest.sources.kafka import KafkaSource
from ingest.types import Failure, Item, Partition, Record
from ingest.writer import BatchWriter, Completion

log = logging.getLogger(__name__)

_RESUME_FRACTION = 0.8
#: One record in this many feeds the hot-key sketch: shares stay unbiased, the cost per record drops 16×.
HOT_KEY_SAMPLE = 16


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass
class PipelineStats:
    """Counters of one pipeline run (owned by the pipeline thread)."""

    records_consumed: int = 0
    rows_written: int = 0
    dead_lettered: Counter[tuple[str, str]] = field(default_factory=Counter)
    skipped: int = 0
    #: exactly-once: records re-read after a restart that the database already had
    already_written: int = 0
    batches: int = 0
    flushes: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    write_calls: int = 0
    commits: int = 0
    paused_s: float = 0.0
    #: seconds each batch waited for a write slot (only with a write scheduler)
    queue_waits_s: list[float] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)
    #: when the first record arrived and when the last batch was handled (throughput window)
    first_record_s: float | None = None
    last_done_s: float | None = None
    finished_s: float | None = None

    @property
    def dead_lettered_total(self) -> int:
        return sum(self.dead_lettered.values())

    def rate_per_s(self) -> float:
        """Records per second between the first record and the last handled batch."""
        if self.first_record_s is None or self.last_done_s is None:
            return 0.0
        elapsed = self.last_done_s - self.first_record_s
        return self.records_consumed / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "records_consumed": self.records_consumed,
            "rows_written": self.rows_written,
            "dead_lettered": self.dead_lettered_total,
            "dead_lettered_by_class": {f"{k[0]}/{k[1]}": v for k, v in self.dead_lettered.items()},
            "skipped": self.skipped,
            "already_written": self.already_written,
            "batches": self.batches,
            "flushes": dict(self.flushes),
            "retries": self.retries,
            "write_calls": self.write_calls,
            "commits": self.commits,
            "paused_s": round(self.paused_s, 3),
            "rate_per_s": round(self.rate_per_s(), 1),
            "queue_wait_s": _percentiles(self.queue_waits_s),
            "busy_s": round((self.last_done_s or 0) - (self.first_record_s or 0), 3),
            # the same window on the system-wide monotonic clock, so --processes can merge it
            "busy_window_s": [self.first_record_s, self.last_done_s],
        }


def _percentiles(values: list[float]) -> dict[str, float] | None:
    """p50 / p95 / p99 / max of a sample (nearest rank), or None when empty."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 4)

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99), "max": round(ordered[-1], 4),
            "count": len(ordered)}


class Lane(threading.Thread):
    """A worker that writes its batches in FIFO order and reports completions.

    With a write scheduler, each batch first waits for a slot of its database
    (priority with aging); a lane never holds more than one.
    """

    def __init__(self, index: int, pipeline: str, writer: BatchWriter, completions: queue.SimpleQueue[Completion],
                 scheduler: Any | None = None, priority: int = 0, halt: threading.Event | None = None) -> None:
        super().__init__(name=f"{pipeline}-lane-{index}", daemon=True)
        self.index = index
        self._pipeline = pipeline
        self._writer = writer
        self._completions = completions
        self._scheduler = scheduler
        self._priority = priority
        #: set when the pipeline failed or aborts: queued batches are dropped, not written
        #: (they are not committed; a restart reads them again)
        self._halt = halt or threading.Event()
        self.inbox: queue.SimpleQueue[tuple[list[Item], str] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.inbox.get()
            if job is None:
                return
            items, reason = job
            if self._halt.is_set():
                continue
            slot = self._slot if self._scheduler is not None else None
            completion = self._writer.handle(self.index, items, reason, slot)
            if completion.error is not None:
                # Stop this lane (and its siblings) before the next queued batch: writing later
                # batches past a failed one would, with exactly-once, move the lane offset past it.
                self._halt.set()
            self._completions.put(completion)

    @contextlib.contextmanager
    def _slot(self) -> Iterator[float]:
        """This lane's write slot; a pipeline that failed while the lane waited does not write."""
        assert self._scheduler is not None
        with self._scheduler.slot(self._pipeline, self._priority) as waited_s:
            if self._halt.is_set():
                raise TransientError("pipeline halted while waiting for a write slot", error_class="halted")
            yield waited_s


SourceFactory = Callable[..., KafkaSource]


class Pipeline:
    """Runs one pipeline until stopped. Construct in the composition root (cli)."""

    def __init__(
        self,
        settings: PipelineSettings,
        *,
        source_factory: SourceFactory,
        writer: BatchWriter,
        stop: threading.Event,
        abort: threading.Event,
        consume_batch_size: int = 5000,
        poll_timeout_ms: int = 100,
        until_idle_s: float | None = None,
        on_progress: Callable[[PipelineStats], None] | None = None,
        metrics: PipelineMetrics | None = None,
        offset_store: Any | None = None,
        scheduler: Any | None = None,
    ) -> None:
        self.settings = settings
        self.stats = PipelineStats()
        self.metrics = metrics or Metrics().pipeline(settings.name)
        self._health = self.metrics.health
        #: exactly-once mode: where the contiguous watermark lives (ingest.exactly_once.StoredOffsets)
        self._offset_store = offset_store
        #: stored offsets seeked to on assignment, to be committed to Kafka for lag tooling
        self._advisory_commits: dict[Partition, int] = {}
        self._source_factory = source_factory
        self._writer = writer
        self._stop = stop
        self._abort = abort
        self._consume_batch_size = consume_batch_size
        self._poll_timeout_s = poll_timeout_ms / 1000
        self._until_idle_ms = None if until_idle_s is None else int(until_idle_s * 1000)
        self._on_progress = on_progress

        self._mapper = Mapper(settings.sink.columns, settings.key)
        self._router = LaneRouter(settings.lanes, settings.unkeyed)
        batch = settings.batch
        self._batchers: list[RingBatcher[Item]] = [
            RingBatcher(batch.max_rows, batch.max_bytes, batch.max_latency_ms) for _ in range(settings.lanes)
        ]
        self._tracker: OffsetTracker[Partition] = OffsetTracker()
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._halt = threading.Event()
        self._lanes = [Lane(i, settings.name, writer, self._completions, scheduler, settings.priority, self._halt)
                       for i in range(settings.lanes)]
        self._guard = DlqGuard(settings.dlq.max_ratio, settings.dlq.max_consecutive, settings.dlq.window)

        self._source: KafkaSource | None = None
        #: per lane, the time (monotonic ms) its oldest dispatched, unfinished batch began buffering
        self._dispatched_oldest_ms: list[collections.deque[int]] = [collections.deque() for _ in range(settings.lanes)]
        self._in_flight_records = 0
        self._in_flight_bytes = 0
        #: records in flight per lane (buffered + dispatched), for the hot-lane check
        self._lane_in_flight = [0] * settings.lanes
        #: hot-key sketch fed with every HOT_KEY_SAMPLE-th record (unbiased shares, bounded cost)
        self._load = LaneLoad(settings.lanes)
        self._rng = random.Random()
        self._sample_countdown = HOT_KEY_SAMPLE
        self._last_load_report_ms = monotonic_ms()
        self.last_load_report: Any = None
        self._paused = False
        self._paused_since_s = 0.0
        self._last_commit_ms = 0
        self._last_activity_ms = 0
        self._assigned_once = False
        self._closing = False
        self._fatal: BaseException | None = None

    # -- rebalance callbacks (run inside source.poll on this thread) ---------------
    def _on_assign(self, partitions: list[Partition]) -> dict[Partition, int] | None:
        seek_to: dict[Partition, int] | None = None
        if self._offset_store is not None:
            # Exactly-once: the database, not Kafka, says where to resume.
            for attempt in retrying(self.settings.retry, what="load stored offsets", should_stop=self._abort.is_set):
                with attempt:
                    seek_to = self._offset_store.load(partitions)
        for tp in partitions:
            self._tracker.assign(tp)
        if seek_to:
            # Kafka's (advisory) commit may lag the stored offsets after a crash: catch it up.
            self._advisory_commits.update(seek_to)
        self._assigned_once = self._assigned_once or bool(partitions)
        self._last_activity_ms = monotonic_ms()
        self._health.assigned = len(self._tracker.partitions())
        self.metrics.assigned.set(self._health.assigned)
        log.info("partitions assigned", extra={"pipeline": self.settings.name, "partitions": [str(p) for p in partitions],
                                               "seek_to": {str(k): v for k, v in (seek_to or {}).items()}})
        return seek_to

    def _on_revoke(self, partitions: list[Partition]) -> None:
        log.info("partitions revoked", extra={"pipeline": self.settings.name, "partitions": [str(p) for p in partitions]})
        if not self._closing:
            self._flush_all(FlushReason.REVOKE)
            self._wait_for(lambda: all(self._tracker.in_flight(tp) == 0 for tp in partitions if tp in self._tracker.partitions()))
        self._commit(only=set(partitions))
        for tp in partitions:
            self._tracker.revoke(tp)
            self.metrics.drop_lag(tp.topic, tp.partition)
        self._health.assigned = len(self._tracker.partitions())
        self.metrics.assigned.set(self._health.assigned)

    def _on_lost(self, partitions: list[Partition]) -> None:
        log.warning("partitions lost", extra={"pipeline": self.settings.name, "partitions": [str(p) for p in partitions]})
        for tp in partitions:
            self._tracker.revoke(tp)
            self.metrics.drop_lag(tp.topic, tp.partition)
        self._health.assigned = len(self._tracker.partitions())
        self.metrics.assigned.set(self._health.assigned)

    # -- main loop -------------------------------------------------------------------
    def run(self) -> PipelineStats:
        """Consume until stopped, idle (``until_idle_s``) or failed.

        Raises FatalPipelineError when the pipeline cannot continue (retries
        exhausted, DLQ guard tripped); offsets of unhandled records are never
        committed in that case.
        """
        for lane in self._lanes:
            lane.start()
        self._source = self._source_factory(
            on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        try:
            while not self._stop.is_set() and self._fatal is None:
                self._health.tick()
                self._drain_completions()
                if self._fatal is not None:
                    break
                self._apply_backpressure()
                records = self._source.poll(self._consume_batch_size, self._poll_timeout_s)
                now_ms = monotonic_ms()
                if records:
                    self._last_activity_ms = now_ms
                    if self.stats.first_record_s is None:
                        self.stats.first_record_s = time.monotonic()
                    self._accept(records, now_ms)
                self._flush_due(now_ms)
                if now_ms - self._last_commit_ms >= self.settings.commit_interval_ms:
                    self._drain_completions()
                    self._commit()
                    self._last_commit_ms = now_ms
                    self._observe(now_ms)
                    if self._on_progress is not None:
                        self._on_progress(self.stats)
                if self._idle(now_ms):
                    log.info("idle, stopping", extra={"pipeline": self.settings.name})
                    break
        except TransientError as exc:
            self._fatal = FatalPipelineError(f"pipeline {self.settings.name!r}: {exc}")
        finally:
            self._shutdown()
        if self._fatal is not None:
            raise self._fatal if isinstance(self._fatal, FatalPipelineError) else FatalPipelineError(str(self._fatal))
        return self.stats

    def _accept(self, records: list[Record], now_ms: int) -> None:
        """Track, map and route one polled chunk. The hot path: keep it lean.

        Offsets are tracked per run of one partition (records arrive in such runs)
        with one ``track_many`` call, before anything of the run can complete:
        completions are applied on this thread, after ``_accept`` returns.
        """
        tracker = self._tracker
        map_record = self._mapper.map
        lane_of = self._router.lane
        skip_tombstones = self.settings.tombstones == "skip"
        deterministic = self._offset_store is not None  # exactly-once needs replay-stable routing
        spread_unkeyed = self.settings.unkeyed == "round_robin"  # unkeyed records are not one hot key
        n_lanes = len(self._batchers)
        # This chunk's items and sizes per lane, handed to the batchers in bulk at the end.
        lane_items: list[list[Item]] = [[] for _ in range(n_lanes)]
        lane_sizes: list[list[int]] = [[] for _ in range(n_lanes)]
        self.stats.records_consumed += len(records)
        self.metrics.records_consumed.inc(len(records))
        topic: str | None = None
        partition = -1
        tp = Partition("", -1)
        epoch: int | None = None
        last_offset = -1
        run: list[int] = []
        skipped: list[tuple[Partition, int, int]] = []  # tombstones done at once: (tp, offset, epoch)
        for rec in records:
            if rec.partition != partition or rec.topic != topic:  # a new run of one partition
                if run:
                    tracker.track_many(tp, run)  # so that last_tracked below sees it
                    run = []
                topic, partition = rec.topic, rec.partition
                tp = Partition(topic, partition)
                epoch = tracker.epoch(tp)
                last = tracker.last_tracked(tp)
                last_offset = -1 if last is None else last
            if epoch is None:
                continue  # not assigned any more (revoked during this poll)
            offset = rec.offset
            if offset <= last_offset:
                log.warning("offset went backwards; ignoring redelivery", extra={"partition": str(tp), "offset": offset})
                continue
            last_offset = offset
            run.append(offset)
            value = rec.value
            if value is None and skip_tombstones:
                skipped.append((tp, offset, epoch))
                continue
            key_bytes = rec.key
            size = (len(value) if value is not None else 0) + (len(key_bytes) if key_bytes is not None else 0) + 64
            try:
                row, key = map_record(rec)
                item = Item(rec, row, None, epoch, size)
            except InvalidRecord as exc:
                item = Item(rec, None, Failure(exc.stage, exc.error_class, exc.message), epoch, size)
                key = key_bytes
            if n_lanes == 1:
                lane = 0
            else:
                lane = lane_of(key) if key is not None or not deterministic else offset % n_lanes
            lane_items[lane].append(item)
            lane_sizes[lane].append(size)
            self._sample_countdown -= 1
            if self._sample_countdown == 0:
                # A random gap (mean HOT_KEY_SAMPLE) so periodic key patterns cannot alias with the sampler.
                self._sample_countdown = self._rng.randint(1, 2 * HOT_KEY_SAMPLE - 1)
                if key is not None or not spread_unkeyed:
                    self._load.observe(lane, key, size)
        if run:
            tracker.track_many(tp, run)
        for skipped_tp, offset, skipped_epoch in skipped:
            tracker.done(skipped_tp, offset, skipped_epoch)
        self.stats.skipped += len(skipped)
        for lane, items in enumerate(lane_items):
            if items:
                self._buffer(lane, items, lane_sizes[lane], now_ms)

    def _buffer(self, lane: int, items: list[Item], sizes: list[int], now_ms: int) -> None:
        """Add a chunk's items for one lane to its batcher, dispatching each batch that fills up."""
        self._lane_in_flight[lane] += len(items)
        self._in_flight_records += len(items)
        self._in_flight_bytes += sum(sizes)
        batcher = self._batchers[lane]
        pos = 0
        while pos < len(items):
            pos, reason = batcher.add_many(items, sizes, now_ms, pos)
            if reason is not None:
                self._dispatch(lane, reason)

    def _dispatch(self, lane: int, reason: FlushReason) -> None:
        batcher = self._batchers[lane]
        oldest_ms = batcher.oldest_ms
        items = batcher.drain()
        if items:
            self.stats.flushes[reason.value] += 1
            self.metrics.flushed(reason.value)
            self._dispatched_oldest_ms[lane].append(oldest_ms if oldest_ms is not None else monotonic_ms())
            self._lanes[lane].inbox.put((items, reason.value))

    def _flush_due(self, now_ms: int) -> None:
        for lane, batcher in enumerate(self._batchers):
            reason = batcher.due(now_ms)
            if reason is not None:
                self._dispatch(lane, reason)

    def _flush_all(self, reason: FlushReason) -> None:
        for lane in range(len(self._batchers)):
            self._dispatch(lane, reason)

    def _drain_completions(self, timeout_s: float | None = None) -> bool:
        """Apply finished batches to the tracker. Returns True if any arrived."""
        got = False
        while True:
            try:
                c = self._completions.get(timeout=timeout_s) if (timeout_s and not got) else self._completions.get_nowait()
            except queue.Empty:
                return got
            got = True
            self._apply(c)

    def _apply(self, c: Completion) -> None:
        self._in_flight_records -= c.records
        self._in_flight_bytes -= c.size_bytes
        self._lane_in_flight[c.lane] -= c.records
        if self._dispatched_oldest_ms[c.lane]:
            self._dispatched_oldest_ms[c.lane].popleft()
        self._health.sink_ok = c.error is None
        if c.error is not None:
            self._halt.set()
            if self._fatal is None:
                self._fatal = c.error
            log.error("batch failed", extra={"pipeline": self.settings.name, "lane": c.lane, "error": str(c.error)})
            return
        stats = self.stats
        stats.batches += 1
        stats.last_done_s = time.monotonic()
        stats.rows_written += c.rows_written
        stats.dead_lettered.update(c.dead_lettered)
        stats.retries += c.retries
        stats.write_calls += c.write_calls
        stats.already_written += c.skipped
        if c.queue_wait_s is not None:
            stats.queue_waits_s.append(c.queue_wait_s)
        m = self.metrics
        m.batch_rows.observe(c.records)
        m.batch_bytes.observe(c.size_bytes)
        m.flush_seconds.observe(c.duration_s)
        m.rows_written.inc(c.rows_written)
        m.records_done.inc(c.records)
        m.retries.inc(c.retries)
        m.write_calls.inc(c.write_calls)
        for (stage, error_class), n in c.dead_lettered.items():
            m.dead_lettered(stage, error_class, n)
        if c.min_timestamp_ms is not None:
            m.e2e_latency.observe(max(0.0, time.time() - c.min_timestamp_ms / 1000))
        trip = self._guard.observe(c.records, sum(c.dead_lettered.values()))
        for (tp, epoch), offsets in c.done.items():
            self._tracker.done_many(tp, offsets, epoch)
        if trip and self._fatal is None:
            # The batch itself is handled (in the sink or DLQ) and may be committed; queued ones are dropped.
            self._halt.set()
            self._fatal = FatalPipelineError(f"pipeline {self.settings.name!r}: DLQ guard tripped: {trip}")

    def _wait_for(self, condition: Callable[[], bool]) -> bool:
        """Apply completions until ``condition`` holds, abort, or shutdown_timeout_s passes."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        while not condition():
            if self._abort.is_set() or time.monotonic() >= deadline:
                return False
            self._drain_completions(timeout_s=0.05)
        return True

    def _apply_backpressure(self) -> None:
        assert self._source is not None
        s = self.settings
        over = self._in_flight_records >= s.max_buffered_records or self._in_flight_bytes >= s.max_buffered_bytes
        if over and not self._paused:
            self._paused = True
            self._paused_since_s = time.monotonic()
            log.info("backpressure: pausing", extra={"pipeline": s.name, "in_flight": self._in_flight_records})
        if self._paused:
            # Re-pause every poll: partitions assigned while paused must not start flowing.
            self._source.pause(self._source.assignment())
            below = (
                self._in_flight_records < s.max_buffered_records * _RESUME_FRACTION
                and self._in_flight_bytes < s.max_buffered_bytes * _RESUME_FRACTION
            )
            if below:
                self._paused = False
                self._last_activity_ms = monotonic_ms()
                paused_s = time.monotonic() - self._paused_since_s
                self.stats.paused_s += paused_s
                self.metrics.paused_seconds.inc(paused_s)
                self._source.resume(self._source.assignment())

    def _commit(self, only: set[Partition] | None = None) -> None:
        assert self._source is not None
        candidates = self._tracker.commit_candidates()
        if only is not None:
            candidates = {tp: off for tp, off in candidates.items() if tp in only}
        if self._advisory_commits:
            self._commit_advisory(only)
        if not candidates:
            return
        if self._offset_store is not None:
            try:
                self._offset_store.save(candidates)
            except TransientError as exc:
                log.warning("storing offsets failed; will retry", extra={"pipeline": self.settings.name, "error": str(exc)})
                return
        try:
            self._source.commit(candidates)
        except TransientError as exc:
            log.warning("commit failed; will retry", extra={"pipeline": self.settings.name, "error": str(exc)})
            return
        self.stats.commits += 1
        self.metrics.commits.inc()
        for tp, off in candidates.items():
            self._tracker.mark_committed(tp, off)

    def _report_load(self, now_ms: int) -> None:
        """Every hot_key_interval_s: hot keys and hot lanes → metric and warning; then a new interval."""
        if now_ms - self._last_load_report_ms < self.settings.hot_key_interval_s * 1000:
            return
        self._last_load_report_ms = now_ms
        report = self._load.report(self.settings.hot_key_share, self._lane_in_flight)
        self.last_load_report = report
        for lane, stats in enumerate(report.lanes):
            self.metrics.set_hot_key_share(lane, stats.top_share)
        for hot in report.hot_keys:
            log.warning("hot key: one key dominates a lane; its records cannot be parallelised",
                        extra={"pipeline": self.settings.name, "lane": hot.lane, "key": key_label(hot.key),
                               "share": round(hot.share, 3)})
        if report.hot_lane is not None:
            log.warning("hot lane: one lane holds most of the backlog",
                        extra={"pipeline": self.settings.name, "lane": report.hot_lane,
                               "share": round(report.hot_lane_share, 3)})
        self._load.reset()

    def _observe(self, now_ms: int) -> None:
        """Refresh gauges (once per commit interval)."""
        self._report_load(now_ms)
        m = self.metrics
        m.buffered_records.set(self._in_flight_records)
        m.buffered_bytes.set(self._in_flight_bytes)
        m.offset_gaps.set(self._tracker.gap_count())
        oldest = [b.oldest_ms for b in self._batchers if b.oldest_ms is not None]
        oldest += [d[0] for d in self._dispatched_oldest_ms if d]
        m.oldest_unfinished_age.set((now_ms - min(oldest)) / 1000 if oldest else 0.0)
        assert self._source is not None
        for tp in self._tracker.partitions():
            high = self._source.cached_high(tp)
            mark = self._tracker.committed(tp)
            if high is not None and mark is not None:
                m.set_lag(tp.topic, tp.partition, max(0, high - mark))

    def _commit_advisory(self, only: set[Partition] | None) -> None:
        """Commit seeked-to stored offsets to Kafka (exactly-once mode) where no newer watermark exists yet."""
        assert self._source is not None
        pending = {tp: off for tp, off in self._advisory_commits.items()
                   if (only is None or tp in only) and tp in self._tracker.partitions()
                   and self._tracker.committed(tp) is None}
        if pending:
            try:
                self._source.commit(pending)
            except TransientError as exc:
                log.warning("advisory commit failed; will retry", extra={"pipeline": self.settings.name,
                                                                        "error": str(exc)})
                return
        for tp in list(self._advisory_commits):
            if only is None or tp in only:
                del self._advisory_commits[tp]

    def _idle(self, now_ms: int) -> bool:
        if self._until_idle_ms is None or not self._assigned_once:
            return False
        if self._paused:
            return False  # backpressure, not a drained topic
        if not self._tracker.partitions():
            # An empty assignment (e.g. a rebalance still settling) is not "drained"; closing now
            # could also leave this broker's group mid-join.
            return False
        if self._in_flight_records > 0:
            return False
        return now_ms - self._last_activity_ms >= self._until_idle_ms

    def _shutdown(self) -> None:
        assert self._source is not None
        self._closing = True
        if not self._abort.is_set() and self._fatal is None:
            self._flush_all(FlushReason.SHUTDOWN)
            if not self._wait_for(lambda: self._in_flight_records == 0):
                log.error("shutdown timeout: records still in flight are not committed",
                          extra={"pipeline": self.settings.name, "in_flight": self._in_flight_records})
        else:
            self._halt.set()
            self._drain_completions()
        self._commit()
        for lane in self._lanes:
            lane.inbox.put(None)
        if not self._abort.is_set():
            for lane in self._lanes:
                lane.join(timeout=max(0.1, self.settings.shutdown_timeout_s))
        self._source.close()
        self._health.running = False
        self._health.assigned = 0
        self.stats.finished_s = time.monotonic()
        if self._paused:
            self.stats.paused_s += time.monotonic() - self._paused_since_s
