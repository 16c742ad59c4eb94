"""What a running pipeline reports about itself once per commit interval: gauges and hot keys.

Nothing here changes what the pipeline does; it reads the pipeline's state and
writes metrics and warnings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from ingest.core.hotkeys import LaneLoad, LoadReport, key_label
from ingest.core.offsets import OffsetTracker
from ingest.metrics import PipelineMetrics
from ingest.sources.base import Source
from ingest.status import PartitionStatus
from ingest.types import Partition, Record

log = logging.getLogger(__name__)

#: A polled chunk's timestamps are read at most this often (ms) unless the chunk is small: about
#: 70 ns per record otherwise, ~1 % of ingest's CPU per record, for a gauge alerted on in minutes.
TIMESTAMP_SAMPLE_MS = 500
SMALL_CHUNK = 64


class Observer:
    """Gauges and the hot-key / hot-lane report of one pipeline. Owned by the pipeline thread."""

    def __init__(self, pipeline: str, metrics: PipelineMetrics, load: LaneLoad, *, hot_key_share: float,
                 hot_key_interval_s: float, now_ms: int, wall_ms: Callable[[], int] | None = None) -> None:
        self._pipeline = pipeline
        #: wall clock (epoch ms), against which record timestamps give the lag in seconds
        self._wall_ms = wall_ms or (lambda: time.time_ns() // 1_000_000)
        #: per partition, the broker timestamp (epoch ms) of the last record consumed from it, as last sampled
        self._last_ts_ms: dict[tuple[str, int], int] = {}
        self._sampled_ms: int | None = None
        self._metrics = metrics
        self._load = load
        self._hot_key_share = hot_key_share
        self._interval_ms = hot_key_interval_s * 1000
        self._last_report_ms = now_ms
        #: the last hot-key report (tests and the lanes benchmark read it)
        self.last_report: LoadReport | None = None

    def consumed(self, records: Sequence[Record], now_ms: int) -> None:
        """Note the timestamp of the last record of each partition in a polled chunk (lag in seconds).

        Sampled: a chunk is read when it is small or :data:`TIMESTAMP_SAMPLE_MS` passed since the last
        one read, so a partition's timestamp can be a few chunks old (the lag in seconds then reads
        that much high; it is alerted on in minutes)."""
        if (len(records) > SMALL_CHUNK and self._sampled_ms is not None
                and now_ms - self._sampled_ms < TIMESTAMP_SAMPLE_MS):
            return
        self._sampled_ms = now_ms
        last = self._last_ts_ms
        for r in records:
            if r.timestamp_ms is not None:
                last[(r.topic, r.partition)] = r.timestamp_ms

    def forget(self, partitions: Iterable[Partition]) -> None:
        for tp in partitions:
            self._last_ts_ms.pop((tp.topic, tp.partition), None)

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
        for lane, n in enumerate(lane_in_flight):
            m.set_lane_buffered(lane, n)
        wall_ms = self._wall_ms()
        table = []
        for tp in tracker.partitions():
            high = source.cached_high(tp)
            mark = tracker.committed(tp)
            lag = max(0, high - mark) if high is not None and mark is not None else None
            if lag is not None:
                ts = self._last_ts_ms.get((tp.topic, tp.partition))
                # Behind with nothing consumed yet (a stuck or paused start): no timestamp to measure from.
                lag_s = 0.0 if lag == 0 else (max(0.0, (wall_ms - ts) / 1000) if ts is not None else None)
                m.set_lag(tp.topic, tp.partition, lag, lag_s, mark)
            table.append(PartitionStatus(tp.topic, tp.partition, mark, high, lag))
        m.status.set_partitions(table)

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
