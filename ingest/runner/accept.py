"""Accepting a polled chunk: track its offsets, map each record, route it to its lane's batcher.

The pipeline's hot path (every record of every pipeline passes through :meth:`Acceptor.accept`),
owned by the pipeline thread like the tracker and the batchers it feeds. Routing: every record
that can touch one row goes to one lane -- by the sink's key when the table has one, else by the
record's key (:mod:`ingest.core.routing`); unkeyed records spread round-robin (or stay on lane 0,
and exactly-once pipelines route them by offset, so a replay routes them alike).
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import random
from collections.abc import Callable
from typing import Any

from ingest.cdc.mapper import ChangeMapper
from ingest.config import PipelineSettings
from ingest.core.hotkeys import LaneLoad
from ingest.core.mapping import Mapper
from ingest.core.mapping.columnar import UNROUTED
from ingest.core.offsets import OffsetTracker
from ingest.core.routing import LaneRouter, key_bytes
from ingest.errors import Filtered, InvalidRecord, NoChange
from ingest.metrics import PipelineMetrics
from ingest.runner.batching import LaneBatchers
from ingest.runner.stats import PipelineStats
from ingest.types import Failure, Item, Partition, Record

log = logging.getLogger(__name__)

#: (partition, epoch) of a skipped record ``(tp, offset, epoch)``: runs of one partition are done at once
_run_key = operator.itemgetter(0, 2)

_tp_of = operator.attrgetter("topic", "partition")
_offset_of = operator.attrgetter("offset")
_value_of = operator.attrgetter("value")
_key_of = operator.attrgetter("key")

#: One record in this many feeds the hot-key sketch: shares stay unbiased, the cost per record drops 16×.
HOT_KEY_SAMPLE = 16


class Acceptor:
    """Maps and routes polled chunks for one pipeline (see the module docstring)."""

    def __init__(self, settings: PipelineSettings, mapper: Mapper | ChangeMapper, *,
                 tracker: OffsetTracker[Partition], batching: LaneBatchers, load: LaneLoad, stats: PipelineStats,
                 metrics: PipelineMetrics, deterministic: bool, defer_mapping: bool = False,
                 lane_keys: Callable[[list[Record]], list[Any]] | None = None) -> None:
        """``defer_mapping``: records are mapped per batch when the batch is handed to its lane (the
        columnar tier, ingest.runner.columnar): items leave here with neither row nor failure.
        ``lane_keys``: with it and more than one lane, what each record of a chunk is routed by, as
        :meth:`accept` would route it once mapped, or ``UNROUTED`` (then the record is mapped here to
        route it: :meth:`ColumnarPlan.lane_keys <ingest.core.mapping.columnar.ColumnarPlan.lane_keys>`)."""
        self._settings = settings
        self._mapper = mapper
        self._router = LaneRouter(settings.lanes, settings.unkeyed)
        # Records of one row go to one lane: by the sink's key when it has one (ingest.core.routing).
        key_index = settings.sink.collapse_rule().key_index
        self._row_key: Callable[[tuple], object] | None = operator.itemgetter(*key_index) if key_index else None
        self._tracker = tracker
        self._batching = batching
        self._load = load
        self._stats = stats
        self._metrics = metrics
        self._deterministic = deterministic
        self._defer_mapping = defer_mapping
        self._lane_keys = lane_keys
        assert not defer_mapping or len(batching) == 1 or lane_keys is not None, "deferred mapping routes by lane_keys"
        #: hot-key sketch fed with every HOT_KEY_SAMPLE-th record (unbiased shares, bounded cost)
        self._rng = random.Random()
        self._sample_countdown = HOT_KEY_SAMPLE
        self._misses_before = mapper.fast_misses  # the mapper may have mapped before this run
        self._typed_misses_before = mapper.typed_misses

    def accept(self, records: list[Record], now_ms: int) -> None:
        """Track, map and route one polled chunk. The hot path: keep it lean.

        Offsets are tracked per run of one partition (records arrive in such runs)
        with one ``track_many`` call, before anything of the run can complete:
        completions are applied on the pipeline thread, after ``accept`` returns.

        Deliberately one long loop: it binds what it uses to locals once per
        chunk and makes no helper call per record that it can avoid, since
        every record of every pipeline passes through it.
        """
        if self._defer_mapping:
            self._accept_deferred(records, now_ms)
            return
        tracker = self._tracker
        map_record = self._mapper.map
        lane_of = self._router.lane
        row_key = self._row_key
        row_key_bytes = key_bytes
        # tombstones done at once, unmapped: `tombstones: skip`, or a change mapper's no-op tombstones
        skip_tombstones = (self._settings.effective_tombstones == "skip"
                           or getattr(self._mapper, "skips_tombstones", False))
        deterministic = self._deterministic  # exactly-once needs replay-stable routing
        spread_unkeyed = self._settings.unkeyed == "round_robin"  # unkeyed records are not one hot key
        n_lanes = len(self._batching)
        # This chunk's items and sizes per lane, handed to the batchers in bulk at the end.
        lane_items: list[list[Item]] = [[] for _ in range(n_lanes)]
        lane_sizes: list[list[int]] = [[] for _ in range(n_lanes)]
        self._stats.records_consumed += len(records)
        self._metrics.records_consumed.inc(len(records))
        topic: str | None = None
        partition = -1
        tp = Partition("", -1)
        epoch: int | None = None
        last_offset = -1
        run: list[int] = []
        countdown = self._sample_countdown
        skipped: list[tuple[Partition, int, int]] = []  # tombstones done at once: (tp, offset, epoch)
        filtered: list[str] = []  # the filter step of each record a filter dropped (also in `skipped`)
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
            record_key = rec.key
            size = (len(value) if value is not None else 0) + (len(record_key) if record_key is not None else 0) + 64
            try:
                row, key = map_record(rec)
                item = Item(rec, row, None, epoch, size)
            except InvalidRecord as exc:
                item = Item(rec, None, Failure(exc.stage, exc.error_class, exc.message), epoch, size)
                row, key = None, record_key
            except NoChange as exc:  # handled without a row (ingest.cdc): done at once, like a skipped tombstone
                skipped.append((tp, offset, epoch))  # a filtered record too (ingest.core.transforms)
                if type(exc) is Filtered:
                    filtered.append(exc.step)
                continue
            countdown -= 1
            # The row's key bytes choose its lane; with one lane they are needed only by the sampler.
            if row_key is not None and row is not None and (n_lanes > 1 or countdown == 0):
                key = row_key_bytes(row_key(row))
            if n_lanes == 1:
                lane = 0
            else:
                lane = lane_of(key) if key is not None or not deterministic else offset % n_lanes
            lane_items[lane].append(item)
            lane_sizes[lane].append(size)
            if countdown == 0:
                # A random gap (mean HOT_KEY_SAMPLE) so periodic key patterns cannot alias with the sampler.
                countdown = self._rng.randint(1, 2 * HOT_KEY_SAMPLE - 1)
                if key is not None or not spread_unkeyed:
                    self._load.observe(lane, key, size)
        self._sample_countdown = countdown
        if run:
            tracker.track_many(tp, run)
        self._settle(skipped, filtered)
        self._mapper.review_typed(len(records))
        self.count_misses()
        for lane, items in enumerate(lane_items):
            if items:
                self._stats.records_mapped += len(items)
                self._batching.buffer(lane, items, lane_sizes[lane], now_ms)

    def count_misses(self) -> None:
        """Bring the run's fast-path and typed-tier miss counts up to date (the mapper's since this run
        began; a batch-mapped pipeline maps after its records were accepted: call again then)."""
        self._stats.fast_path_misses = self._mapper.fast_misses - self._misses_before
        self._stats.typed_misses = self._mapper.typed_misses - self._typed_misses_before

    def _settle(self, skipped: list[tuple[Partition, int, int]], filtered: list[str] | None = None) -> None:
        """Mark the records handled without a row ``(tp, offset, epoch)`` done at once, a run at a time;
        ``filtered``: the filter labels of those a filter dropped (counted apart from ``skipped``)."""
        for (skipped_tp, skipped_epoch), run_of in itertools.groupby(skipped, _run_key):
            self._tracker.done_many(skipped_tp, [offset for _, offset, _ in run_of], skipped_epoch)
        self._stats.skipped += len(skipped) - len(filtered or ())
        if filtered:
            counts = collections.Counter(filtered)
            self._stats.filtered.update(counts)
            for step, n in counts.items():
                self._metrics.filtered(step, n)

    def _accept_deferred(self, records: list[Record], now_ms: int) -> None:
        """:meth:`accept` when records are mapped per batch later (``defer_mapping``): the same
        tracking, items, skipped tombstones, statistics, lanes (:meth:`_route`) and hot-key samples
        (with one lane by the record's key: there is no row yet), a run of one partition at a time,
        with the per-record work done by C calls over the run where it can be."""
        tracker = self._tracker
        skip_tombstones = (self._settings.effective_tombstones == "skip"
                           or getattr(self._mapper, "skips_tombstones", False))  # as accept() skips them
        self._stats.records_consumed += len(records)
        self._metrics.records_consumed.inc(len(records))
        items: list[Item] = []
        sizes: list[int] = []
        skipped: list[tuple[Partition, int, int]] = []
        for (topic, partition), same_tp in itertools.groupby(records, _tp_of):
            tp = Partition(topic, partition)
            epoch = tracker.epoch(tp)
            if epoch is None:
                continue  # not assigned any more (revoked during this poll)
            run = list(same_tp)
            offsets = list(map(_offset_of, run))
            last = tracker.last_tracked(tp)
            if (last is not None and offsets[0] <= last) or not all(map(operator.lt, offsets, offsets[1:])):
                run = _forward_only(run, -1 if last is None else last, tp)
                offsets = list(map(_offset_of, run))
            tracker.track_many(tp, offsets)
            values = list(map(_value_of, run))
            if skip_tombstones and None in values:
                skipped.extend((tp, rec.offset, epoch) for rec in run if rec.value is None)
                run = [rec for rec in run if rec.value is not None]
                values = list(map(_value_of, run))
            run_sizes = _sizes(values, list(map(_key_of, run)))
            items += map(Item, run, itertools.repeat(None), itertools.repeat(None), itertools.repeat(epoch),
                         run_sizes)
            sizes += run_sizes
        n_lanes = len(self._batching)
        keys = lanes = None
        if n_lanes > 1 and items:
            keys, lanes = self._route(items)
        self._sample_keys(items, keys, lanes)
        self._settle(skipped)
        self._mapper.review_typed(len(records))
        self.count_misses()
        if not items:
            return
        self._stats.records_mapped += len(items)
        if lanes is None:
            self._batching.buffer(0, items, sizes, now_ms)
            return
        lane_items: list[list[Item]] = [[] for _ in range(n_lanes)]
        lane_sizes: list[list[int]] = [[] for _ in range(n_lanes)]
        for item, size, lane in zip(items, sizes, lanes, strict=True):
            lane_items[lane].append(item)
            lane_sizes[lane].append(size)
        for lane, of_lane in enumerate(lane_items):
            if of_lane:
                self._batching.buffer(lane, of_lane, lane_sizes[lane], now_ms)

    def _route(self, items: list[Item]) -> tuple[list[bytes | None], list[int]]:
        """Each unmapped item's routing key and lane, exactly as :meth:`accept` routes it once mapped:
        the key from ``lane_keys``, or for a record it leaves ``UNROUTED``, from the row mapper's row
        (the record's key for poison); without a key, with ``deterministic`` (exactly-once), lane
        ``offset % lanes``."""
        assert self._lane_keys is not None
        keys = self._lane_keys([item.record for item in items])
        if UNROUTED in keys:  # identity first: no key compares equal to the sentinel
            row_key = self._row_key
            map_record = self._mapper.map
            for i, key in enumerate(keys):
                if key is UNROUTED:
                    record = items[i].record
                    try:
                        row, key = map_record(record)
                        if row_key is not None:
                            key = key_bytes(row_key(row))
                    except (InvalidRecord, NoChange):
                        key = record.key
                    keys[i] = key
        lane_of = self._router.lane
        if self._deterministic and None in keys:  # exactly-once: a record without a key goes by its offset
            n_lanes = len(self._batching)
            return keys, [lane_of(key) if key is not None else item.record.offset % n_lanes
                          for key, item in zip(keys, items, strict=True)]
        return keys, list(map(lane_of, keys))

    def _sample_keys(self, items: list[Item], keys: list[bytes | None] | None = None,
                     lanes: list[int] | None = None) -> None:
        """Feed every HOT_KEY_SAMPLE-th item (on average; random gaps, as :meth:`accept` does) of a chunk
        to the hot-key sketch: by its routing key and lane (``keys``, ``lanes``), or bound for lane 0 by
        the record's key."""
        spread_unkeyed = self._settings.unkeyed == "round_robin"
        pos = self._sample_countdown - 1  # the next sample's position in ``items``
        while pos < len(items):
            item = items[pos]
            key = item.record.key if keys is None else keys[pos]
            if key is not None or not spread_unkeyed:
                self._load.observe(0 if lanes is None else lanes[pos], key, item.size_bytes)
            pos += self._rng.randint(1, 2 * HOT_KEY_SAMPLE - 1)
        self._sample_countdown = pos - len(items) + 1


def _forward_only(run: list[Record], last: int, tp: Partition) -> list[Record]:
    """The records of a run whose offsets move forward from ``last`` (a redelivery that went
    backwards is logged and ignored, as :meth:`Acceptor.accept` does)."""
    kept = []
    for rec in run:
        if rec.offset <= last:
            log.warning("offset went backwards; ignoring redelivery", extra={"partition": str(tp), "offset": rec.offset})
            continue
        last = rec.offset
        kept.append(rec)
    return kept


def _sizes(values: list[bytes | None], keys: list[bytes | None]) -> list[int]:
    """Each record's in-flight size, as :meth:`Acceptor.accept` counts it: value + key + 64 bytes."""
    if None in values or None in keys:
        return [(len(v) if v is not None else 0) + (len(k) if k is not None else 0) + 64
                for v, k in zip(values, keys, strict=True)]
    return list(map(operator.add, map(operator.add, map(len, values), map(len, keys)), itertools.repeat(64)))
