"""WriteScheduler: real threads, an injected clock.

- the slot budget is never exceeded (concurrent holders are counted);
- a freed slot goes to the most urgent waiter; equal priorities are FIFO;
- aging: a low-priority waiter beats a fresh high-priority one once it has waited
  ``gap * aging_ms_per_level`` ms, and under a continuous stream of high-priority
  arrivals it is granted within that window (plus one grant step);
- metrics (slots in use, queue length per priority, wait histogram per pipeline)
  appear in the registry passed in.

Orchestration: a waiter thread calls ``acquire`` and reports the grant; the test
decides when it releases. Threads are started one at a time and the test waits
until the scheduler shows them queued, so push order (and push time on the fake
clock) is exactly what the test says.
"""

from __future__ import annotations

import gc
import queue
import random
import threading
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from ingest.scheduler import WriteScheduler

TIMEOUT_S = 10.0


class FakeClock:
    """Milliseconds, advanced by the test only."""

    def __init__(self, start: int = 1_000_000) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> None:
        with self._lock:
            self._now += ms

    def set(self, ms: int) -> None:
        with self._lock:
            self._now = ms


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class Waiter(threading.Thread):
    """Acquires a slot, puts ``(name, waited_s)`` on ``granted``, holds until ``release()``."""

    def __init__(self, sched: WriteScheduler, name: str, priority: int,
                 granted: queue.SimpleQueue[tuple[str, float]]) -> None:
        super().__init__(name=f"waiter-{name}", daemon=True)
        self.sched = sched
        self.waiter_name = name
        self.priority = priority
        self.granted = granted
        self._go = threading.Event()
        self.waited_s: float | None = None

    def run(self) -> None:
        self.waited_s = self.sched.acquire(self.waiter_name, self.priority)
        self.granted.put((self.waiter_name, self.waited_s))
        self._go.wait(TIMEOUT_S)
        self.sched.release()

    def release(self) -> None:
        self._go.set()
        self.join(TIMEOUT_S)
        assert not self.is_alive(), f"{self.waiter_name} did not finish"


def enqueue(sched: WriteScheduler, name: str, priority: int,
            granted: queue.SimpleQueue[tuple[str, float]]) -> Waiter:
    """Start a waiter and return once it is queued in the scheduler (all slots must be taken)."""
    before = sched.waiting()
    w = Waiter(sched, name, priority, granted)
    w.start()
    wait_for(lambda: sched.waiting() == before + 1, f"{name} to be queued")
    return w


def next_grant(granted: queue.SimpleQueue[tuple[str, float]]) -> tuple[str, float]:
    return granted.get(timeout=TIMEOUT_S)


def drain_order(waiters: dict[str, Waiter],
                granted: queue.SimpleQueue[tuple[str, float]], release_holder: Callable[[], None]) -> list[str]:
    """Free the held slot and let each granted waiter release in turn; return the grant order."""
    release_holder()
    order: list[str] = []
    for _ in range(len(waiters)):
        name, _ = next_grant(granted)
        order.append(name)
        waiters[name].release()
    return order


# --------------------------------------------------------------------------- construction


def test_rejects_zero_slots() -> None:
    with pytest.raises(ValueError):
        WriteScheduler("db", 0)


def test_free_slot_granted_at_once_without_waiting() -> None:
    clock = FakeClock()
    sched = WriteScheduler("db", 2, clock=clock)
    assert sched.acquire("p", 0) == 0.0
    assert sched.acquire("p", 0) == 0.0
    assert sched.waiting() == 0
    sched.release()
    sched.release()
    with sched.slot("p", 3) as waited:
        assert waited == 0.0


# --------------------------------------------------------------------------- the budget


@pytest.mark.parametrize("slots", [1, 3])
def test_slots_never_exceeded_under_contention(slots: int) -> None:
    """Many threads with random priorities hammer the scheduler; concurrent holders ≤ slots."""
    sched = WriteScheduler("db", slots)  # real clock: aging plays along
    lock = threading.Lock()
    holders = 0
    peak = 0
    grants = 0
    errors: list[BaseException] = []
    threads_n, rounds = 12, 40
    # Every worker starts contending at once: on a loaded machine the threads start far apart, and a
    # worker could finish its rounds before the next one started (then the budget is never filled).
    start = threading.Barrier(threads_n)

    def worker(i: int) -> None:
        nonlocal holders, peak, grants
        rng = random.Random(i)
        try:
            start.wait(30)
            for _ in range(rounds):
                with sched.slot(f"p{i % 3}", rng.choice((0, 5, 10))):
                    with lock:
                        holders += 1
                        peak = max(peak, holders)
                        grants += 1
                        now = holders
                    assert now <= slots, f"{now} holders > {slots} slots"
                    time.sleep(rng.choice((0, 0, 0.0005, 0.001)))
                    with lock:
                        holders -= 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a worker is stuck (lost wake-up?)"
    assert not errors, errors[0]
    assert grants == threads_n * rounds
    assert peak == slots, f"peak {peak}: the test never filled the budget"
    assert holders == 0 and sched.waiting() == 0
    # Every slot came back: a full budget can be taken at once again.
    for _ in range(slots):
        assert sched.acquire("p", 0) == 0.0
    assert sched.waiting() == 0
    for _ in range(slots):
        sched.release()


def test_waiter_blocks_until_a_slot_is_released() -> None:
    clock = FakeClock()
    sched = WriteScheduler("db", 1, clock=clock)
    sched.acquire("holder", 0)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    w = enqueue(sched, "w", 0, granted)
    time.sleep(0.05)
    assert granted.empty(), "granted while the only slot was held"
    clock.advance(250)
    sched.release()
    name, waited = next_grant(granted)
    assert name == "w"
    assert waited == pytest.approx(0.25)  # measured on the injected clock
    w.release()
    assert sched.waiting() == 0


# --------------------------------------------------------------------------- ordering


def test_freed_slot_goes_to_highest_priority_waiter() -> None:
    clock = FakeClock()
    sched = WriteScheduler("db", 1, aging_ms_per_level=1000, clock=clock)
    sched.acquire("holder", 0)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    waiters: dict[str, Waiter] = {}
    # Pushed lowest first and 1 ms apart, so FIFO alone would give the opposite order.
    for name, prio in (("p0", 0), ("p3", 3), ("p-2", -2), ("p10", 10), ("p5", 5)):
        waiters[name] = enqueue(sched, name, prio, granted)
        clock.advance(1)
    order = drain_order(waiters, granted, sched.release)
    assert order == ["p10", "p5", "p3", "p0", "p-2"]


def test_one_freed_slot_wakes_exactly_one_waiter() -> None:
    clock = FakeClock()
    sched = WriteScheduler("db", 2, clock=clock)
    sched.acquire("h1", 0)
    sched.acquire("h2", 0)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    a = enqueue(sched, "a", 1, granted)
    b = enqueue(sched, "b", 2, granted)
    sched.release()
    assert next_grant(granted)[0] == "b"
    time.sleep(0.05)
    assert granted.empty(), "one release woke two waiters"
    assert sched.waiting() == 1
    sched.release()
    assert next_grant(granted)[0] == "a"
    a.release()
    b.release()
    assert sched.waiting() == 0


@pytest.mark.parametrize("tick_ms", [0, 3])
def test_equal_priorities_are_fifo(tick_ms: int) -> None:
    """Same priority: grant order == queue order (same millisecond: push order breaks the tie)."""
    clock = FakeClock()
    sched = WriteScheduler("db", 1, aging_ms_per_level=50, clock=clock)
    sched.acquire("holder", 7)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    names = [f"w{i}" for i in range(10)]
    waiters = {}
    for name in names:
        waiters[name] = enqueue(sched, name, 7, granted)
        clock.advance(tick_ms)
    assert drain_order(waiters, granted, sched.release) == names


def test_fifo_within_each_priority_level() -> None:
    clock = FakeClock()
    sched = WriteScheduler("db", 1, aging_ms_per_level=1000, clock=clock)
    sched.acquire("holder", 0)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    waiters = {}
    for name, prio in (("lo1", 0), ("hi1", 1), ("lo2", 0), ("hi2", 1), ("lo3", 0), ("hi3", 1)):
        waiters[name] = enqueue(sched, name, prio, granted)
        clock.advance(1)
    assert drain_order(waiters, granted, sched.release) == ["hi1", "hi2", "hi3", "lo1", "lo2", "lo3"]


# --------------------------------------------------------------------------- aging


@pytest.mark.parametrize(
    ("h_pushed_after_ms", "first"),
    [
        (0, "high"),
        (999, "high"),       # inside the window gap * A = 10 * 100 ms
        (1000, "low"),       # equal effective priority: the older one (FIFO)
        (1001, "low"),
        (5000, "low"),
    ],
)
def test_aging_window_is_gap_times_aging_ms(h_pushed_after_ms: int, first: str) -> None:
    """Priorities 0 and 10, aging 100 ms/level: a fresh priority-10 waiter goes first only if
    it arrived less than 10 * 100 ms after the priority-0 waiter."""
    aging, gap = 100, 10
    clock = FakeClock()
    sched = WriteScheduler("db", 1, aging_ms_per_level=aging, clock=clock)
    sched.acquire("holder", 0)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    low = enqueue(sched, "low", 0, granted)
    clock.advance(h_pushed_after_ms)
    high = enqueue(sched, "high", gap, granted)
    clock.advance(10)
    order = drain_order({"low": low, "high": high}, granted, sched.release)
    assert order[0] == first, order
    assert low.waited_s is not None and high.waited_s is not None
    # Waits as the injected clock measured them (grants happen without the clock moving).
    assert low.waited_s == pytest.approx((h_pushed_after_ms + 10) / 1000)
    assert high.waited_s == pytest.approx(10 / 1000)


@pytest.mark.parametrize(("aging", "gap", "step"), [(100, 10, 30), (40, 5, 7), (250, 2, 100)])
def test_low_priority_granted_within_bound_under_continuous_high_load(aging: int, gap: int, step: int) -> None:
    """One low-priority waiter against a never-ending stream of fresh high-priority waiters
    (every ``step`` ms one arrives and one write finishes, with two more already queued):
    exactly the high waiters pushed less than ``gap * aging`` ms after the low one overtake
    it, so it is granted within that window plus the backlog queued at its end."""
    clock = FakeClock()
    sched = WriteScheduler("db", 1, aging_ms_per_level=aging, clock=clock)
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    holder = Waiter(sched, "h-init", gap, granted)
    holder.start()
    assert next_grant(granted)[0] == "h-init"
    current = holder
    pushed_ms: dict[str, int] = {}
    highs: list[Waiter] = []

    def add_high(name: str) -> None:
        pushed_ms[name] = clock()
        highs.append(enqueue(sched, name, gap, granted))

    add_high("h-q0")
    add_high("h-q1")
    clock.advance(1)
    low = enqueue(sched, "low", 0, granted)
    low_pushed = clock()
    window_end = low_pushed + gap * aging
    overtook: list[str] = []
    for i in range(10 * gap * aging // step + 10):
        clock.advance(step)
        add_high(f"h{i}")  # a fresh urgent batch arrives
        current.release()  # and one write finishes: its slot passes on
        name, _ = next_grant(granted)
        if name == "low":
            current = low
            break
        current = next(w for w in highs if w.waiter_name == name)
        highs.remove(current)
        overtook.append(name)
    else:
        pytest.fail("the low-priority waiter starved")
    waited_ms = clock() - low_pushed
    assert low.waited_s == pytest.approx(waited_ms / 1000)
    # Exactly the high waiters pushed inside the window went first...
    assert all(pushed_ms[n] < window_end for n in overtook), [(n, pushed_ms[n] - low_pushed) for n in overtook]
    # ...and it was granted as soon as none of those was left.
    assert all(pushed_ms[w.waiter_name] >= window_end for w in highs)
    # The window was used in full (the stream never paused), and the extra wait is the
    # backlog at the window's end: the 2 pre-queued waiters plus the one arriving per step.
    assert gap * aging <= waited_ms <= gap * aging + 3 * step, (waited_ms, gap * aging)
    current.release()
    while highs:
        name, _ = next_grant(granted)
        w = next(x for x in highs if x.waiter_name == name)
        highs.remove(w)
        w.release()
    assert sched.waiting() == 0


# --------------------------------------------------------------------------- metrics


def _metric_values(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float | None:
    return registry.get_sample_value(name, labels)


def test_metrics_in_the_registry_passed_in() -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    sched = WriteScheduler("dbX", 1, aging_ms_per_level=100, clock=clock, metrics_registry=registry)
    names = {m.name for m in registry.collect()}
    assert {"ingest_write_queue_wait_seconds", "ingest_write_queue_length", "ingest_write_slots_in_use"} <= names

    sched.acquire("orders", 10)
    assert _metric_values(registry, "ingest_write_slots_in_use", {"database": "dbX"}) == 1
    granted: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    a = enqueue(sched, "clicks", 0, granted)
    b = enqueue(sched, "clicks", 0, granted)
    c = enqueue(sched, "orders", 10, granted)
    q = "ingest_write_queue_length"
    assert _metric_values(registry, q, {"database": "dbX", "priority": "0"}) == 2
    assert _metric_values(registry, q, {"database": "dbX", "priority": "10"}) == 1
    clock.advance(300)
    sched.release()
    assert next_grant(granted)[0] == "orders"  # c
    assert _metric_values(registry, q, {"database": "dbX", "priority": "10"}) == 0  # reset, not left stale
    assert _metric_values(registry, q, {"database": "dbX", "priority": "0"}) == 2
    assert _metric_values(registry, "ingest_write_slots_in_use", {"database": "dbX"}) == 1
    c.release()
    next_grant(granted)
    a.release()
    next_grant(granted)
    b.release()
    assert _metric_values(registry, q, {"database": "dbX", "priority": "0"}) == 0
    assert _metric_values(registry, "ingest_write_slots_in_use", {"database": "dbX"}) == 0

    h = "ingest_write_queue_wait_seconds"
    # One observation per acquire, per pipeline (the holder's immediate grant counts as 0 s).
    assert _metric_values(registry, f"{h}_count", {"pipeline": "orders"}) == 2
    assert _metric_values(registry, f"{h}_count", {"pipeline": "clicks"}) == 2
    assert _metric_values(registry, f"{h}_sum", {"pipeline": "orders"}) == pytest.approx(0.3)
    assert _metric_values(registry, f"{h}_sum", {"pipeline": "clicks"}) == pytest.approx(0.6)
    # Buckets: the 0.3 s wait is above 0.25 and within 0.5.
    assert _metric_values(registry, f"{h}_bucket", {"pipeline": "orders", "le": "0.25"}) == 1
    assert _metric_values(registry, f"{h}_bucket", {"pipeline": "orders", "le": "0.5"}) == 2


def test_two_schedulers_share_one_registry() -> None:
    """Two databases in one process: one set of metrics, labelled by database."""
    registry = CollectorRegistry()
    s1 = WriteScheduler("db0", 1, metrics_registry=registry)
    s2 = WriteScheduler("db1", 2, metrics_registry=registry)
    with s1.slot("a", 0), s2.slot("b", 0), s2.slot("b", 0):
        assert registry.get_sample_value("ingest_write_slots_in_use", {"database": "db0"}) == 1
        assert registry.get_sample_value("ingest_write_slots_in_use", {"database": "db1"}) == 2
    assert registry.get_sample_value("ingest_write_queue_wait_seconds_count", {"pipeline": "b"}) == 2


def test_metrics_reach_every_fresh_registry() -> None:
    """Each process (and each test) makes its own registry; a scheduler must register in the
    one it is given even after an earlier registry was garbage-collected."""
    for i in range(30):
        registry = CollectorRegistry()
        sched = WriteScheduler(f"db{i}", 1, metrics_registry=registry)
        with sched.slot("p", 0):
            assert registry.get_sample_value("ingest_write_slots_in_use", {"database": f"db{i}"}) == 1, (
                f"round {i}: the scheduler's metrics are not in the registry passed in")
        del sched, registry
        gc.collect()


def test_no_metrics_without_registry() -> None:
    sched = WriteScheduler("db", 1)
    with sched.slot("p", 0) as waited:
        assert waited >= 0
