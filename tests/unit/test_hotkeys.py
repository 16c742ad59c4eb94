"""HeavyHitters (Space-Saving) guarantees, bounded memory, LaneLoad hot-key and hot-lane rules."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.core.hotkeys import (
    UNKEYED_LABEL,
    HeavyHitters,
    HotKey,
    LaneLoad,
    key_label,
)

_keys = st.sampled_from([None, b"", b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"])  # small alphabet: evictions and returns


def _check_space_saving(sketch: HeavyHitters, truth: Counter) -> None:
    total = sum(truth.values())
    assert sketch.total() == total
    assert len(sketch) <= sketch.capacity
    entries = sketch.top(sketch.capacity)
    assert len(entries) == len(sketch)
    assert sum(count for _, count, _ in entries) == total  # Space-Saving invariant: counters sum to N
    monitored = {key for key, _, _ in entries}
    for key, count, error in entries:
        assert count >= truth[key] >= count - error, (key, count, error, truth[key])
        assert 0 <= error * sketch.capacity <= total
    for key, true_count in truth.items():
        if true_count * sketch.capacity > total:
            assert key in monitored, (key, true_count, total)
    counts = [count for _, count, _ in entries]
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("capacity", [0, -1])
def test_rejects_bad_capacity(capacity: int) -> None:
    with pytest.raises(ValueError):
        HeavyHitters(capacity)
    with pytest.raises(ValueError):
        LaneLoad(2, capacity)


def test_rejects_negative_n_and_ignores_zero() -> None:
    h = HeavyHitters(4)
    with pytest.raises(ValueError):
        h.add(b"a", -1)
    h.add(b"a", 0)
    assert h.total() == 0 and len(h) == 0 and h.top(5) == []


def test_exact_while_under_capacity_and_top_order() -> None:
    h = HeavyHitters(4)
    for key, n in [(b"a", 3), (b"b", 1), (None, 5), (b"a", 1)]:
        h.add(key, n)
    assert h.top(10) == [(None, 5, 0), (b"a", 4, 0), (b"b", 1, 0)]
    assert h.top(1) == [(None, 5, 0)]
    assert h.top(0) == []
    assert h.share(None) == pytest.approx(0.5)
    assert h.share(b"zzz") == 0.0
    assert h.estimate(b"zzz") == (0, 0)


def test_unkeyed_is_its_own_key() -> None:
    h = HeavyHitters(4)
    h.add(None)
    h.add(UNKEYED_LABEL.encode())
    assert h.estimate(None) == (1, 0) and h.estimate(b"<unkeyed>") == (1, 0)
    assert key_label(None) == "<unkeyed>"
    assert key_label(b"user-1") == "user-1"
    assert key_label(b"\xff" + b"x" * 100, max_len=8) == "\\xffxxxx..."


def test_eviction_inherits_min_as_error() -> None:
    h = HeavyHitters(2)
    h.add(b"a", 3)
    h.add(b"b", 1)
    h.add(b"c")  # evicts b (count 1): c gets count 2, error 1
    assert h.top(2) == [(b"a", 3, 0), (b"c", 2, 1)]
    assert h.share(b"c") == pytest.approx(1 / 5)


@settings(max_examples=100)
@given(capacity=st.integers(1, 6), stream=st.lists(st.tuples(_keys, st.integers(1, 3)), max_size=200))
def test_space_saving_guarantees_weighted(capacity: int, stream: list[tuple[bytes | None, int]]) -> None:
    h = HeavyHitters(capacity)
    truth: Counter = Counter()
    for i, (key, n) in enumerate(stream):
        h.add(key, n)
        truth[key] += n
        if i % 17 == 0:
            _check_space_saving(h, truth)
    _check_space_saving(h, truth)


@settings(max_examples=100)
@given(
    capacity=st.integers(1, 16),
    distinct=st.integers(1, 64),
    skew=st.floats(0.0, 3.0),
    n=st.integers(0, 800),
    seed=st.integers(0, 2**32 - 1),
)
def test_space_saving_guarantees_zipf_like(capacity: int, distinct: int, skew: float, n: int, seed: int) -> None:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** skew for i in range(distinct)]
    keys = [f"k{i}".encode() for i in range(distinct)]
    h = HeavyHitters(capacity)
    truth: Counter = Counter()
    for key in rng.choices(keys, weights, k=n):
        h.add(key)
        truth[key] += 1
    _check_space_saving(h, truth)


def test_memory_is_bounded_by_capacity() -> None:
    h = HeavyHitters(8)
    for i in range(20_000):
        h.add(i.to_bytes(4, "big"))
    assert len(h) == 8
    assert sum(len(b) for b in h._buckets.values()) == 8  # internal index is bounded too
    assert h.total() == 20_000


def test_reset() -> None:
    h = HeavyHitters(2)
    for k in (b"a", b"b", b"c", b"a"):
        h.add(k)
    h.reset()
    assert h.total() == 0 and len(h) == 0 and h.top(3) == []
    h.add(b"x", 2)
    h.add(b"y")
    h.add(b"z")  # min must have been reset correctly: evicts y (1), not x
    assert h.top(2) == [(b"x", 2, 0), (b"z", 2, 1)]


# -- LaneLoad: hot keys ---------------------------------------------------------


def _stream_with_hot_key(rng: random.Random, n: int, hot_share: float, distinct: int) -> list[bytes]:
    hot = int(n * hot_share)
    keys = [b"hot"] * hot + [f"cold-{rng.randrange(distinct)}".encode() for _ in range(n - hot)]
    rng.shuffle(keys)
    return keys


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.sampled_from([4, 16, 64]), distinct=st.integers(1, 5000))
def test_key_with_60_percent_is_reported_hot(seed: int, capacity: int, distinct: int) -> None:
    rng = random.Random(seed)
    load = LaneLoad(lanes=2, capacity=capacity)
    for key in _stream_with_hot_key(rng, 3000, 0.6, distinct):
        load.observe(1, key, 100)
    for i in range(300):
        load.observe(0, f"spread-{i}".encode(), 10)
    report = load.report(0.5, [0, 0])
    hot = [hk for hk in report.hot_keys if hk.key == b"hot"]
    assert len(hot) == 1 and hot[0].lane == 1
    # Lower bound: true share (0.6) minus at most 1/capacity.
    assert 0.6 - 1 / capacity - 1e-9 <= hot[0].share <= 0.6
    assert report.lanes[1].top_key == b"hot" and report.lanes[1].top_share == hot[0].share
    assert all(hk.lane == 1 for hk in report.hot_keys)
    assert report.records_by_lane == [300, 3000]
    assert report.bytes_by_lane == [3000, 300_000]


def test_key_with_60_percent_share_is_about_0_6_with_default_capacity() -> None:
    load = LaneLoad(lanes=1)
    for key in _stream_with_hot_key(random.Random(7), 10_000, 0.6, 10_000):
        load.observe(0, key, 1)
    (hot,) = load.report(0.5, [0]).hot_keys
    assert hot == HotKey(0, b"hot", hot.share)
    assert hot.share == pytest.approx(0.6, abs=0.02)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    capacity=st.integers(1, 64),
    distinct=st.integers(2, 400),
    per_key=st.integers(1, 30),
    threshold=st.sampled_from([0.5, 0.6, 0.9]),
)
def test_uniform_keys_are_never_hot(seed: int, capacity: int, distinct: int, per_key: int, threshold: float) -> None:
    """Every key occurs equally often (true share 1/distinct <= 0.5): never reported hot, even with a tiny sketch."""
    keys = [f"k{i}".encode() for i in range(distinct)] * per_key
    random.Random(seed).shuffle(keys)
    load = LaneLoad(lanes=1, capacity=capacity, min_records=0)
    for key in keys:
        load.observe(0, key, 1)
    report = load.report(threshold, [0])
    assert report.hot_keys == []
    assert report.lanes[0].top_share <= 1 / distinct + 1e-12


def test_hot_key_needs_min_records() -> None:
    load = LaneLoad(lanes=2)  # default min_records = 100
    for _ in range(99):
        load.observe(0, b"only", 1)
    assert load.report(0.5, [0, 0]).hot_keys == []
    load.observe(0, b"only", 1)
    assert load.report(0.5, [0, 0]).hot_keys == [HotKey(0, b"only", 1.0)]


def test_unkeyed_records_can_be_hot_and_threshold_is_strict() -> None:
    load = LaneLoad(lanes=1, min_records=0)
    for i in range(100):
        load.observe(0, None if i % 2 else f"k{i}".encode(), 1)
    assert load.report(0.5, [0]).hot_keys == []  # exactly 0.5 is not > 0.5
    assert load.report(0.49, [0]).hot_keys == [HotKey(0, None, 0.5)]


def test_several_hot_keys_per_lane_below_half() -> None:
    load = LaneLoad(lanes=1, min_records=0)
    for key, n in [(b"a", 40), (b"b", 35), (b"c", 25)]:
        for _ in range(n):
            load.observe(0, key, 1)
    assert load.report(0.3, [0]).hot_keys == [HotKey(0, b"a", 0.4), HotKey(0, b"b", 0.35)]


def test_observe_validation_and_reset() -> None:
    load = LaneLoad(lanes=2)
    with pytest.raises(IndexError):
        load.observe(2, b"k", 1)
    with pytest.raises(IndexError):
        load.observe(-1, b"k", 1)
    with pytest.raises(ValueError):
        load.observe(0, b"k", -1)
    for _ in range(150):
        load.observe(0, b"k", 3)
    assert load.sketch(0).total() == 150
    assert load.report(0.5, [0, 0]).hot_keys
    load.reset()
    report = load.report(0.5, [0, 0])
    assert report.hot_keys == [] and report.records_by_lane == [0, 0] and report.bytes_by_lane == [0, 0]
    assert report.lanes[0].top_share == 0.0


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_report_rejects_bad_threshold(bad: float) -> None:
    with pytest.raises(ValueError):
        LaneLoad(2).report(bad, [0, 0])


def test_report_rejects_bad_backlog() -> None:
    load = LaneLoad(3)
    with pytest.raises(ValueError):
        load.report(0.5, [1, 2])
    with pytest.raises(ValueError):
        load.report(0.5, [1, -2, 3])
    with pytest.raises(ValueError):
        LaneLoad(2, min_records=-1)


# -- LaneLoad: hot lane ---------------------------------------------------------


@pytest.mark.parametrize(
    ("backlog", "hot_lane", "share"),
    [
        ([0, 0, 0, 0], None, 0.0),  # empty
        ([60, 40], 0, 0.6),  # strictly more than half of a non-trivial total
        ([50, 50], None, 0.5),  # exactly half is not "most"
        ([10, 300, 20, 20], 1, 300 / 350),
        ([40, 30, 30], None, 0.4),  # the largest, but not most
        ([9, 1], None, 0.9),  # total 10 < min_backlog (100): noise
        ([99, 1], 0, 0.99),  # total 100 = min_backlog
    ],
)
def test_hot_lane_rule(backlog: list[int], hot_lane: int | None, share: float) -> None:
    report = LaneLoad(len(backlog)).report(0.5, backlog)
    assert report.hot_lane == hot_lane
    assert report.backlog_total == sum(backlog)
    assert report.hot_lane_share == pytest.approx(share)


def test_single_lane_is_never_a_hot_lane() -> None:
    assert LaneLoad(1).report(0.5, [10_000]).hot_lane is None


def test_hot_lane_min_backlog_is_configurable() -> None:
    assert LaneLoad(2, min_backlog=0).report(0.5, [2, 1]).hot_lane == 0
    assert LaneLoad(2, min_backlog=1000).report(0.5, [900, 10]).hot_lane is None
