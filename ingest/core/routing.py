"""Routing records to lanes: same key, same lane, in every process and run.

Per-key order is kept by sending every record with the same key to the same
lane (a lane writes its batches in order). The lane must not depend on the
process, so :func:`stable_hash` uses :func:`zlib.crc32` (C, fast, fixed by
the standard, unsigned 32-bit in Python 3) rather than the built-in
:func:`hash`, which is salted per process for ``bytes`` and ``str``.
Changing the hash re-shuffles keys across lanes, so it is pinned by a test.

Records without a key (``None``; ``b""`` is a key) have no order to keep and
are spread round robin, or all sent to lane 0 with ``unkeyed="lane0"``.

Pure logic: no I/O. Not thread-safe (the round-robin counter).
"""

from __future__ import annotations

import zlib
from typing import Literal

__all__ = ["LaneRouter", "stable_hash"]


def stable_hash(key: bytes) -> int:
    """Return ``zlib.crc32(key)``: an int in ``[0, 2**32)``, the same in every process and run. Never raises."""
    return zlib.crc32(key)


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
