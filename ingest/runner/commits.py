"""Committing offsets: the only way offsets leave a pipeline.

The :class:`~ingest.core.offsets.OffsetTracker` says which contiguous
watermarks moved; :class:`Committer` sends them, in this order:

1. exactly-once mode: stored in the database (``OffsetStore.save``) -- the
   offsets that count there;
2. committed to the source (Kafka's group offsets: what ``ingest lag`` and a
   restart in at-least-once mode read).

A failed step is logged and retried at the next tick; the tracker only learns
that a watermark was committed once the source accepted it.

Past the last record: a partition whose delivered records are all handled may
still sit below the log end -- a transaction's commit marker takes an offset
but is never delivered. The source's *position* is past such offsets, so at a
regular commit tick (never inside a revoke, where records of the current poll
are not tracked yet) an idle partition's watermark is moved up to it, and a
fully consumed partition shows lag 0.

Advisory commits (exactly-once mode): on assignment the consumer seeks to the
stored offsets; until this member commits a watermark of its own, those are
committed to Kafka too, so Kafka's view catches up with the database's after a
crash between the two steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ingest.core.offsets import OffsetTracker
from ingest.errors import TransientError
from ingest.metrics import PipelineMetrics
from ingest.runner.stats import PipelineStats
from ingest.sinks.base import OffsetStore
from ingest.sources.base import Source
from ingest.types import Partition

log = logging.getLogger(__name__)


class Committer:
    """Commits one pipeline's watermarks. Owned by the pipeline thread."""

    def __init__(self, pipeline: str, tracker: OffsetTracker[Partition], stats: PipelineStats,
                 metrics: PipelineMetrics, offset_store: OffsetStore | None = None) -> None:
        self._pipeline = pipeline
        self._tracker = tracker
        self._stats = stats
        self._metrics = metrics
        self.offset_store = offset_store
        #: stored offsets seeked to on assignment, to be committed to Kafka for lag tooling
        self._advisory: dict[Partition, int] = {}
        #: where partitions nothing was read from since assignment started (the group's committed offset)
        self._start: dict[Partition, int] = {}

    def assigned(self, partitions: Iterable[Partition]) -> None:
        """``partitions`` were (re)assigned: positions seen before do not count any more."""
        for tp in partitions:
            self._start.pop(tp, None)

    def seeked(self, offsets: dict[Partition, int]) -> None:
        """The consumer was told to start ``offsets`` (exactly-once: the stored ones)."""
        self._advisory.update(offsets)

    def commit(self, source: Source, only: set[Partition] | None = None, *, to_position: bool = True) -> None:
        """Commit every watermark that moved (of ``only``, when given). Never raises.

        ``to_position``: first move idle partitions up to the source's position (see the module
        docstring); only where every record the source delivered so far has been tracked.
        """
        tracker = self._tracker
        if to_position:
            idle = [tp for tp in tracker.partitions() if tracker.in_flight(tp) == 0 and (only is None or tp in only)]
            positions = source.position(idle)
            unread = [tp for tp in positions if tracker.last_tracked(tp) is None and tp not in self._start]
            if unread:
                try:
                    committed = source.committed(unread)
                except TransientError:
                    committed = {}
                self._start.update({tp: off or 0 for tp, off in committed.items()})
            for tp, offset in positions.items():
                if tracker.last_tracked(tp) is None and offset <= self._start.get(tp, offset):
                    continue  # nothing read, and nothing skipped since the committed offset
                tracker.advance(tp, offset)
        candidates = tracker.commit_candidates()
        if only is not None:
            candidates = {tp: off for tp, off in candidates.items() if tp in only}
        if self._advisory:
            self._commit_advisory(source, only)
        if not candidates:
            return
        if self.offset_store is not None:
            try:
                self.offset_store.save(candidates)
            except TransientError as exc:
                log.warning("storing offsets failed; will retry", extra={"pipeline": self._pipeline, "error": str(exc)})
                return
        try:
            source.commit(candidates)
        except TransientError as exc:
            log.warning("commit failed; will retry", extra={"pipeline": self._pipeline, "error": str(exc)})
            return
        self._stats.commits += 1
        self._metrics.commits.inc()
        for tp, off in candidates.items():
            tracker.mark_committed(tp, off)

    def _commit_advisory(self, source: Source, only: set[Partition] | None) -> None:
        """Commit seeked-to stored offsets to Kafka where no newer watermark exists yet."""
        tracker = self._tracker
        assigned = set(tracker.partitions())
        pending = {tp: off for tp, off in self._advisory.items()
                   if (only is None or tp in only) and tp in assigned and tracker.committed(tp) is None}
        if pending:
            try:
                source.commit(pending)
            except TransientError as exc:
                log.warning("advisory commit failed; will retry", extra={"pipeline": self._pipeline,
                                                                        "error": str(exc)})
                return
        for tp in list(self._advisory):
            if only is None or tp in only:
                del self._advisory[tp]
