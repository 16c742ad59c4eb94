"""What a running pipeline reports about itself once per commit interval: gauges and hot keys.

Nothing here changes what the pipeline does; it reads the pipeline's state and
writes metrics and warnings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ingest.core.hotkeys import LaneLoad, LoadReport, key_label
from ingest.core.offsets import OffsetTracker
from ingest.metrics import PipelineMetrics
from ingest.sources.base import Source
from ingest.types import Partition

log = logging.getLogger(__name__)


class Observer:
    """Gauges and the hot-key / hot-lane report of one pipeline. Owned by the pipeline thread."""

    def __init__(self, pipeline: str, metrics: PipelineMetrics, load: LaneLoad, *, hot_key_share: float,
                 hot_key_interval_s: float, now_ms: int) -> None:
        self._pipeline = pipeline
        self._metrics = metrics
        self._load = load
        self._hot_key_share = hot_key_share
        self._interval_ms = hot_key_interval_s * 1000
        self._last_report_ms = now_ms
        #: the last hot-key report (tests and the lanes benchmark read it)
        self.last_report: LoadReport | None = None

    def observe(self, now_ms: int, *, tracker: OffsetTracker[Partition], source: Source,
                in_flight_records: int, in_flight_bytes: int, lane_in_flight: list[int],
                oldest_ms: Iterable[int]) -> None:
        """Refresh every gauge; every ``hot_key_interval_s`` also report hot keys and lanes."""
        self._report_load(now_ms, lane_in_flight)
        m = self._metrics
        m.buffered_records.set(in_flight_records)
        m.buffered_bytes.set(in_flight_bytes)
        m.offset_gaps.set(tracker.gap_count())
        oldest = list(oldest_ms)
        m.oldest_unfinished_age.set((now_ms - min(oldest)) / 1000 if oldest else 0.0)
        for tp in tracker.partitions():
            high = source.cached_high(tp)
            mark = tracker.committed(tp)
            if high is not None and mark is not None:
                m.set_lag(tp.topic, tp.partition, max(0, high - mark))

    def _report_load(self, now_ms: int, lane_in_flight: list[int]) -> None:
        if now_ms - self._last_report_ms < self._interval_ms:
            return
        self._last_report_ms = now_ms
        report = self._load.report(self._hot_key_share, lane_in_flight)
        self.last_report = report
        for lane, stats in enumerate(report.lanes):
            self._metrics.set_hot_key_share(lane, stats.top_share)
        for hot in report.hot_keys:
            log.warning("hot key: one key dominates a lane; its records cannot be parallelised",
                        extra={"pipeline": self._pipeline, "lane": hot.lane, "key": key_label(hot.key),
                               "share": round(hot.share, 3)})
        if report.hot_lane is not None:
            log.warning("hot lane: one lane holds most of the backlog",
                        extra={"pipeline": self._pipeline, "lane": report.hot_lane,
                               "share": round(report.hot_lane_share, 3)})
        self._load.reset()
