"""The pipeline loop: consume → map → route to lanes → write → commit watermarks.

Threads and ownership
---------------------
One *pipeline thread* owns the source, the mapper, the per-lane ring batchers
and the offset tracker; nothing else touches them, so none of them needs a
lock. Each of the pipeline's ``lanes`` writes its batches strictly in order
(:mod:`ingest.runner.lanes`; one key always hashes to the same lane, so one key
is always written in order) and reports a :class:`~ingest.runner.writer.Completion`.

Ordering that must hold (and does, by construction)
---------------------------------------------------
``track(offset)`` when consumed → batch written (transient errors retried) →
poison rows durably in the DLQ → completion → ``done(offset)`` → the commit of
the contiguous watermark, on a timer (``commit_interval_ms``), synchronously,
from the pipeline thread (:mod:`ingest.runner.commits`). An offset is never
committed before every record below it is in the sink or the DLQ.

Backpressure
------------
Records between ``track`` and ``done`` are *in flight*. When more than
``max_buffered_records`` / ``max_buffered_bytes`` are in flight the consumer
pauses every assigned partition and keeps polling (so it stays in its group);
it resumes below 80 % of both bounds. Memory is bounded by those limits plus
one ``poll`` batch and the client's prefetch.

Rebalance
---------
On revoke: every batcher is flushed, the pipeline waits (bounded by
``shutdown_timeout_s``) until the revoked partitions have nothing in flight,
commits their watermarks synchronously, then drops their tracker state. On
lost: the partitions' tracker state is dropped at once (another member may own
them). On assign: a fresh tracker epoch per partition; completions stamped with
an older epoch are ignored.

Shutdown
--------
``stop`` (first SIGTERM/SIGINT): stop fetching, flush every batcher, wait for
the lanes (bounded by ``shutdown_timeout_s``), final synchronous commit, close
the source. ``abort`` (second signal, or the timeout): stop waiting, commit
only what is already done, close.

Stepping
--------
:meth:`Pipeline.run` is ``start()``, ``step()`` until it returns False, then
``finish()``. Tests drive the same three with a scripted source
(:mod:`ingest.sources.memory`), a deterministic lane pool and a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ingest.cdc.mapper import ChangeMapper, mapper_for
from ingest.config import PipelineSettings
from ingest.core.batcher import FlushReason
from ingest.core.dlq_guard import DlqGuard
from ingest.core.hotkeys import LaneLoad
from ingest.core.mapping import Mapper
from ingest.core.offsets import OffsetTracker
from ingest.errors import FatalPipelineError, TransientError
from ingest.formats.base import Decoder, prepare_all
from ingest.metrics import Metrics, PipelineMetrics
from ingest.retry import retrying
from ingest.runner.accept import Acceptor
from ingest.runner.batching import LaneBatchers
from ingest.runner.commits import Committer
from ingest.runner.drain import DrainWatch, describe
from ingest.runner.flow import Flow, Signal
from ingest.runner.hold import DecodeHold
from ingest.runner.lanes import LanePool, ThreadedLanes
from ingest.runner.observe import Observer
from ingest.runner.stats import PipelineStats
from ingest.scheduler import WriteScheduler
from ingest.sinks.base import OffsetStore
from ingest.sources.base import Source, SourceFactory
from ingest.status import error_class_of
from ingest.types import Partition
from ingest.runner.writer import BatchWriter, Completion

log = logging.getLogger(__name__)

def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How the loop polls and when it ends (from the CLI and the ``kafka`` section)."""

    consume_batch_size: int = 5000
    poll_timeout_ms: int = 100
    #: ``--until-idle``: finish once the group drained the topics and nothing arrived for this long
    until_idle_s: float | None = None
    #: ``--drain-timeout``: give up (fail) after waiting this long for the group to drain (10 x idle)
    drain_timeout_s: float | None = None


class Pipeline:
    """Runs one pipeline until stopped. Built by the composition root (``ingest.cli``)."""

    def __init__(
        self,
        settings: PipelineSettings,
        *,
        source_factory: SourceFactory,
        writer: BatchWriter,
        stop: threading.Event,
        abort: threading.Event,
        options: RunOptions = RunOptions(),
        lanes: LanePool | None = None,
        decoder: Decoder | None = None,
        key_decoder: Decoder | None = None,
        mapper: Mapper | ChangeMapper | None = None,
        metrics: PipelineMetrics | None = None,
        offset_store: OffsetStore | None = None,
        scheduler: WriteScheduler | None = None,
        on_progress: Callable[[PipelineStats], None] | None = None,
        clock: Callable[[], int] = monotonic_ms,
    ) -> None:
        self.settings = settings
        self.stats = PipelineStats()
        self.metrics = metrics or Metrics().pipeline(settings.name)
        writer.on_retry = self.metrics.retries.inc
        self._health = self.metrics.health
        #: what GET /status reports (ingest.status); the state is set once per loop turn
        self._status = self.metrics.status
        self._source_factory = source_factory
        self._stop = stop
        self._abort = abort
        self._options = options
        self._on_progress = on_progress
        self._clock = clock
        self._poll_timeout_s = options.poll_timeout_ms / 1000
        self._drain = (None if options.until_idle_s is None
                       else DrainWatch(settings.name, options.until_idle_s, options.drain_timeout_s))

        prepare = prepare_all(decoder, key_decoder)
        self._tracker: OffsetTracker[Partition] = OffsetTracker()
        self._lanes: LanePool = lanes or ThreadedLanes(settings.name, settings.lanes, writer,
                                                       scheduler=scheduler, priority=settings.priority)
        self._guard = DlqGuard(settings.dlq.max_ratio, settings.dlq.max_consecutive, settings.dlq.window)
        self._committer = Committer(settings.name, self._tracker, self.stats, self.metrics, offset_store)
        self._exactly_once = offset_store is not None
        now = clock()
        self._load = LaneLoad(settings.lanes)
        self._observer = Observer(settings.name, self.metrics, self._load, hot_key_share=settings.hot_key_share,
                                  hot_key_interval_s=settings.hot_key_interval_s, now_ms=now)

        self._source: Source | None = None
        self._flow = Flow(settings.name, settings.lanes, settings.max_buffered_records, settings.max_buffered_bytes,
                          stats=self.stats, metrics=self.metrics)
        #: registry formats: chunks wait here for their schemas while the registry cannot answer
        self._hold = (DecodeHold(settings.name, prepare, settings.retry, self._flow,
                                 on_error=lambda exc: self._status.error(error_class_of(exc), str(exc)))
                      if prepare is not None else None)
        self._batching = LaneBatchers(settings.lanes, settings.batch, pool=self._lanes, flow=self._flow,
                                      stats=self.stats, metrics=self.metrics, clock=clock)
        #: maps, tracks and routes each polled chunk (the hot path)
        self._acceptor = Acceptor(settings, mapper or mapper_for(settings, decoder=decoder, key_decoder=key_decoder),
                                  tracker=self._tracker, batching=self._batching, load=self._load, stats=self.stats,
                                  metrics=self.metrics, deterministic=offset_store is not None,
                                  defer_mapping=writer.maps_in_lane, lane_keys=writer.lane_keys)
        self._last_commit_ms = 0
        self._last_activity_ms = 0
        self._assigned_once = False
        self._closing = False
        self._fatal: BaseException | None = None
        #: an unexpected exception out of step() (re-raised as is; reported by GET /status)
        self._crash: BaseException | None = None
        self._crashed = False

    @property
    def last_load_report(self) -> object:
        """The last hot-key / hot-lane report (see :class:`ingest.core.hotkeys.LoadReport`)."""
        return self._observer.last_report

    # -- rebalance (the RebalanceListener protocol; called inside source.poll) ---------
    def on_assign(self, partitions: list[Partition]) -> dict[Partition, int] | None:
        seek_to: dict[Partition, int] | None = None
        store = self._committer.offset_store
        if store is not None:
            # Exactly-once: the database, not Kafka, says where to resume.
            for attempt in retrying(self.settings.retry, what="load stored offsets", should_stop=self._abort.is_set):
                with attempt:
                    seek_to = store.load(partitions)
        for tp in partitions:
            self._tracker.assign(tp)
        self._committer.assigned(partitions)
        if seek_to:
            self._committer.seeked(seek_to)
        self._assigned_once = self._assigned_once or bool(partitions)
        self._last_activity_ms = self._clock()
        self._set_assigned()
        log.info("partitions assigned", extra={"pipeline": self.settings.name, "partitions": [str(p) for p in partitions],
                                               "seek_to": {str(k): v for k, v in (seek_to or {}).items()}})
        return seek_to

    def on_revoke(self, partitions: list[Partition]) -> None:
        log.info("partitions revoked", extra={"pipeline": self.settings.name, "partitions": [str(p) for p in partitions]})
        assert self._source is not None
        if not self._closing:
            self._batching.flush_all(FlushReason.REVOKE)
            assigned = set(self._tracker.partitions())
            self._wait_for(lambda: all(self._tracker.in_flight(tp) == 0 for tp in partitions if tp in assigned))
        self._committer.commit(self._source, only=set(partitions), to_position=False)
        self._forget(partitions)

    def on_lost(self, partitions: list[Partition]) -> None:
        log.warning("partitions lost", extra={"pipeline": self.settings.name, "partitions": [str(p) for p in partitions]})
        self._forget(partitions)
        self._batching.drop(set(partitions))

    @property
    def _all_tracked(self) -> bool:
        """Every record the source delivered is tracked -- none held for its schema -- so an idle
        partition's watermark may move up to the source's position (ingest.runner.commits)."""
        return not self._crashed and (self._hold is None or not self._hold.active)

    def _forget(self, partitions: list[Partition]) -> None:
        if self._hold is not None:
            self._hold.forget(partitions)
        for tp in partitions:
            self._tracker.revoke(tp)
            self.metrics.drop_lag(tp.topic, tp.partition)
        self._observer.forget(partitions)
        self._set_assigned()

    def _set_assigned(self) -> None:
        self._health.assigned = len(self._tracker.partitions())
        self.metrics.assigned.set(self._health.assigned)

    # -- the loop --------------------------------------------------------------------
    def run(self) -> PipelineStats:
        """Consume until stopped, idle (``until_idle_s``) or failed.

        Raises FatalPipelineError when the pipeline cannot continue (retries
        exhausted, DLQ guard tripped); offsets of unhandled records are never
        committed in that case.
        """
        self.start()
        try:
            while self.step():
                pass
        except BaseException as exc:
            self._crashed = True  # a chunk may be half tracked: commit no position past it
            self._crash = exc
            raise
        finally:
            self.finish()
        return self.stats

    def start(self) -> None:
        """Start the lanes and build (subscribe) the source."""
        self._lanes.start()
        self._source = self._source_factory(self)

    def step(self) -> bool:
        """One turn of the loop: completions, backpressure, one poll, flush timers, the commit tick.

        Returns False when the loop should end (stopped, idle, or failed).
        """
        source = self._source
        assert source is not None
        try:
            if self._stop.is_set() or self._fatal is not None:
                return False
            self._health.tick()
            self._drain_completions()
            if self._fatal is not None:
                return False
            if self._flow.regulate(source) is Signal.RESUMED:
                self._last_activity_ms = self._clock()
            records = source.poll(self._options.consume_batch_size, self._poll_timeout_s)
            now_ms = self._clock()
            if records:
                self._observer.consumed(records, now_ms)
            if self._hold is not None and (records or self._hold.active):
                held = self._hold.active
                if held:  # only records of partitions still owned join a hold
                    records = [r for r in records if self._tracker.epoch(Partition(r.topic, r.partition)) is not None]
                records = self._hold.admit(records, now_ms)
                if held or self._hold.active:
                    self._last_activity_ms = now_ms  # holding is not idling
            if records:
                self._last_activity_ms = now_ms
                if self.stats.first_record_s is None:
                    self.stats.first_record_s = time.monotonic()
                self._acceptor.accept(records, now_ms)
            self._batching.flush_due(now_ms)
            self._set_state()
            if now_ms - self._last_commit_ms >= self.settings.commit_interval_ms:
                self._drain_completions()
                self._committer.commit(source, to_position=self._all_tracked)
                self._last_commit_ms = now_ms
                self._observe(now_ms)
                if self._on_progress is not None:
                    self._on_progress(self.stats)
            return not self._finished(now_ms, source)
        except (TransientError, FatalPipelineError) as exc:  # retries ran out; a registry holding nothing
            self._crashed = True  # a chunk may be half tracked: commit no position past it
            self._fatal = FatalPipelineError(f"pipeline {self.settings.name!r}: {exc}",
                                             error_class=error_class_of(exc))
            return False

    def finish(self) -> PipelineStats:
        """Shut down (flush, wait, final commit, close the source); raise if the pipeline failed."""
        try:
            self._shutdown()
        finally:
            self._status.set_dead_lettered(self.stats.dead_lettered)
            self.metrics.ready.set(0)
            self._status.stopped(self._fatal if self._fatal is not None else self._crash)
        if self._fatal is not None:
            raise self._fatal if isinstance(self._fatal, FatalPipelineError) else FatalPipelineError(str(self._fatal))
        return self.stats

    # -- completions -----------------------------------------------------------------
    def _drain_completions(self, timeout_s: float | None = None) -> bool:
        """Apply finished batches to the tracker. Returns True if any arrived."""
        done = self._lanes.completed(timeout_s)
        for c in done:
            self._apply(c)
        return bool(done)

    def _apply(self, c: Completion) -> None:
        self._flow.completed(c.lane, c.records, c.size_bytes)
        self._health.sink_ok = c.error is None
        if c.error is not None:
            self._lanes.halt()
            self._status.error(error_class_of(c.error), str(c.error))
            if self._fatal is None:
                self._fatal = c.error
            log.error("batch failed", extra={"pipeline": self.settings.name, "lane": c.lane, "error": str(c.error)})
            return
        self.stats.count(c, self.metrics)
        self._acceptor.count_misses()  # a batch-mapped pipeline's records were mapped for this batch
        trip = self._guard.observe(c.records, sum(c.dead_lettered.values()))
        for (tp, epoch), offsets in c.done.items():
            self._tracker.done_many(tp, offsets, epoch)
        if trip and self._fatal is None:
            # The batch itself is handled (in the sink or DLQ) and may be committed; queued ones are dropped.
            self._lanes.halt()
            self.metrics.dlq_guard_tripped.set(1)
            self._fatal = FatalPipelineError(f"pipeline {self.settings.name!r}: DLQ guard tripped: {trip}",
                                             error_class="dlq_guard")

    def _wait_for(self, condition: Callable[[], bool]) -> bool:
        """Apply completions until ``condition`` holds, abort, a fatal error (the lanes are halted:
        nothing more completes), or shutdown_timeout_s passes."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        while not condition():
            if self._abort.is_set() or self._fatal is not None or time.monotonic() >= deadline:
                return False
            self._drain_completions(timeout_s=0.05)
        return True

    # -- flow control, gauges, idle ------------------------------------------------------
    def _set_state(self) -> None:
        """The state GET /status shows (ingest.status.STATES), from this loop turn's facts."""
        if not self._assigned_once:
            return  # still "starting"
        if self._hold is not None and self._hold.active:
            self._status.set_state("held")
        elif self._flow.paused:
            self._status.set_state("paused")
        else:
            self._status.set_state("running")

    def _observe(self, now_ms: int) -> None:
        assert self._source is not None
        h = self._health
        self.metrics.ready.set(1 if h.running and h.assigned > 0 and h.sink_ok else 0)
        self._status.set_dead_lettered(self.stats.dead_lettered)
        oldest = [*self._batching.oldest_ms(), *(d[0] for d in self._flow.dispatched_oldest_ms if d)]
        self._observer.observe(now_ms, tracker=self._tracker, source=self._source,
                               in_flight_records=self._flow.records, in_flight_bytes=self._flow.bytes,
                               lane_in_flight=self._flow.per_lane, oldest_ms=oldest)

    def _finished(self, now_ms: int, source: Source) -> bool:
        """``--until-idle``: True once the group drained the topics, or the drain timeout gave up
        (then the run fails, naming what is left; see :mod:`ingest.runner.drain`)."""
        drain = self._drain
        if drain is None:
            return False
        if not self._locally_idle(now_ms, drain.idle_ms):
            drain.busy()
            return False
        self._committer.commit(source, to_position=self._all_tracked)  # this member's own watermarks first
        verdict = drain.check(now_ms, source)
        if not verdict.done:
            return False
        if not verdict.failed:
            log.info("idle, stopping", extra={"pipeline": self.settings.name, "why": "the group drained the topics"})
            return True
        self.stats.undrained = [{"topic": b.partition.topic, "partition": b.partition.partition,
                                 "committed": b.committed, "behind": b.behind} for b in verdict.backlog]
        left = describe(verdict.backlog) or "the group's offsets could not be read"
        self._fatal = FatalPipelineError(
            f"pipeline {self.settings.name!r}: --until-idle: the group did not drain the topics within "
            f"{drain.drain_timeout_ms / 1000:g} s: {left}", error_class="drain_timeout")
        return True

    def _locally_idle(self, now_ms: int, idle_ms: int) -> bool:
        """This member has partitions, nothing in flight, is not paused, and nothing arrived for ``idle_ms``."""
        if not self._assigned_once or self._flow.paused:
            return False  # never assigned yet (closing now could wedge this broker's group), backpressure, held
        if not self._tracker.partitions():
            return False  # an empty assignment (a rebalance still settling) is not "drained"
        if self._flow.records > 0:
            return False
        return now_ms - self._last_activity_ms >= idle_ms

    def _shutdown(self) -> None:
        source = self._source
        assert source is not None
        self._closing = True
        self._status.set_state("draining")
        if not self._abort.is_set() and self._fatal is None:
            self._batching.flush_all(FlushReason.SHUTDOWN)
            if not self._wait_for(lambda: self._flow.records == 0):
                log.error("shutdown timeout: records still in flight are not committed",
                          extra={"pipeline": self.settings.name, "in_flight": self._flow.records})
        else:
            self._lanes.halt()
            self._drain_completions()
        self._committer.commit(source, to_position=self._all_tracked)
        self._lanes.close(None if self._abort.is_set() else self.settings.shutdown_timeout_s)
        source.close()
        self._health.running = False
        self._health.assigned = 0
        self.stats.finished_s = time.monotonic()
        self._flow.close()
