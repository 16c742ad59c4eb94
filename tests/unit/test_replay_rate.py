"""RateLimiter of ``ingest replay-dlq --rate`` (ingest/replay.py), on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.replay import RateLimiter


class FakeClock:
    """Time moves only when someone sleeps (or the test advances it)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, f"negative sleep {seconds}"
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("per_s", [None, 0, 0.0])
def test_unlimited_never_sleeps(per_s) -> None:
    clock = FakeClock()
    rl = RateLimiter(per_s, clock=clock, sleep=clock.sleep)
    for _ in range(1000):
        rl.acquire(10_000)
    assert clock.sleeps == []


def test_first_acquire_is_immediate() -> None:
    clock = FakeClock()
    rl = RateLimiter(10, clock=clock, sleep=clock.sleep)
    rl.acquire(1)
    assert clock.sleeps == []


def test_steady_rate_one_at_a_time() -> None:
    clock = FakeClock()
    rl = RateLimiter(10, clock=clock, sleep=clock.sleep)
    start = clock.now
    for _ in range(101):
        rl.acquire(1)
    # 101 records at 10/s: the 101st starts 10 s after the first.
    assert clock.now - start == pytest.approx(10.0)
    assert all(s == pytest.approx(0.1) for s in clock.sleeps)
    assert len(clock.sleeps) == 100


def test_chunks_pay_for_their_size() -> None:
    """replay-dlq acquires a whole chunk (up to 500) at once: the next chunk waits n/rate."""
    clock = FakeClock()
    rl = RateLimiter(100, clock=clock, sleep=clock.sleep)
    rl.acquire(500)
    assert clock.sleeps == []
    rl.acquire(500)
    assert clock.sleeps == [pytest.approx(5.0)]
    rl.acquire(1)
    assert clock.sleeps[-1] == pytest.approx(5.0)


def test_slow_work_between_acquires_is_not_charged_twice() -> None:
    clock = FakeClock()
    rl = RateLimiter(10, clock=clock, sleep=clock.sleep)
    rl.acquire(10)  # next allowed at +1 s
    clock.advance(0.4)  # the work itself took 0.4 s
    rl.acquire(10)
    assert clock.sleeps == [pytest.approx(0.6)]
    clock.advance(2.0)  # slower than the rate: no sleep needed
    rl.acquire(1)
    assert len(clock.sleeps) == 1


def test_idle_time_does_not_build_up_a_burst() -> None:
    clock = FakeClock()
    rl = RateLimiter(10, clock=clock, sleep=clock.sleep)
    rl.acquire(1)
    clock.advance(3600)  # an hour of nothing
    rl.acquire(1)
    assert clock.sleeps == []
    rl.acquire(1)  # no saved-up credit: the rate holds right away
    assert clock.sleeps == [pytest.approx(0.1)]


def test_fractional_rates() -> None:
    clock = FakeClock()
    rl = RateLimiter(0.5, clock=clock, sleep=clock.sleep)
    rl.acquire(1)
    rl.acquire(1)
    assert clock.sleeps == [pytest.approx(2.0)]


def test_default_clock_is_real_and_short_rates_are_cheap() -> None:
    import time

    rl = RateLimiter(1000)
    t0 = time.monotonic()
    for _ in range(50):
        rl.acquire(1)
    elapsed = time.monotonic() - t0
    assert 0.03 <= elapsed < 2.0  # 49 intervals of 1 ms


@settings(max_examples=300, deadline=None)
@given(
    per_s=st.floats(min_value=0.1, max_value=10_000),
    steps=st.lists(st.tuples(st.integers(min_value=1, max_value=500), st.floats(min_value=0, max_value=5)),
                   min_size=1, max_size=60),
)
def test_property_never_faster_than_the_rate(per_s: float, steps: list[tuple[int, float]]) -> None:
    """Each acquire returns no earlier than the previous one plus its records / rate, and never
    sleeps longer than needed for that."""
    clock = FakeClock()
    rl = RateLimiter(per_s, clock=clock, sleep=clock.sleep)
    prev_return: float | None = None
    prev_n = 0
    for n, work_s in steps:
        called = clock.now
        rl.acquire(n)
        returned = clock.now
        if prev_return is not None:
            earliest = prev_return + prev_n / per_s
            assert returned >= earliest - 1e-6 * max(1.0, earliest)
            # it sleeps only as long as necessary
            assert returned - called <= max(0.0, earliest - called) + 1e-6 * max(1.0, earliest)
        prev_return, prev_n = returned, n
        clock.advance(work_s)
    # Overall: records acquired before the last acquire took at least their share of time.
    total_before_last = sum(n for n, _ in steps[:-1])
    first_return = 1000.0
    assert prev_return is not None
    assert prev_return - first_return >= total_before_last / per_s - 1e-6 * max(1.0, prev_return)
