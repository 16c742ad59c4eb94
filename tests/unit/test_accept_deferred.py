"""The accept loop for batch-mapped pipelines (``Acceptor._accept_deferred``, the columnar tier's)
against the mapping loop (``Acceptor.accept`` of a pipeline that maps records as it accepts them).

Differential: over random sequences of polled chunks -- partitions interleaved, some unassigned,
offsets that jump, repeat or go backwards, tombstones, records without keys -- both loops must
leave the offset tracker in the same state, hand the same records (with the same epochs and
sizes) to lane 0's batcher in the same order, skip and count the same records and feed the
hot-key sketch at the same positions. What the deferred loop leaves for later differs: its items
carry neither row nor failure, and a sample's key is the record's (there is no row yet), so with
``unkeyed: round_robin`` a sample of a record without a Kafka key is not counted (the mapping loop
counts it under its row's key); the differential runs with ``unkeyed: lane0``, which counts both.
"""

from __future__ import annotations

import random

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.core.mapping import Mapper
from ingest.core.offsets import OffsetTracker
from ingest.errors import InvalidRecord
from ingest.metrics import Metrics
from ingest.runner.accept import Acceptor
from ingest.runner.stats import PipelineStats
from ingest.types import Item, Partition, Record

ASSIGNED = [Partition("t", 0), Partition("t", 1), Partition("u", 0)]
ALL = [*ASSIGNED, Partition("t", 2)]  # ("t", 2) is not assigned: its records are ignored


def _settings(tombstones: str, lanes: int = 1) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "accept", "topics": ["t", "u"], "lanes": lanes, "tombstones": tombstones, "unkeyed": "lane0",
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["id"],
                 "columns": {"id": {"type": "bigint", "required": True}, "kind": {"type": "text"}}},
    })


class _Batching:
    """The lanes' batchers as the acceptor sees them: what each was handed, in order."""

    def __init__(self, lanes: int = 1) -> None:
        self.handed: list[tuple[int, Item, int]] = []
        self._lanes = lanes

    def __len__(self) -> int:
        return self._lanes

    def buffer(self, lane: int, items: list[Item], sizes: list[int], now_ms: int) -> None:
        assert len(items) == len(sizes)
        self.handed += [(lane, item, size) for item, size in zip(items, sizes, strict=True)]


class _Load:
    """The hot-key sketch as the acceptor feeds it: the sampled (lane, size) in order."""

    def __init__(self) -> None:
        self.sampled: list[tuple[int, int]] = []

    def observe(self, lane: int, key: bytes | None, size_bytes: int) -> None:
        self.sampled.append((lane, size_bytes) if self.lanes == 1 else (lane, key, size_bytes))

    lanes = 1


def _acceptor(settings_: PipelineSettings, defer: bool) -> tuple[Acceptor, OffsetTracker, _Batching, _Load,
                                                                   PipelineStats]:
    tracker: OffsetTracker[Partition] = OffsetTracker()
    for tp in ASSIGNED:
        tracker.assign(tp)
    batching, load, stats = _Batching(settings_.lanes), _Load(), PipelineStats()
    load.lanes = settings_.lanes
    lane_keys = None
    if defer and settings_.lanes > 1:  # the columnar tier's plan routes them
        rule = settings_.collapse_rule()
        plan = Mapper(settings_.sink.columns, settings_.key).columnar_plan(rule.key_index, rule.version_index)
        assert plan is not None and plan.route_refusal is None
        lane_keys = plan.lane_keys
    acceptor = Acceptor(settings_, mapper_for(settings_), tracker=tracker, batching=batching,  # type: ignore[arg-type]
                        load=load, stats=stats, metrics=Metrics().pipeline("accept"),  # type: ignore[arg-type]
                        deterministic=False, defer_mapping=defer, lane_keys=lane_keys)
    acceptor._rng = random.Random(7)  # both loops draw the same sampling gaps
    return acceptor, tracker, batching, load, stats


#: the records' Kafka keys (the key column reads the value: these are poison's routing keys only)
KAFKA_KEYS = [b"k", b"key-2", None]

record_specs = st.tuples(
    st.sampled_from(ALL),
    st.integers(min_value=-3, max_value=4),  # the offset's step from the partition's last one
    st.sampled_from([b'{"id": 1, "kind": "a"}', b'{"id": 2}', b"not json", None, b'{"id": 12345678901}',
                     # routed by the row mapper's row (text it coerces, a key beyond a double, bytes that are
                     # not UTF-8 in a key no column reads, two lines) or the record's key (poison)
                     b'{"id": "7"}', b'{"id": 3, "extra": [1, {"a": null}]}', b'{"id": 4, "zz": 1e400}',
                     b'{"id": 5, "zz": "\xff"}', b'{"kind": "no id"}', b'{"id": 6}\n{"id": 7}', b'{"id": true}',
                     b'{"id": 9223372036854775808}', b'{"id": 8, "kind": "nul \\u0000"}']),
    st.sampled_from(KAFKA_KEYS),
)


def _chunks(specs: list[list[tuple]]) -> list[list[Record]]:
    """Polled chunks from (partition, step, value, key) specs: offsets per partition move by ``step``."""
    position = {tp: 10 for tp in ALL}
    chunks = []
    for chunk in specs:
        records = []
        for tp, step, value, key in chunk:
            position[tp] = max(0, position[tp] + step)
            records.append(Record(tp.topic, tp.partition, position[tp], key, value, 1_700_000_000_000))
        chunks.append(records)
    return chunks


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(st.lists(record_specs, max_size=30), min_size=1, max_size=6),
       tombstones=st.sampled_from(["skip", "dlq"]), lanes=st.sampled_from([1, 3]))
def test_the_deferred_loop_tracks_batches_and_samples_as_the_mapping_loop(specs, tombstones, lanes):
    """With more than one lane, each record goes to the lane the mapping loop sends it to (and the
    sketch hears the same keys): the columnar tier keeps every key on one lane, as the row path does."""
    chunks = _chunks(specs)
    runs = {}
    for defer in (False, True):
        acceptor, tracker, batching, load, stats = _acceptor(_settings(tombstones, lanes), defer)
        for chunk in chunks:
            acceptor.accept(chunk, now_ms=0)
        if defer:
            assert all(item.row is None and item.failure is None for _, item, _ in batching.handed)
        # Poison touches no row: the mapping loop routes it by its Kafka key, the deferred one may
        # route it by its key column's value (it is not mapped yet); compare its lane apart.
        handed = [(lane, item.record, item.epoch, item.size_bytes, size) for lane, item, size in batching.handed]
        runs[defer] = {
            "tracked": {tp: (tracker.last_tracked(tp), tracker.in_flight(tp)) for tp in ASSIGNED},
            "handed": sorted(((h[1].topic, h[1].partition, h[1].offset), h[2:]) for h in handed),
            "lanes": [(h[0], h[1]) for h in handed if not _poison(h[1])],
            # with lanes, only poison is sampled by its Kafka key (the mapping loop's) or its key
            # column (the deferred loop's): the samples of the other records compare
            "sampled": [s for s in load.sampled if lanes == 1 or not (_poison_key(s[1]) or s[1] in KAFKA_KEYS)],
            "counts": (stats.records_consumed, stats.records_mapped, stats.skipped),
        }
    assert runs[True] == runs[False]
    if lanes == 1:  # one lane: the same records in the same order
        assert [h for h in runs[True]["lanes"]] == [h for h in runs[False]["lanes"]]


def test_a_chunk_is_sampled_across_polls_at_the_mapping_loops_positions():
    """Many small chunks: the sampling countdown carries over from one chunk to the next."""
    value = orjson.dumps({"id": 1})
    chunks = [[Record("t", 0, 100 * c + i, b"k", value + b" " * i, 0) for i in range(c % 5)] for c in range(200)]
    sampled = {}
    for defer in (False, True):
        acceptor, _, _, load, _ = _acceptor(_settings("skip"), defer)
        for chunk in chunks:
            acceptor.accept(chunk, now_ms=0)
        sampled[defer] = load.sampled
    assert len(sampled[False]) > 10  # 400 records, one in 16 sampled on average
    assert sampled[True] == sampled[False]


_MAPPER = Mapper(_settings("dlq").sink.columns)


def _poison(record: Record) -> bool:
    try:
        _MAPPER.map(record)
    except InvalidRecord:
        return True
    return False


def _poison_key(key: bytes | None) -> bool:
    """A sampled key that a poison record's key column holds, which the deferred loop may route and sample
    by (its key is read before the row mapper refuses the record): the specs' ids 4 (a number beyond a
    double in a key no column reads), 5 (bytes that are not UTF-8 there) and 8 (NUL text)."""
    return key in (b"4", b"5", b"8")


def _append_only_settings(lanes: int, unkeyed: str) -> PipelineSettings:
    """An append-only table (no conflict key: records route by their Kafka key) as exactly-once writes it."""
    return PipelineSettings.model_validate({
        "name": "accept", "topics": ["t", "u"], "lanes": lanes, "unkeyed": unkeyed,
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "on_conflict": "none",
                 "columns": {"id": {"type": "bigint", "required": True}, "kind": {"type": "text"}}},
    })


@settings(max_examples=200, deadline=None)
@given(specs=st.lists(st.lists(record_specs, max_size=30), min_size=1, max_size=6),
       unkeyed=st.sampled_from(["round_robin", "lane0"]))
def test_with_exactly_once_the_deferred_loop_routes_every_record_as_the_mapping_loop(specs, unkeyed):
    """Exactly-once (``deterministic``) keeps lane offsets per lane: a record must go to the same lane
    whichever loop accepts it and whatever it holds (poison included), or a restart on the other tier
    could find it below another lane's stored offset and skip it. Records without a Kafka key go to
    lane ``offset % lanes`` in both, never round-robin."""
    chunks = _chunks(specs)
    handed = {}
    for defer in (False, True):
        settings_ = _append_only_settings(3, unkeyed)
        tracker: OffsetTracker[Partition] = OffsetTracker()
        for tp in ASSIGNED:
            tracker.assign(tp)
        batching, load = _Batching(3), _Load()
        load.lanes = 3
        plan = Mapper(settings_.sink.columns).columnar_plan(None)
        assert plan is not None and plan.route_refusal is None
        acceptor = Acceptor(settings_, mapper_for(settings_), tracker=tracker, batching=batching,  # type: ignore[arg-type]
                            load=load, stats=PipelineStats(), metrics=Metrics().pipeline("accept"),  # type: ignore[arg-type]
                            deterministic=True, defer_mapping=defer, lane_keys=plan.lane_keys if defer else None)
        for chunk in chunks:
            acceptor.accept(chunk, now_ms=0)
        handed[defer] = sorted((h[1].record.topic, h[1].record.partition, h[1].record.offset, h[0])
                               for h in batching.handed)
        unkeyed_lanes = [(h[1].record.offset % 3, h[0]) for h in batching.handed if h[1].record.key is None]
        assert all(want == lane for want, lane in unkeyed_lanes), (defer, unkeyed_lanes)
    assert handed[True] == handed[False]
