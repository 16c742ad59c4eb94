"""AgingPriorityQueue: exact aging order, FIFO ties, starvation bound, bounded size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.core.priority import (
    AgingPriorityQueue,
    Popped,
    QueueFull,
    effective_priority,
)

# An operation list: ("push", priority, dt) advances the clock by dt then pushes;
# ("pop", dt) advances the clock by dt then pops.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(-3, 3), st.integers(0, 50)),
        st.tuples(st.just("pop"), st.integers(0, 50)),
    ),
    max_size=80,
)


def _run(q: AgingPriorityQueue[int], ops: list[tuple], drain: bool = True) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]:
    """Apply ops; items are push sequence numbers. Return {item: (priority, pushed_ms)} and [(item, popped_ms)] in pop order."""
    now = 0
    pushed: dict[int, tuple[int, int]] = {}
    popped: list[tuple[int, int]] = []
    for op in ops:
        if op[0] == "push":
            now += op[2]
            if q.is_full:
                continue
            item = len(pushed)
            q.push(item, op[1], now)
            pushed[item] = (op[1], now)
        else:
            now += op[1]
            got = q.pop(now)
            if got is not None:
                popped.append((got, now))
    while drain and len(q):
        popped.append((q.pop(now), now))  # type: ignore[arg-type]
    return pushed, popped


@pytest.mark.parametrize("args", [(0, 1), (1, 0), (-5, 10), (10, -1)])
def test_rejects_bad_params(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        AgingPriorityQueue(*args)


def test_empty() -> None:
    q: AgingPriorityQueue[str] = AgingPriorityQueue(100, 4)
    assert len(q) == 0 and not q.is_full
    assert q.pop(0) is None and q.pop_entry(0) is None and q.peek() is None
    assert q.lowest_priorities() == [] and q.counts_by_priority() == {}
    assert q.oldest_pushed_ms() is None


def test_queue_full_and_failed_push_changes_nothing() -> None:
    q: AgingPriorityQueue[str] = AgingPriorityQueue(100, 2)
    q.push("a", 0, 0)
    q.push("b", 5, 1)
    assert q.is_full
    with pytest.raises(QueueFull):
        q.push("c", 99, 2)
    assert len(q) == 2 and q.counts_by_priority() == {0: 1, 5: 1}
    assert q.pop(3) == "b"
    assert not q.is_full
    q.push("c", 99, 4)
    assert [q.pop(5), q.pop(5)] == ["c", "a"]


@given(capacity=st.integers(1, 10), n=st.integers(0, 30))
def test_bounded(capacity: int, n: int) -> None:
    q: AgingPriorityQueue[int] = AgingPriorityQueue(10, capacity)
    accepted = 0
    for i in range(n):
        try:
            q.push(i, i % 3, i)
            accepted += 1
        except QueueFull:
            assert len(q) == capacity
    assert len(q) == accepted == min(n, capacity)


def test_higher_priority_first_then_aging_lets_old_item_win() -> None:
    q: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms_per_level=100, max_items=10)
    q.push("low", 0, 0)
    q.push("high", 2, 150)  # at 150: low = 1.5, high = 2.0
    assert q.peek() == "high"
    assert q.pop(150) == "high"
    q.push("high2", 2, 250)  # at 250: low = 2.5, high2 = 2.0
    assert q.pop(250) == "low"
    assert q.pop(250) == "high2"


def test_exact_tie_goes_to_earliest_push() -> None:
    q: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms_per_level=100, max_items=10)
    q.push("low", 0, 0)
    q.push("high", 1, 100)  # effective priorities equal at every later time
    assert effective_priority(0, 0, 500, 100) == effective_priority(1, 100, 500, 100)
    assert q.pop(500) == "low"


def test_pop_entry_metadata_and_counts() -> None:
    q: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms_per_level=10, max_items=10)
    q.push("a", 3, 100)
    q.push("b", 1, 120)
    q.push("c", 1, 130)
    assert q.counts_by_priority() == {1: 2, 3: 1}
    assert q.lowest_priorities() == [1, 3]
    assert q.oldest_pushed_ms() == 100
    assert q.pop_entry(160) == Popped(item="a", priority=3, pushed_ms=100, waited_ms=60)
    assert q.lowest_priorities() == [1]
    assert q.pop_entry(50) == Popped(item="b", priority=1, pushed_ms=120, waited_ms=0)  # clock anomaly: clamped
    assert q.counts_by_priority() == {1: 1}


def test_remove_if_keeps_order_of_the_rest() -> None:
    q: AgingPriorityQueue[tuple[str, int]] = AgingPriorityQueue(aging_ms_per_level=10, max_items=10)
    for i, (name, prio) in enumerate([("x", 0), ("y", 5), ("x", 5), ("y", 0), ("x", 2)]):
        q.push((name, i), prio, i)
    assert q.remove_if(lambda it: it[0] == "x") == [("x", 2), ("x", 4), ("x", 0)]
    assert q.remove_if(lambda it: it[0] == "z") == []
    assert q.counts_by_priority() == {0: 1, 5: 1}
    assert [q.pop(10), q.pop(10), q.pop(10)] == [("y", 1), ("y", 3), None]


@settings(max_examples=80)
@given(aging=st.integers(1, 40), ops=_ops)
def test_pop_returns_max_effective_priority_ties_fifo(aging: int, ops: list[tuple]) -> None:
    """Model check: every pop is the argmax of effective priority at that instant (exact integer arithmetic), ties FIFO."""
    q: AgingPriorityQueue[int] = AgingPriorityQueue(aging, 1000)
    model: dict[int, tuple[int, int]] = {}  # item -> (priority, pushed_ms)
    now = 0
    seq = 0
    for op in ops:
        if op[0] == "push":
            now += op[2]
            q.push(seq, op[1], now)
            model[seq] = (op[1], now)
            seq += 1
        else:
            now += op[1]
            got = q.pop(now)
            if not model:
                assert got is None
                continue
            # effective * aging = p * aging + (now - t): compare as integers; ties -> smallest seq.
            want = max(model, key=lambda i: (model[i][0] * aging + now - model[i][1], -i))
            assert got == want
            del model[got]
        assert len(q) == len(model)
        assert q.counts_by_priority() == {p: sum(1 for v in model.values() if v[0] == p) for p in sorted({v[0] for v in model.values()})}


@given(ops=_ops, aging=st.integers(1, 1000), prio=st.integers(-5, 5))
def test_equal_priorities_are_fifo(ops: list[tuple], aging: int, prio: int) -> None:
    ops = [("push", prio, op[2]) if op[0] == "push" else op for op in ops]
    q: AgingPriorityQueue[int] = AgingPriorityQueue(aging, 16)
    pushed, popped = _run(q, ops)
    assert [item for item, _ in popped] == sorted(pushed)


@settings(max_examples=80)
@given(aging=st.integers(1, 40), capacity=st.integers(1, 12), ops=_ops)
def test_never_overtaken_by_later_item_not_higher_by_more_than_its_wait(aging: int, capacity: int, ops: list[tuple]) -> None:
    """If Y is pushed after X and p(Y) - p(X) <= (t(Y) - t(X)) / aging, X is popped before Y."""
    q: AgingPriorityQueue[int] = AgingPriorityQueue(aging, capacity)
    pushed, popped = _run(q, ops)
    position = {item: i for i, (item, _) in enumerate(popped)}
    assert sorted(position) == sorted(pushed)  # everything pushed comes out exactly once
    for x, (px, tx) in pushed.items():
        for y, (py, ty) in pushed.items():
            if y > x and (py - px) * aging <= ty - tx:
                assert position[x] < position[y], (x, y, pushed[x], pushed[y])


@settings(max_examples=100, deadline=None)
@given(
    aging=st.integers(1, 50),
    gap=st.integers(0, 6),
    capacity=st.integers(2, 30),
    pushes_per_ms=st.integers(1, 3),
    pop_interval=st.integers(1, 4),
    t0=st.integers(0, 200),
    low_prio=st.integers(-3, 3),
)
def test_starvation_bound_under_continuous_high_priority_load(
    aging: int, gap: int, capacity: int, pushes_per_ms: int, pop_interval: int, t0: int, low_prio: int
) -> None:
    """A continuous stream of higher-priority pushes (faster than pops: the queue stays full, high sources
    are paused only while it is full) cannot keep a low item waiting beyond max_wait_ms(gap, pop_interval),
    and no high item pushed after waits_bound_ms(gap) overtakes it."""
    q: AgingPriorityQueue[tuple[str, int]] = AgingPriorityQueue(aging, capacity)
    bound = q.max_wait_ms(gap, pop_interval)
    high_prio = low_prio + gap
    low_pushed_at: int | None = None
    popped_after_low: list[int] = []  # push times of high items popped while low waited
    seq = 0
    for now in range(t0 + bound + pop_interval + 1):
        if now % pop_interval == 0:
            got = q.pop_entry(now)
            if got is not None and got.item[0] == "low":
                assert low_pushed_at is not None
                assert got.waited_ms <= bound
                assert all(t < low_pushed_at + q.waits_bound_ms(gap) for t in popped_after_low)
                return
            if got is not None and low_pushed_at is not None:
                popped_after_low.append(got.pushed_ms)
        if now >= t0 and low_pushed_at is None and not q.is_full:
            q.push(("low", 0), low_prio, now)
            low_pushed_at = now
        for _ in range(pushes_per_ms):
            if not q.is_full:  # a paused high source simply pushes later
                q.push(("high", seq), high_prio, now)
                seq += 1
    pytest.fail(f"low item pushed at {low_pushed_at} not popped within {bound} ms")


def test_starvation_bound_is_tight_for_a_saturated_stream() -> None:
    """With aging the low item waits about gap * aging under saturation (and strictly less without load)."""
    aging, gap = 100, 3
    q: AgingPriorityQueue[str] = AgingPriorityQueue(aging, 50)
    q.push("low", 0, 0)
    now = 0
    while True:
        q.push("high", gap, now)  # one per ms, one pop per ms: a standing backlog of ~1
        got = q.pop_entry(now)
        assert got is not None
        if got.item == "low":
            break
        now += 1
    assert q.waits_bound_ms(gap) - 1 <= got.waited_ms <= q.max_wait_ms(gap, 1)
    assert got.waited_ms == 300


def test_bounds() -> None:
    q: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms_per_level=1000, max_items=8)
    assert q.waits_bound_ms(10) == 10_000
    assert q.waits_bound_ms(0) == 0 and q.waits_bound_ms(-2) == 0
    assert q.max_wait_ms(10, 50) == 10_000 + 8 * 50
    with pytest.raises(ValueError):
        q.max_wait_ms(1, -1)


def test_large_clock_values_are_exact() -> None:
    """Epoch-millisecond clocks: integer ranks, no float drift."""
    t = 1_700_000_000_000
    q: AgingPriorityQueue[str] = AgingPriorityQueue(aging_ms_per_level=7, max_items=4)
    q.push("a", 0, t)
    q.push("b", 1, t + 7)  # tie with a forever -> a first
    q.push("c", 1, t + 6)  # one ms better than a
    assert [q.pop(t + 10), q.pop(t + 10), q.pop(t + 10)] == ["c", "a", "b"]
