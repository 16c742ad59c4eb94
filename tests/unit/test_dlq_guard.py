"""DLQ guard (ingest/core/dlq_guard.py): stop a pipeline that dead-letters too much."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.config import DlqSettings
from ingest.core.dlq_guard import DlqGuard


def test_defaults_are_on_and_generous() -> None:
    d = DlqSettings()
    assert d.max_ratio == 0.5
    assert d.max_consecutive == 1000
    assert d.window == 1000
    assert d.max_replays == 3


def test_null_turns_a_limit_off() -> None:
    d = DlqSettings(max_ratio=None, max_consecutive=None)
    g = DlqGuard(d.max_ratio, d.max_consecutive, d.window)
    for _ in range(100):
        assert g.observe(1000, 1000) is None


def test_invalid_settings_rejected() -> None:
    with pytest.raises(ValueError):
        DlqGuard(0.5, 10, 0)
    with pytest.raises(ValueError):
        DlqSettings(max_ratio=0)
    with pytest.raises(ValueError):
        DlqSettings(max_ratio=1.5)
    with pytest.raises(ValueError):
        DlqSettings(max_consecutive=0)
    with pytest.raises(ValueError):
        DlqSettings(kind="kafka")  # a topic is required


# --------------------------------------------------------------------------- max_consecutive


def test_consecutive_trips_only_above_the_limit() -> None:
    g = DlqGuard(None, 50, 1000)
    for _ in range(5):
        assert g.observe(10, 10) is None  # 50 in a row: at the limit, not above
    why = g.observe(10, 10)
    assert why is not None
    assert "60 consecutive records dead-lettered" in why
    assert "max_consecutive=50" in why


def test_consecutive_exact_boundary_in_one_batch() -> None:
    assert DlqGuard(None, 50, 1000).observe(50, 50) is None
    assert DlqGuard(None, 50, 1000).observe(51, 51) is not None


def test_a_good_record_ends_the_run() -> None:
    g = DlqGuard(None, 50, 1000)
    assert g.observe(40, 40) is None
    assert g.observe(10, 9) is None  # a good record in this batch: the run restarts at 9
    assert g.observe(41, 41) is None  # 9 + 41 = 50
    assert g.observe(1, 1) is not None  # 51


def test_clean_batches_reset_the_run() -> None:
    g = DlqGuard(None, 10, 1000)
    for _ in range(50):
        assert g.observe(8, 8) is None
        assert g.observe(5, 0) is None


def test_empty_batches_are_ignored() -> None:
    g = DlqGuard(0.1, 5, 10)
    assert g.observe(0, 0) is None
    assert g.observe(5, 5) is None
    assert g.observe(0, 0) is None
    assert g.observe(-1, 0) is None
    assert g.observe(1, 1) is not None  # 6 > 5: the empty batches did not end the run


# --------------------------------------------------------------------------- max_ratio


def test_ratio_waits_for_a_full_window() -> None:
    g = DlqGuard(0.5, None, 100)
    for _ in range(9):
        assert g.observe(10, 10) is None  # 90 records, all dead, but the window is not full
    why = g.observe(10, 10)
    assert why is not None
    assert "100 of the last 100 records dead-lettered" in why
    assert "max_ratio=0.5" in why


def test_ratio_at_the_limit_does_not_trip() -> None:
    g = DlqGuard(0.5, None, 100)
    for _ in range(10):
        assert g.observe(10, 5) is None  # exactly 50 %
    assert g.observe(10, 6) is not None  # 51 of the last 100


def test_ratio_window_slides() -> None:
    g = DlqGuard(0.2, None, 100)
    for _ in range(100):
        assert g.observe(10, 0) is None  # 1000 clean records
    # 20 % dead over the last 100: at the limit
    assert g.observe(10, 10) is None
    assert g.observe(10, 10) is None
    for _ in range(8):
        assert g.observe(10, 0) is None
    # the two dead batches slide out of the window; a third alone is 10 %
    for _ in range(10):
        assert g.observe(10, 0) is None
    assert g.observe(10, 10) is None
    assert g.observe(10, 10) is None
    assert g.observe(10, 10) is not None  # 30 of the last 100


def test_one_huge_batch_covers_the_window() -> None:
    g = DlqGuard(0.5, None, 1000)
    assert g.observe(5000, 2000) is None  # 40 %
    assert g.observe(5000, 3000) is not None  # the window is the last batch (60 %)


def test_sparse_poison_never_trips_defaults() -> None:
    d = DlqSettings()
    g = DlqGuard(d.max_ratio, d.max_consecutive, d.window)
    for _ in range(1000):
        assert g.observe(500, 5) is None  # 1 % poison, as in a healthy stream


# --------------------------------------------------------------------------- property: reference model


def reference_first_trip(outcomes: list[bool], max_ratio: float | None, max_consecutive: int | None,
                         window: int) -> int | None:
    """Index of the record at which a per-record guard first trips (records fed one at a time)."""
    run = 0
    for i, dead in enumerate(outcomes):
        run = run + 1 if dead else 0
        if max_consecutive is not None and run > max_consecutive:
            return i
        seen = outcomes[: i + 1]
        if max_ratio is not None and len(seen) >= window:
            last = seen[-window:]
            if sum(last) / window > max_ratio:
                return i
    return None


@settings(max_examples=300, deadline=None)
@given(
    outcomes=st.lists(st.booleans(), max_size=300),
    max_ratio=st.none() | st.sampled_from([0.1, 0.25, 0.5, 0.9, 1.0]),
    max_consecutive=st.none() | st.integers(min_value=1, max_value=40),
    window=st.integers(min_value=1, max_value=60),
)
def test_property_matches_reference_one_record_at_a_time(outcomes, max_ratio, max_consecutive, window) -> None:
    g = DlqGuard(max_ratio, max_consecutive, window)
    first = None
    for i, dead in enumerate(outcomes):
        if g.observe(1, int(dead)) is not None:
            first = i
            break
    assert first == reference_first_trip(outcomes, max_ratio, max_consecutive, window)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.floats(0, 1)), max_size=100), st.integers(1, 500))
def test_property_clean_or_unlimited_never_trips(batches, window) -> None:
    clean = DlqGuard(0.01, 1, window)
    off = DlqGuard(None, None, window)
    for records, frac in batches:
        assert clean.observe(records, 0) is None
        assert off.observe(records, int(records * frac)) is None
