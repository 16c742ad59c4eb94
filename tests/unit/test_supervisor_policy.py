"""The supervisor's pure rules: restart backoff and crash loops, exit-code normalisation."""

from __future__ import annotations

import collections
import signal

import pytest

from ingest.supervisor.policy import (
    RestartPolicy,
    describe,
    failure_code,
    is_restartable,
    normalised_exit,
)


def test_backoff_doubles_per_recent_death_up_to_the_cap() -> None:
    p = RestartPolicy(max_restarts=10, window_s=60, backoff_s=1, max_backoff_s=5)
    deaths: collections.deque[float] = collections.deque()
    assert [p.next_delay_s(deaths, t) for t in (0, 1, 2, 3, 4)] == [1, 2, 4, 5, 5]


def test_more_deaths_than_max_restarts_in_the_window_is_a_crash_loop() -> None:
    p = RestartPolicy(max_restarts=2, window_s=10, backoff_s=1, max_backoff_s=30)
    deaths: collections.deque[float] = collections.deque()
    assert p.next_delay_s(deaths, 0) == 1
    assert p.next_delay_s(deaths, 1) == 2
    assert p.next_delay_s(deaths, 2) is None


def test_deaths_older_than_the_window_are_forgotten() -> None:
    p = RestartPolicy(max_restarts=2, window_s=10, backoff_s=1, max_backoff_s=30)
    deaths: collections.deque[float] = collections.deque()
    p.next_delay_s(deaths, 0)
    p.next_delay_s(deaths, 1)
    assert p.next_delay_s(deaths, 20) == 1  # both earlier deaths fell out of the window
    assert list(deaths) == [20]


@pytest.mark.parametrize(("rc", "killed", "expected"), [
    (None, False, 0), (0, False, 0), (1, False, 1), (2, False, 2), (3, False, 3), (130, False, 130),
    (7, False, 1), (-signal.SIGKILL, False, 1), (-signal.SIGKILL, True, 130),
])
def test_normalised_exit(rc: int | None, killed: bool, expected: int) -> None:
    assert normalised_exit(rc, killed_by_parent=killed) == expected


def test_restartable_and_failure_codes() -> None:
    assert [is_restartable(rc) for rc in (-9, 0, 130, 1, 2, 3)] == [True, True, True, False, False, False]
    assert [failure_code(rc) for rc in (1, 2, 3, 4, 255)] == [1, 2, 3, 1, 1]
    assert describe(-signal.SIGKILL) == "killed by SIGKILL" and describe(3) == "exit 3"
