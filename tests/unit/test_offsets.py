"""OffsetTracker: contiguous low watermarks, epochs, commit bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ingest.core.offsets import OffsetTracker
from ingest.types import Partition

TP0 = Partition("orders", 0)
TP1 = Partition("orders", 1)
TP2 = Partition("users", 0)


def test_empty_assignment() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    assert t.partitions() == []
    assert t.commit_candidates() == {}
    e = t.assign(TP0)
    assert t.epoch(TP0) == e
    assert t.partitions() == [TP0]
    assert t.watermark(TP0) is None
    assert t.oldest_pending(TP0) is None
    assert t.in_flight(TP0) == t.gap_count(TP0) == 0
    assert t.commit_candidates() == {}


def test_watermark_waits_for_lowest_pending() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    e = t.assign(TP0)
    for off in (10, 11, 12, 15):  # gap 13-14: compaction / transaction markers
        t.track(TP0, off)
    assert t.watermark(TP0) == 10
    assert t.done(TP0, 12, e) and t.done(TP0, 15, e)
    assert t.watermark(TP0) == 10
    assert t.gap_count(TP0) == 2 and t.in_flight(TP0) == 2
    assert t.done(TP0, 10, e)
    assert t.watermark(TP0) == t.oldest_pending(TP0) == 11
    assert t.done(TP0, 11, e)
    assert t.watermark(TP0) == 16  # last tracked + 1, skipping the gap
    assert t.oldest_pending(TP0) is None
    assert t.gap_count(TP0) == t.in_flight(TP0) == 0


def test_done_rejects_unknown_duplicate_stale_and_unassigned() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    e = t.assign(TP0)
    t.track(TP0, 5)
    t.track(TP0, 7)
    assert not t.done(TP0, 6, e)  # never tracked (gap)
    assert not t.done(TP0, 5, e + 1)  # wrong epoch
    assert not t.done(TP1, 5, e)  # unassigned
    assert t.done(TP0, 7, e)
    assert not t.done(TP0, 7, e)  # already done (above the watermark)
    assert t.done(TP0, 5, e)
    assert not t.done(TP0, 5, e)  # already done (below the watermark)
    assert t.watermark(TP0) == 8


def test_done_many_counts_accepted() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    e = t.assign(TP0)
    for off in range(5):
        t.track(TP0, off)
    assert t.done_many(TP0, [4, 0, 0, 9, 1], e) == 3
    assert t.done_many(TP0, [2, 3], e + 1) == 0
    assert t.watermark(TP0) == 2
    assert t.done_many(TP0, iter([2, 3]), e) == 2
    assert t.watermark(TP0) == 5


def test_stale_epoch_ignored_after_revoke_and_assign() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    old = t.assign(TP0)
    t.track(TP0, 100)
    t.mark_committed(TP0, 100)
    t.revoke(TP0)
    assert t.epoch(TP0) is None and t.partitions() == []
    assert not t.done(TP0, 100, old)
    new = t.assign(TP0)
    assert new > old
    assert t.committed(TP0) is None  # fresh state
    t.track(TP0, 100)  # the new assignment re-reads from the committed offset
    assert not t.done(TP0, 100, old)  # completion from the old assignment
    assert t.watermark(TP0) == 100
    assert t.done(TP0, 100, new)
    assert t.watermark(TP0) == 101


def test_assign_again_resets_state_and_bumps_epoch() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    e1 = t.assign(TP0)
    t.track(TP0, 50)
    e2 = t.assign(TP0)
    e3 = t.assign(TP1)
    assert e1 < e2 < e3
    assert t.watermark(TP0) is None
    t.track(TP0, 3)  # lower than before: allowed after a fresh assign
    assert t.watermark(TP0) == 3


def test_track_errors() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    with pytest.raises(KeyError):
        t.track(TP0, 0)
    t.assign(TP0)
    t.track(TP0, 10)
    with pytest.raises(ValueError):
        t.track(TP0, 10)
    with pytest.raises(ValueError):
        t.track(TP0, 9)
    assert t.in_flight(TP0) == 1 and t.watermark(TP0) == 10


def test_unassigned_queries() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    for query in (t.watermark, t.oldest_pending, t.gap_count, t.in_flight):
        with pytest.raises(KeyError):
            query(TP0)
    assert t.epoch(TP0) is None
    assert t.committed(TP0) is None
    t.mark_committed(TP0, 5)  # ignored
    assert t.committed(TP0) is None
    t.revoke(TP0)  # no-op


def test_commit_candidates_and_mark_committed() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    e0, e1 = t.assign(TP0), t.assign(TP1)
    t.assign(TP2)  # nothing tracked: never a candidate
    t.track(TP0, 0)
    t.track(TP1, 7)
    assert t.commit_candidates() == {TP0: 0, TP1: 7}  # nothing committed yet
    t.mark_committed(TP0, 0)
    t.mark_committed(TP1, 7)
    assert t.commit_candidates() == {}
    t.done(TP0, 0, e0)
    assert t.commit_candidates() == {TP0: 1}
    t.mark_committed(TP0, 1)
    assert t.committed(TP0) == 1
    assert t.commit_candidates() == {}
    t.done(TP1, 7, e1)
    assert t.commit_candidates() == {TP1: 8}


def test_sums_over_partitions() -> None:
    t: OffsetTracker[Partition] = OffsetTracker()
    e0, e1 = t.assign(TP0), t.assign(TP1)
    for off in range(4):
        t.track(TP0, off)
        t.track(TP1, off)
    t.done_many(TP0, [2, 3], e0)
    t.done_many(TP1, [1], e1)
    assert t.gap_count() == 3 and t.in_flight() == 5


@dataclass
class _Model:
    epoch: int
    tracked: list[int] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    committed: int | None = None

    @property
    def pending(self) -> set[int]:
        return set(self.tracked) - self.done

    @property
    def watermark(self) -> int | None:
        if self.pending:
            return min(self.pending)
        return self.tracked[-1] + 1 if self.tracked else None


PARTITIONS = [TP0, TP1, TP2]
partitions = st.sampled_from(PARTITIONS)


class OffsetsMachine(RuleBasedStateMachine):
    """Random interleavings of assign / revoke / track / done / commit against a set model."""

    def __init__(self) -> None:
        super().__init__()
        self.t: OffsetTracker[Partition] = OffsetTracker()
        self.models: dict[Partition, _Model] = {}
        self.epochs_seen: list[int] = []
        self.last_watermark: dict[Partition, int | None] = {}

    @rule(tp=partitions)
    def assign(self, tp: Partition) -> None:
        epoch = self.t.assign(tp)
        assert all(epoch > e for e in self.epochs_seen)
        self.epochs_seen.append(epoch)
        self.models[tp] = _Model(epoch)
        self.last_watermark[tp] = None

    @rule(tp=partitions)
    def revoke(self, tp: Partition) -> None:
        self.t.revoke(tp)
        self.models.pop(tp, None)

    @rule(tp=partitions, gap=st.integers(1, 4), start=st.integers(0, 1000), count=st.integers(1, 5))
    def track(self, tp: Partition, gap: int, start: int, count: int) -> None:
        model = self.models.get(tp)
        if model is None:
            with pytest.raises(KeyError):
                self.t.track(tp, start)
            return
        offset = model.tracked[-1] + gap if model.tracked else start
        for i in range(count):
            self.t.track(tp, offset + i)
            model.tracked.append(offset + i)

    @rule(tp=partitions, back=st.integers(0, 5))
    def track_not_increasing(self, tp: Partition, back: int) -> None:
        model = self.models.get(tp)
        if model is None or not model.tracked:
            return
        with pytest.raises(ValueError):
            self.t.track(tp, model.tracked[-1] - back)

    @rule(
        tp=partitions,
        data=st.data(),
        epoch_kind=st.sampled_from(["current", "current", "current", "stale", "future"]),
    )
    def done(self, tp: Partition, data: st.DataObject, epoch_kind: str) -> None:
        model = self.models.get(tp)
        tracked = list(model.tracked) if model else []
        # usually a tracked offset (maybe already done), sometimes any offset (mostly never tracked)
        if tracked and data.draw(st.integers(0, 3), label="pick tracked") > 0:
            offset = data.draw(st.sampled_from(tracked), label="tracked offset")
        else:
            offset = data.draw(st.integers(-2, 1100), label="any offset")
        if epoch_kind == "stale" and self.epochs_seen:
            epoch = data.draw(st.sampled_from(self.epochs_seen), label="old epoch")
        elif epoch_kind == "future":
            epoch = (self.epochs_seen[-1] if self.epochs_seen else 0) + 1
        else:
            epoch = model.epoch if model else (self.epochs_seen[-1] if self.epochs_seen else 1)
        expected = model is not None and epoch == model.epoch and offset in model.pending
        assert self.t.done(tp, offset, epoch) is expected
        if expected:
            model.done.add(offset)

    @rule(tp=partitions, data=st.data())
    def done_many(self, tp: Partition, data: st.DataObject) -> None:
        model = self.models.get(tp)
        pool = list(model.tracked) if model and model.tracked else [0]
        offsets = data.draw(st.lists(st.sampled_from(pool) | st.integers(-1, 1100), max_size=8))
        epoch = model.epoch if model else 0
        expected = 0
        if model is not None:
            pending = model.pending
            for off in offsets:
                if off in pending:
                    pending.discard(off)
                    model.done.add(off)
                    expected += 1
        assert self.t.done_many(tp, offsets, epoch) == expected

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        expected = {
            tp: m.watermark
            for tp, m in self.models.items()
            if m.watermark is not None and (m.committed is None or m.watermark > m.committed)
        }
        candidates = self.t.commit_candidates()
        assert candidates == expected
        for tp, offset in candidates.items():
            if data.draw(st.booleans(), label=f"commit {tp}"):
                self.t.mark_committed(tp, offset)
                self.models[tp].committed = offset
                assert self.t.committed(tp) == offset
        assert all(self.t.commit_candidates().get(tp) is None for tp, m in self.models.items()
                   if m.committed is not None and m.committed == m.watermark)

    @rule(tp=partitions, offset=st.integers(0, 1100))
    def mark_committed_any(self, tp: Partition, offset: int) -> None:
        self.t.mark_committed(tp, offset)
        if tp in self.models:
            self.models[tp].committed = offset

    @invariant()
    def matches_model(self) -> None:
        assert set(self.t.partitions()) == set(self.models)
        for tp in PARTITIONS:
            model = self.models.get(tp)
            if model is None:
                assert self.t.epoch(tp) is None and self.t.committed(tp) is None
                with pytest.raises(KeyError):
                    self.t.watermark(tp)
                continue
            wm = self.t.watermark(tp)
            assert wm == model.watermark
            assert self.t.epoch(tp) == model.epoch
            assert self.t.committed(tp) == model.committed
            if wm is not None:
                # the watermark never passes a pending offset
                assert all(off in model.done for off in model.tracked if off < wm)
                if not model.pending:
                    assert wm == model.tracked[-1] + 1
                # and never moves back within one assignment
                previous = self.last_watermark.get(tp)
                assert previous is None or wm >= previous
            self.last_watermark[tp] = wm
            assert self.t.gap_count(tp) == sum(1 for off in model.done if wm is not None and off > wm)
            assert self.t.in_flight(tp) == len(model.pending)
            assert self.t.oldest_pending(tp) == (min(model.pending) if model.pending else None)
        assert self.t.gap_count() == sum(self.t.gap_count(tp) for tp in self.models)
        assert self.t.in_flight() == sum(len(m.pending) for m in self.models.values())


TestOffsetsMachine = OffsetsMachine.TestCase
TestOffsetsMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --------------------------------------------------------------------------- bulk operations


@given(
    runs=st.lists(st.lists(st.integers(0, 60), max_size=8), max_size=8),
    done=st.lists(st.integers(0, 60), max_size=40),
)
def test_track_many_and_done_many_equal_one_at_a_time(runs: list[list[int]], done: list[int]) -> None:
    bulk: OffsetTracker[str] = OffsetTracker()
    single: OffsetTracker[str] = OffsetTracker()
    e = bulk.assign(TP0)
    assert single.assign(TP0) == e
    for run in runs:
        bulk_error = single_error = None
        try:
            bulk.track_many(TP0, run)
        except ValueError as exc:
            bulk_error = exc
        # one at a time, all or nothing: check the whole run first, as track_many promises
        last = single.last_tracked(TP0)
        ok = all(b > a for a, b in zip([-1 if last is None else last, *run], run))
        if ok:
            for off in run:
                single.track(TP0, off)
        else:
            single_error = True
        assert (bulk_error is None) == (single_error is None)
        assert bulk.watermark(TP0) == single.watermark(TP0)
    half = len(done) // 2
    for chunk in (done[:half], done[half:]):
        assert bulk.done_many(TP0, chunk, e) == sum(single.done(TP0, off, e) for off in chunk)
        assert bulk.watermark(TP0) == single.watermark(TP0)
        assert bulk.gap_count() == single.gap_count()
        assert bulk.in_flight() == single.in_flight()


def test_track_many_rejects_backwards_runs_without_changing_anything() -> None:
    t: OffsetTracker[str] = OffsetTracker()
    t.assign(TP0)
    t.track_many(TP0, [3, 4, 9])
    for bad in ([9, 10], [10, 10], [12, 11], [2]):
        with pytest.raises(ValueError):
            t.track_many(TP0, bad)
    assert t.last_tracked(TP0) == 9 and t.in_flight() == 3 and t.watermark(TP0) == 3


def test_advance_moves_only_an_idle_watermark_and_never_down() -> None:
    from ingest.core.offsets import OffsetTracker

    t: OffsetTracker[str] = OffsetTracker()
    e = t.assign("p")
    assert t.advance("p", 5) is True and t.watermark("p") == 5  # nothing tracked yet: the start position
    t.track_many("p", [5, 6, 7])
    assert t.advance("p", 9) is False, "records in flight"
    t.done_many("p", [5, 6, 7], e)
    assert t.watermark("p") == 8
    assert t.advance("p", 8) is False and t.advance("p", 7) is False
    assert t.advance("p", 9) is True and t.watermark("p") == 9  # a marker at offset 8
    assert t.commit_candidates() == {"p": 9}
    t.track("p", 9)
    assert t.watermark("p") == 9
    assert t.advance("unassigned", 3) is False
