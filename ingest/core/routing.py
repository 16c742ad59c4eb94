"""Routing records to lanes: same row, same lane, in every process and run.

Order is kept by sending every record that can touch one row to the same lane
(a lane writes its batches in order). Which key decides:

- the sink's own key when it has one (the conflict key of an upsert table, the
  sorting key of a ClickHouse table): two records of one row can then never be
  in flight in two lanes at once, whatever their Kafka key -- records without a
  Kafka key included;
- otherwise (append-only tables) the ordering key: the pipeline's ``key`` path,
  else the Kafka key. Records without one (``None``; ``b""`` is a key) have no
  order to keep and are spread round robin, or all sent to lane 0 with
  ``unkeyed="lane0"`` (exactly-once mode uses ``offset % lanes``, which a replay
  repeats).

The lane must not depend on the process, so :func:`stable_hash` uses
:func:`zlib.crc32` (C, fast, fixed by the standard, unsigned 32-bit in Python 3)
rather than the built-in :func:`hash`, which is salted per process for ``bytes``
and ``str``; :func:`key_bytes` turns a row's key values into bytes that are
equal exactly when the values are equal as keys. Changing either re-shuffles
keys across lanes, so both are pinned by tests.

Pure logic: no I/O. Not thread-safe (the round-robin counter).
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any, Literal

__all__ = ["LaneRouter", "key_bytes", "stable_hash", "stream_id"]


def stable_hash(key: bytes) -> int:
    """Return ``zlib.crc32(key)``: an int in ``[0, 2**32)``, the same in every process and run. Never raises."""
    return zlib.crc32(key)


@functools.lru_cache(maxsize=65536)
def stream_id(topic: str, partition: int) -> int:
    """A partition as one signed 64-bit number (BLAKE2b of topic and partition): the *stream* a row's
    source column records, the same in every process. Never raises."""
    digest = hashlib.blake2b(b"%s\x00%d" % (topic.encode(), partition), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def key_bytes(value: Any) -> bytes:
    """The bytes a row key is routed by: equal for values that are equal as keys, in every process.

    ``value`` is one key column's value, or a tuple of them (a composite key). Values that compare
    equal get the same bytes: ``Decimal('1.0')`` and ``Decimal('1.00')``, ``-0.0`` and ``0.0``,
    aware datetimes of one instant in different zones. Never raises.
    """
    t = type(value)
    if t is int:
        return b"%d" % value
    if t is str:
        return value.encode("utf-8", "surrogatepass")
    if t is tuple:
        parts = [key_bytes(v) for v in value]
        return b"".join(b"%d:%s" % (len(p), p) for p in parts)
    return _other_key_bytes(value)


def _other_key_bytes(value: Any) -> bytes:
    if value is None:
        return b"\x00"
    if isinstance(value, bool):
        return b"\x01t" if value else b"\x01f"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, Decimal):
        if value.is_finite():
            value = value.normalize() if value else Decimal(0)
        return str(value).encode()
    if isinstance(value, float):
        return repr(value + 0.0).encode()  # -0.0 + 0.0 == 0.0
    if isinstance(value, datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(timezone.utc)
        return value.isoformat().encode()
    if isinstance(value, date):
        return value.isoformat().encode()
    return str(value).encode("utf-8", "surrogatepass")


class LaneRouter:
    """Maps a record key to a lane index in ``[0, lanes)``."""

    __slots__ = ("lanes", "unkeyed", "_next_lane")

    def __init__(self, lanes: int, unkeyed: Literal["round_robin", "lane0"] = "round_robin") -> None:
        """Create a router over ``lanes`` lanes.

        Raises:
            ValueError: if ``lanes < 1`` or ``unkeyed`` is not ``"round_robin"`` or ``"lane0"``.
        """
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        if unkeyed not in ("round_robin", "lane0"):
            raise ValueError(f"unkeyed must be 'round_robin' or 'lane0', got {unkeyed!r}")
        self.lanes = lanes
        self.unkeyed = unkeyed
        self._next_lane = 0

    def lane(self, key: bytes | None) -> int:
        """Return the lane for a record with this key. Never raises.

        A key (including ``b""``) maps to ``stable_hash(key) % lanes``.
        ``None`` maps to the next lane of a round-robin cycle starting at 0,
        or to 0 with ``unkeyed="lane0"``.
        """
        if key is not None:
            return stable_hash(key) % self.lanes
        if self.unkeyed == "lane0":
            return 0
        lane = self._next_lane
        self._next_lane = (lane + 1) % self.lanes
        return lane
