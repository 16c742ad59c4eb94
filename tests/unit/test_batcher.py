"""RingBatcher: ring semantics, flush reasons, no loss/duplication/reordering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ingest.core.batcher import FlushReason, RingBatcher


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (-1, 10, 10), (10, 10, -5)])
def test_rejects_bad_params(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        RingBatcher(*args)


def test_empty_state() -> None:
    b: RingBatcher[str] = RingBatcher(3, 100, 50)
    assert len(b) == 0
    assert b.size_bytes == 0
    assert b.oldest_ms is None
    assert b.deadline_ms() is None
    assert b.due(10**12) is None
    assert b.drain() == []


def test_size_reason_and_buffer_error_when_full() -> None:
    b: RingBatcher[str] = RingBatcher(3, 1000, 50)
    assert b.add("a", 1, 0) is None
    assert b.add("b", 1, 0) is None
    assert b.add("c", 1, 0) is FlushReason.SIZE
    assert not b.fits(0)
    with pytest.raises(BufferError):
        b.add("d", 1, 0)
    assert len(b) == 3 and b.size_bytes == 3  # failed add changed nothing
    assert b.drain() == ["a", "b", "c"]


def test_size_wins_over_bytes_when_both_reached() -> None:
    b: RingBatcher[str] = RingBatcher(2, 10, 50)
    assert b.add("a", 5, 0) is None
    assert b.add("b", 5, 0) is FlushReason.SIZE


def test_bytes_reason_at_threshold() -> None:
    b: RingBatcher[str] = RingBatcher(10, 10, 50)
    assert b.add("a", 4, 0) is None
    assert b.fits(6) and not b.fits(7)
    assert b.add("b", 6, 0) is FlushReason.BYTES


def test_oversized_record_fits_only_when_empty_and_flushes_alone() -> None:
    b: RingBatcher[str] = RingBatcher(10, 10, 50)
    assert b.fits(1000)
    b.add("small", 1, 0)
    assert not b.fits(1000)
    assert b.drain() == ["small"]
    assert b.fits(1000)
    assert b.add("big", 1000, 0) is FlushReason.BYTES
    assert b.drain() == ["big"]


def test_negative_size_rejected() -> None:
    b: RingBatcher[str] = RingBatcher(3, 10, 50)
    with pytest.raises(ValueError):
        b.add("a", -1, 0)
    assert len(b) == 0 and b.oldest_ms is None


def test_time_reason_and_deadline() -> None:
    b: RingBatcher[str] = RingBatcher(10, 1000, 50)
    b.add("a", 1, 100)
    b.add("b", 1, 140)  # oldest stays at the first add
    assert b.oldest_ms == 100
    assert b.deadline_ms() == 150
    assert b.due(149) is None
    assert b.due(150) is FlushReason.TIME
    b.drain()
    assert b.oldest_ms is None and b.due(10**9) is None
    b.add("c", 1, 500)
    assert b.oldest_ms == 500 and b.deadline_ms() == 550


def test_ring_wraps_and_reuses_slots() -> None:
    b: RingBatcher[str] = RingBatcher(3, 1000, 50)
    slots = b._slots
    b.add("a", 1, 0)
    b.add("b", 1, 0)
    assert b.drain() == ["a", "b"]
    assert slots == [None, None, None]
    b.add("c", 1, 0)  # written after the previous head: slot 2, then wraps to 0, 1
    b.add("d", 1, 0)
    b.add("e", 1, 0)
    assert slots == ["d", "e", "c"]
    assert b.drain() == ["c", "d", "e"]
    assert b._slots is slots and slots == [None, None, None]


class BatcherMachine(RuleBasedStateMachine):
    """Random add / fits / due / drain sequences checked against a list model."""

    @initialize(
        max_rows=st.integers(1, 6),
        max_bytes=st.integers(1, 40),
        max_latency_ms=st.integers(1, 30),
    )
    def init(self, max_rows: int, max_bytes: int, max_latency_ms: int) -> None:
        self.b: RingBatcher[object] = RingBatcher(max_rows, max_bytes, max_latency_ms)
        self.slots = self.b._slots
        self.now_ms = 0
        self.added: list[object] = []
        self.drained: list[object] = []
        self.buffered: list[tuple[object, int]] = []
        self.oldest_ms: int | None = None

    def _advance(self, dt_ms: int) -> None:
        self.now_ms += dt_ms

    @rule(size_bytes=st.integers(0, 25), dt_ms=st.integers(0, 20))
    def add(self, size_bytes: int, dt_ms: int) -> None:
        self._advance(dt_ms)
        item = object()
        if len(self.buffered) == self.b.max_rows:
            with pytest.raises(BufferError):
                self.b.add(item, size_bytes, self.now_ms)
            return
        reason = self.b.add(item, size_bytes, self.now_ms)
        self.added.append(item)
        self.buffered.append((item, size_bytes))
        if self.oldest_ms is None:
            self.oldest_ms = self.now_ms
        total = sum(s for _, s in self.buffered)
        if len(self.buffered) == self.b.max_rows:
            assert reason is FlushReason.SIZE
        elif total >= self.b.max_bytes:
            assert reason is FlushReason.BYTES
        else:
            assert reason is None

    @rule(size_bytes=st.integers(0, 50))
    def fits(self, size_bytes: int) -> None:
        total = sum(s for _, s in self.buffered)
        expected = not self.buffered or (
            len(self.buffered) < self.b.max_rows and total + size_bytes <= self.b.max_bytes
        )
        assert self.b.fits(size_bytes) is expected

    @rule(dt_ms=st.integers(0, 40))
    def due(self, dt_ms: int) -> None:
        self._advance(dt_ms)
        reason = self.b.due(self.now_ms)
        if self.oldest_ms is not None and self.now_ms - self.oldest_ms >= self.b.max_latency_ms:
            assert reason is FlushReason.TIME
        else:
            assert reason is None

    @rule()
    def drain(self) -> None:
        out = self.b.drain()
        assert out == [item for item, _ in self.buffered]
        self.drained.extend(out)
        self.buffered.clear()
        self.oldest_ms = None
        assert all(slot is None for slot in self.b._slots)

    @invariant()
    def consistent(self) -> None:
        assert self.b._slots is self.slots  # never reallocated
        assert len(self.slots) == self.b.max_rows
        assert len(self.b) == len(self.buffered)
        assert sum(slot is not None for slot in self.slots) == len(self.buffered)
        assert self.b.size_bytes == sum(s for _, s in self.buffered)
        assert self.b.oldest_ms == self.oldest_ms
        expected_deadline = None if self.oldest_ms is None else self.oldest_ms + self.b.max_latency_ms
        assert self.b.deadline_ms() == expected_deadline
        # nothing lost, duplicated or reordered
        assert self.drained + [item for item, _ in self.buffered] == self.added


TestBatcherMachine = BatcherMachine.TestCase
TestBatcherMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --------------------------------------------------------------------------- add_many


def _add_one_at_a_time(b: RingBatcher[int], items: list[int], sizes: list[int], now_ms: int,
                       start: int) -> tuple[int, FlushReason | None]:
    """The reference add_many promises to equal: fits/add per item."""
    for i in range(start, len(items)):
        if not b.fits(sizes[i]):
            return i, FlushReason.BYTES
        reason = b.add(items[i], sizes[i], now_ms)
        if reason is not None:
            return i + 1, reason
    return len(items), None


@settings(max_examples=300)
@given(
    max_rows=st.integers(1, 9), max_bytes=st.integers(1, 60),
    sizes=st.lists(st.integers(0, 25), max_size=40), head_start=st.integers(0, 12), data=st.data(),
)
def test_add_many_equals_fits_and_add(max_rows: int, max_bytes: int, sizes: list[int], head_start: int,
                                      data: st.DataObject) -> None:
    bulk: RingBatcher[int] = RingBatcher(max_rows, max_bytes, 100)
    single: RingBatcher[int] = RingBatcher(max_rows, max_bytes, 100)
    for i in range(head_start):  # move the head so that bulk writes wrap around the ring
        for b in (bulk, single):
            b.add(-1, 0, 0)
            if len(b) == max_rows or i % 3 == 2:
                b.drain()
    items = list(range(len(sizes)))
    bulk_out: list[list[int]] = []
    single_out: list[list[int]] = []
    pos_bulk = pos_single = 0
    now = 0
    while pos_bulk < len(items) or pos_single < len(items):
        now += data.draw(st.integers(0, 3))
        nb, rb = bulk.add_many(items, sizes, now, pos_bulk)
        ns, rs = _add_one_at_a_time(single, items, sizes, now, pos_single)
        assert (nb, rb) == (ns, rs)
        assert (len(bulk), bulk.size_bytes, bulk.oldest_ms) == (len(single), single.size_bytes, single.oldest_ms)
        pos_bulk, pos_single = nb, ns
        if rb is not None or data.draw(st.booleans()):
            bulk_out.append(bulk.drain())
            single_out.append(single.drain())
    bulk_out.append(bulk.drain())
    single_out.append(single.drain())
    assert bulk_out == single_out
    assert [x for batch in bulk_out for x in batch if x >= 0] == items  # nothing lost, duplicated or reordered


def test_add_many_rejects_negative_sizes_and_full_buffer() -> None:
    b: RingBatcher[str] = RingBatcher(2, 100, 10)
    with pytest.raises(ValueError):
        b.add_many(["a", "b"], [1, -1], 0)
    assert len(b) == 0
    assert b.add_many(["a", "b", "c"], [1, 1, 1], 0) == (2, FlushReason.SIZE)
    with pytest.raises(BufferError):
        b.add_many(["c"], [1], 0)
