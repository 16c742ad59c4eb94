"""stable_hash and LaneRouter: stable, even, round robin for unkeyed records."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.core.routing import LaneRouter, stable_hash


def test_stable_hash_pinned_values() -> None:
    # Changing these re-shuffles every key across lanes: do it on purpose only.
    assert stable_hash(b"hello") == 907060870 == 0x3610A686
    assert stable_hash(b"") == 0
    assert stable_hash(b"order-42") == 1475806942
    assert LaneRouter(8).lane(b"hello") == 907060870 % 8 == 6


def test_stable_hash_same_in_other_processes() -> None:
    code = "from ingest.core.routing import stable_hash; print(stable_hash(b'customer-17'))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {str(stable_hash(b"customer-17"))}


@given(st.binary(max_size=64))
@settings(max_examples=200, deadline=None)
def test_stable_hash_is_crc32(key: bytes) -> None:
    assert stable_hash(key) == zlib.crc32(key)
    assert 0 <= stable_hash(key) < 2**32


@given(lanes=st.integers(1, 64), key=st.binary(max_size=64))
@settings(max_examples=200, deadline=None)
def test_same_key_same_lane(lanes: int, key: bytes) -> None:
    a, b = LaneRouter(lanes), LaneRouter(lanes, "lane0")
    lane = a.lane(key)
    assert 0 <= lane < lanes
    assert lane == stable_hash(key) % lanes
    a.lane(None)  # the round-robin counter does not affect keyed records
    assert a.lane(key) == lane == b.lane(key)


def test_empty_key_is_a_key() -> None:
    r = LaneRouter(4)
    assert [r.lane(b"") for _ in range(5)] == [0] * 5


@pytest.mark.parametrize("lanes", [2, 3, 8, 16])
def test_distribution_roughly_even(lanes: int) -> None:
    rng = random.Random(1234)
    r = LaneRouter(lanes)
    n = 20_000
    counts = Counter(r.lane(rng.randbytes(rng.randint(4, 24))) for _ in range(n))
    assert set(counts) == set(range(lanes))
    expected = n / lanes
    assert all(abs(c - expected) < 0.1 * expected for c in counts.values()), counts


def test_distribution_of_sequential_keys() -> None:
    r = LaneRouter(8)
    counts = Counter(r.lane(f"user-{i}".encode()) for i in range(8_000))
    assert all(abs(c - 1000) < 100 for c in counts.values()), counts


@given(lanes=st.integers(1, 16), n=st.integers(0, 100))
@settings(max_examples=100, deadline=None)
def test_round_robin_cycles(lanes: int, n: int) -> None:
    r = LaneRouter(lanes)
    assert [r.lane(None) for _ in range(n)] == [i % lanes for i in range(n)]


def test_lane0_sends_unkeyed_to_lane_zero() -> None:
    r = LaneRouter(5, unkeyed="lane0")
    assert [r.lane(None) for _ in range(7)] == [0] * 7


@pytest.mark.parametrize("lanes", [0, -1])
def test_rejects_bad_lanes(lanes: int) -> None:
    with pytest.raises(ValueError):
        LaneRouter(lanes)


def test_rejects_bad_unkeyed() -> None:
    with pytest.raises(ValueError):
        LaneRouter(2, unkeyed="random")  # type: ignore[arg-type]


def test_key_bytes_are_equal_exactly_for_equal_keys_and_pinned() -> None:
    from datetime import datetime, timedelta, timezone
    from decimal import Decimal
    from uuid import UUID

    from ingest.core.routing import key_bytes

    assert key_bytes(42) == b"42" and key_bytes("é") == "é".encode() and key_bytes((1, "a")) == b"1:11:a"
    assert key_bytes(Decimal("1.0")) == key_bytes(Decimal("1.00")) == key_bytes(Decimal("1"))
    assert key_bytes(Decimal("-0")) == key_bytes(Decimal("0")) and key_bytes(-0.0) == key_bytes(0.0)
    noon = datetime(2024, 1, 1, 12, tzinfo=timezone.utc)
    assert key_bytes(noon) == key_bytes(noon.astimezone(timezone(timedelta(hours=5))))
    assert key_bytes(UUID(int=1)) == b"00000000-0000-0000-0000-000000000001"
    assert key_bytes(True) != key_bytes(1) and key_bytes(b"\x00raw") == b"\x00raw"
    assert len({key_bytes(v) for v in (1, 2, "1:", (1,), (1, 2), (12,), ("1:1",))}) == 7  # unambiguous framing

