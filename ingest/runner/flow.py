"""Records in flight and the backpressure they call for. Owned by the pipeline thread.

A record is *in flight* from the moment it is tracked until its batch's
completion is applied. When more than ``max_buffered_records`` records or
``max_buffered_bytes`` bytes are in flight, every assigned partition is paused
(the consumer keeps polling, so it stays in its group); below 80 % of both
bounds they resume. While :attr:`Flow.held` is set (records wait for their
schemas: :mod:`ingest.runner.hold`) they stay paused whatever the counts.
:meth:`Flow.regulate` is the signal: it says what it did, so the loop can count
it as activity.
"""

from __future__ import annotations

import collections
import enum
import logging
import time

from ingest.metrics import PipelineMetrics
from ingest.runner.stats import PipelineStats
from ingest.sources.base import Source

log = logging.getLogger(__name__)

RESUME_FRACTION = 0.8


class Signal(str, enum.Enum):
    """What :meth:`Flow.regulate` did to the source."""

    NONE = "none"
    PAUSED = "paused"
    RESUMED = "resumed"


class Flow:
    """In-flight counts (in all, per lane, the oldest dispatched batch per lane) and pause/resume."""

    def __init__(self, pipeline: str, lanes: int, max_records: int, max_bytes: int, *, stats: PipelineStats,
                 metrics: PipelineMetrics) -> None:
        self._pipeline = pipeline
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._stats = stats
        self._metrics = metrics
        self.records = 0
        self.bytes = 0
        #: records in flight per lane (buffered + dispatched), for the hot-lane check
        self.per_lane = [0] * lanes
        #: per lane, the time (clock ms) its oldest dispatched, unfinished batch began buffering
        self.dispatched_oldest_ms: list[collections.deque[int]] = [collections.deque() for _ in range(lanes)]
        self.paused = False
        #: records are held for their schemas: keep every partition paused
        self.held = False
        self._paused_since_s = 0.0

    def add(self, lane: int, records: int, size_bytes: int) -> None:
        self.per_lane[lane] += records
        self.records += records
        self.bytes += size_bytes

    def remove(self, lane: int, records: int, size_bytes: int) -> None:
        self.per_lane[lane] -= records
        self.records -= records
        self.bytes -= size_bytes

    def dispatched(self, lane: int, oldest_ms: int) -> None:
        self.dispatched_oldest_ms[lane].append(oldest_ms)

    def completed(self, lane: int, records: int, size_bytes: int) -> None:
        """A batch of ``lane`` finished (written, dead-lettered, or failed)."""
        self.remove(lane, records, size_bytes)
        if self.dispatched_oldest_ms[lane]:
            self.dispatched_oldest_ms[lane].popleft()

    def regulate(self, source: Source) -> Signal:
        """Pause every assigned partition above the bounds (or while held), resume below 80 % of both."""
        signal = Signal.NONE
        over = self.records >= self._max_records or self.bytes >= self._max_bytes
        if not self.paused and (over or self.held):
            self.paused = True
            self._paused_since_s = time.monotonic()
            signal = Signal.PAUSED
            if over:
                log.info("backpressure: pausing", extra={"pipeline": self._pipeline, "in_flight": self.records})
        if not self.paused:
            return signal
        # Re-pause every poll: partitions assigned while paused must not start flowing.
        source.pause(source.assignment())
        if (not self.held and self.records < self._max_records * RESUME_FRACTION
                and self.bytes < self._max_bytes * RESUME_FRACTION):
            self.paused = False
            self._count_pause()
            source.resume(source.assignment())
            return Signal.RESUMED
        return signal

    def close(self) -> None:
        """The run ends: a pause still on counts until now."""
        if self.paused:
            self._count_pause()

    def _count_pause(self) -> None:
        paused_s = time.monotonic() - self._paused_since_s
        self._stats.paused_s += paused_s
        self._metrics.paused_seconds.inc(paused_s)
