"""The lanes' ring batchers: buffering a polled chunk, dispatching full and due batches to the lane pool,
and dropping a lost partition's buffered records. Owned by the pipeline thread.
"""

from __future__ import annotations

from collections.abc import Callable

from ingest.config import BatchSettings
from ingest.core.batcher import FlushReason, RingBatcher
from ingest.metrics import PipelineMetrics
from ingest.runner.flow import Flow
from ingest.runner.lanes import LanePool
from ingest.runner.stats import PipelineStats
from ingest.types import Item, Partition


class LaneBatchers:
    """One :class:`~ingest.core.batcher.RingBatcher` per lane, feeding the lane pool."""

    def __init__(self, lanes: int, batch: BatchSettings, *, pool: LanePool, flow: Flow, stats: PipelineStats,
                 metrics: PipelineMetrics, clock: Callable[[], int]) -> None:
        self.batchers: list[RingBatcher[Item]] = [
            RingBatcher(batch.max_rows, batch.max_bytes, batch.max_latency_ms) for _ in range(lanes)
        ]
        self._pool = pool
        self._flow = flow
        self._stats = stats
        self._metrics = metrics
        self._clock = clock

    def __len__(self) -> int:
        return len(self.batchers)

    def buffer(self, lane: int, items: list[Item], sizes: list[int], now_ms: int) -> None:
        """Add a chunk's items for one lane to its batcher, dispatching each batch that fills up."""
        self._flow.add(lane, len(items), sum(sizes))
        batcher = self.batchers[lane]
        pos = 0
        while pos < len(items):
            pos, reason = batcher.add_many(items, sizes, now_ms, pos)
            if reason is not None:
                self.dispatch(lane, reason)

    def dispatch(self, lane: int, reason: FlushReason) -> None:
        """Hand the lane's buffered batch (if any) to its lane."""
        batcher = self.batchers[lane]
        oldest_ms = batcher.oldest_ms
        items = batcher.drain()
        if items:
            self._stats.flushes[reason.value] += 1
            self._metrics.flushed(reason.value)
            self._flow.dispatched(lane, oldest_ms if oldest_ms is not None else self._clock())
            self._pool.submit(lane, items, reason.value)

    def flush_due(self, now_ms: int) -> None:
        """Dispatch every batch whose oldest record waited ``max_latency_ms``."""
        for lane, batcher in enumerate(self.batchers):
            if batcher.due(now_ms) is not None:
                self.dispatch(lane, FlushReason.TIME)

    def flush_all(self, reason: FlushReason) -> None:
        for lane in range(len(self.batchers)):
            self.dispatch(lane, reason)

    def oldest_ms(self) -> list[int]:
        """When the oldest record of each non-empty batcher was buffered."""
        return [b.oldest_ms for b in self.batchers if b.oldest_ms is not None]

    def drop(self, partitions: set[Partition]) -> None:
        """Drop the buffered (not yet dispatched) records of ``partitions``: they will not be committed,
        and the partitions' next owner -- this member again, perhaps -- reads them again."""
        for lane, batcher in enumerate(self.batchers):
            if not len(batcher):
                continue
            oldest_ms = batcher.oldest_ms
            items = batcher.drain()
            kept = [it for it in items if it.record.tp not in partitions]
            dropped = len(items) - len(kept)
            if dropped:
                self._flow.remove(lane, dropped, sum(it.size_bytes for it in items) - sum(it.size_bytes for it in kept))
            if kept:  # they fitted before, so at most one flush falls due
                _, reason = batcher.add_many(kept, [it.size_bytes for it in kept],
                                             oldest_ms if oldest_ms is not None else self._clock())
                if reason is not None:
                    self.dispatch(lane, reason)
