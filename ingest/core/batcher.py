"""Size-, byte- and latency-bounded batching over a preallocated ring buffer.

A :class:`RingBatcher` holds at most ``max_rows`` items in a slot list that is
allocated once in ``__init__`` and reused for the life of the batcher, so the
hot path allocates nothing per record beyond the caller's item. Positions are
a head index plus a count, modulo the capacity; :meth:`RingBatcher.drain`
takes everything, clears the slots it read (the buffer keeps no references to
drained items) and leaves the head where the next write continues.

The batcher never decides on its own to flush; it tells the caller why a flush
is due and the caller calls :meth:`~RingBatcher.drain`:

- ``add`` returns :attr:`FlushReason.SIZE` when the buffer just became full and
  :attr:`FlushReason.BYTES` when the byte total just reached ``max_bytes``;
- ``fits`` returning ``False`` means the caller must drain (reason ``BYTES``
  or ``SIZE``) before adding, so a record larger than ``max_bytes`` always ends
  up flushed alone;
- ``due(now_ms)`` returns :attr:`FlushReason.TIME` once the oldest buffered
  item has waited ``max_latency_ms``; ``deadline_ms`` says when that will be;
- ``SHUTDOWN`` and ``REVOKE`` are reasons the caller uses for its own drains.

Time is passed in as ``now_ms`` (any monotonic millisecond clock); nothing
here reads a clock, sleeps or locks. Not thread-safe.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["FlushReason", "RingBatcher"]


class FlushReason(str, enum.Enum):
    """Why a batch is flushed. The value is used as a metric label."""

    SIZE = "size"
    BYTES = "bytes"
    TIME = "time"
    SHUTDOWN = "shutdown"
    REVOKE = "revoke"


class RingBatcher(Generic[T]):
    """Preallocated ring buffer of max_rows slots, reused across flushes (the slot list is allocated once in __init__ and never reallocated)."""

    __slots__ = ("max_rows", "max_bytes", "max_latency_ms", "_slots", "_head", "_count", "_size_bytes", "_oldest_ms")

    def __init__(self, max_rows: int, max_bytes: int, max_latency_ms: int) -> None:
        """Create an empty batcher.

        Raises:
            ValueError: if ``max_rows``, ``max_bytes`` or ``max_latency_ms`` is < 1.
        """
        for name, value in (("max_rows", max_rows), ("max_bytes", max_bytes), ("max_latency_ms", max_latency_ms)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.max_latency_ms = max_latency_ms
        self._slots: list[T | None] = [None] * max_rows
        self._head = 0  # slot index of the oldest buffered item
        self._count = 0
        self._size_bytes = 0
        self._oldest_ms: int | None = None

    def __len__(self) -> int:
        """Return the number of buffered items."""
        return self._count

    @property
    def size_bytes(self) -> int:
        """Return the sum of the ``size_bytes`` given to :meth:`add` for the buffered items."""
        return self._size_bytes

    @property
    def oldest_ms(self) -> int | None:
        """Return the ``now_ms`` of the first :meth:`add` since the last drain, ``None`` when empty."""
        return self._oldest_ms

    def fits(self, size_bytes: int) -> bool:
        """Return whether an item of ``size_bytes`` may be added without draining first.

        ``True`` if the buffer is empty (any item fits alone, even one larger
        than ``max_bytes``); otherwise ``True`` iff there is a free slot and the
        byte total would stay ``<= max_bytes``. Never raises.
        """
        if self._count == 0:
            return True
        return self._count < self.max_rows and self._size_bytes + size_bytes <= self.max_bytes

    def add(self, item: T, size_bytes: int, now_ms: int) -> FlushReason | None:
        """Append ``item``; return the reason a flush is now due, if any.

        Returns:
            ``SIZE`` if the buffer now holds ``max_rows`` items, else ``BYTES``
            if the byte total is now ``>= max_bytes``, else ``None``.

        Raises:
            BufferError: if the buffer is already full (nothing is changed).
            ValueError: if ``size_bytes`` is negative (nothing is changed).
        """
        if self._count == self.max_rows:
            raise BufferError(f"batcher full ({self.max_rows} rows); drain before adding")
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        self._slots[(self._head + self._count) % self.max_rows] = item
        self._count += 1
        self._size_bytes += size_bytes
        if self._oldest_ms is None:
            self._oldest_ms = now_ms
        if self._count == self.max_rows:
            return FlushReason.SIZE
        if self._size_bytes >= self.max_bytes:
            return FlushReason.BYTES
        return None

    def add_many(self, items: Sequence[T], sizes: Sequence[int], now_ms: int, start: int = 0
                 ) -> tuple[int, FlushReason | None]:
        """Append ``items[start:]`` (with ``sizes``) until a flush is due; the bulk form of fits/add.

        Exactly equivalent to, for each ``i`` from ``start``: if not ``fits(sizes[i])``,
        stop before ``i`` with ``BYTES``; else ``add(items[i], sizes[i], now_ms)`` and
        stop after ``i`` if that returned a reason. (A full buffer cannot be met
        before an add: filling it returns ``SIZE`` at once.)

        Returns:
            ``(next, reason)``: the index of the first item not added (``len(items)``
            when all were) and the reason a flush is due now, or ``None``.

        Raises:
            BufferError: if the buffer is already full (nothing is changed).
            ValueError: if a size is negative (nothing is changed).
        """
        cap = self.max_rows
        free = cap - self._count
        if free == 0:
            raise BufferError(f"batcher full ({cap} rows); drain before adding")
        end = min(len(items), start + free)
        if end <= start:
            return start, None
        window = sizes[start:end]
        if min(window) < 0:
            raise ValueError(f"size_bytes must be >= 0, got {min(window)}")
        # totals[j]: the byte total after adding item start + j (non-decreasing: sizes >= 0).
        totals = list(itertools.accumulate(window, initial=self._size_bytes))[1:]
        reason: FlushReason | None = None
        n = len(totals)
        first_over = bisect.bisect_left(totals, self.max_bytes)  # first j with totals[j] >= max_bytes
        if first_over < n:
            if totals[first_over] == self.max_bytes or self._count + first_over == 0:
                n = first_over + 1  # added (fits, or alone in an empty buffer), then BYTES is due
            else:
                n = first_over  # does not fit: the caller drains first
            reason = FlushReason.BYTES
        if self._count + n == cap:
            reason = FlushReason.SIZE  # SIZE wins over BYTES, as in add()
        if n:
            pos = (self._head + self._count) % cap
            first_part = min(n, cap - pos)
            slots = self._slots
            slots[pos:pos + first_part] = items[start:start + first_part]
            if first_part < n:
                slots[0:n - first_part] = items[start + first_part:start + n]
            self._count += n
            self._size_bytes = totals[n - 1]
            if self._oldest_ms is None:
                self._oldest_ms = now_ms
        return start + n, reason

    def due(self, now_ms: int) -> FlushReason | None:
        """Return ``TIME`` iff non-empty and ``now_ms - oldest_ms >= max_latency_ms``, else ``None``. Never raises."""
        if self._oldest_ms is not None and now_ms - self._oldest_ms >= self.max_latency_ms:
            return FlushReason.TIME
        return None

    def deadline_ms(self) -> int | None:
        """Return ``oldest_ms + max_latency_ms`` (when :meth:`due` turns true), ``None`` when empty. Never raises."""
        return None if self._oldest_ms is None else self._oldest_ms + self.max_latency_ms

    def drain(self) -> list[T]:
        """Return all buffered items in insertion order and empty the buffer.

        The slots read are set back to ``None`` so the batcher keeps no
        reference to drained items. Returns ``[]`` when empty. Never raises.
        """
        slots, cap, head = self._slots, self.max_rows, self._head
        end = head + self._count
        # at most two slices (the buffered run may wrap around the end of the slot list)
        out: list[T] = slots[head:min(end, cap)]  # type: ignore[assignment]  # occupied slots hold a T
        slots[head:min(end, cap)] = itertools.repeat(None, len(out))
        if end > cap:
            out += slots[:end - cap]  # type: ignore[arg-type]
            slots[:end - cap] = itertools.repeat(None, end - cap)
        self._head = (self._head + self._count) % cap
        self._count = 0
        self._size_bytes = 0
        self._oldest_ms = None
        return out
