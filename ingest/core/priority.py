"""Bounded priority queue with aging, for the per-database write scheduler.

Ready batches from every pipeline and lane wait here for a write slot. Each
item has a base ``priority`` (higher = more urgent) and the ``now_ms`` it was
pushed at; while it waits its *effective* priority grows by one level every
``aging_ms_per_level`` (``A``) milliseconds::

    effective(item, now) = priority + (now - pushed_ms) / A

:meth:`AgingPriorityQueue.pop` returns the item with the highest effective
priority at ``now``; ties go to the item pushed first (FIFO).

**Why one heap is exact.** Comparing two items at the same ``now``::

    p1 + (now - t1) / A  >  p2 + (now - t2) / A
    <=>  p1 * A - t1     >  p2 * A - t2          (multiply by A > 0, drop now / A)

so the order of the queued items is given by the integer *rank*
``priority * A - pushed_ms``, which does not depend on ``now``: aging never
reorders two items that are both waiting, it only places new arrivals behind
old ones. A single binary heap keyed on ``(-rank, seq)`` (``seq`` = push
counter, for FIFO ties) therefore yields exactly the aging order, with
O(log n) push and pop and no periodic re-scoring. Integers keep it exact (no
float drift, any ``now_ms`` magnitude). With equal priorities the rank is
``-pushed_ms`` and the queue is FIFO. ``now_ms`` is expected to be
non-decreasing (a monotonic clock); it does not affect which item ``pop``
returns, only the reported wait.

**Starvation bound.** Let item ``L`` (priority ``pL``) be pushed at ``t0`` and
``H`` (priority ``pL + gap``) at ``tH``. ``H`` is popped before ``L`` only if
``rank(H) > rank(L)`` (on equality ``L`` wins, being pushed first), i.e. only if
``tH < t0 + gap * A``. So items whose priority is higher by at most ``gap``
can *overtake* ``L`` only during the window of :meth:`waits_bound_ms`
``= max(gap, 0) * A`` ms after ``L`` was pushed, under any load. After the
window, only items already queued then can still go first; the queue holds at
most ``max_items`` items, so if the consumer pops at least once every ``P``
ms while the queue is non-empty, ``L`` is popped within
:meth:`max_wait_ms` ``= gap * A + max_items * P``. ``gap`` must be taken as the
highest priority that is ever pushed minus ``pL`` (items from further above
overtake for longer). With ``aging_ms_per_level=1000`` and priorities 10 and 0,
a priority-0 batch is overtaken by new priority-10 batches for at most 10 s.

**Bounded.** :meth:`~AgingPriorityQueue.push` raises :class:`QueueFull` at
``max_items``; the caller then pauses sources, lowest priority first
(:meth:`~AgingPriorityQueue.lowest_priorities`,
:meth:`~AgingPriorityQueue.counts_by_priority` also feed the queue-length
metric).

Pure logic: time is passed in as ``now_ms``; no I/O, no clock, no threads.
Not thread-safe: the scheduler owns it (or guards it with its own lock).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["AgingPriorityQueue", "Popped", "QueueFull", "effective_priority"]


class QueueFull(Exception):
    """Raised by :meth:`AgingPriorityQueue.push` when the queue holds ``max_items`` items."""


def effective_priority(priority: int, pushed_ms: int, now_ms: int, aging_ms_per_level: int) -> float:
    """Return ``priority + (now_ms - pushed_ms) / aging_ms_per_level`` (for logs and metrics; ordering uses integers).

    Raises:
        ZeroDivisionError: if ``aging_ms_per_level`` is 0.
    """
    return priority + (now_ms - pushed_ms) / aging_ms_per_level


@dataclass(frozen=True, slots=True)
class Popped(Generic[T]):
    """An item taken from the queue, with what the scheduler needs for its metrics."""

    item: T
    priority: int  # base priority given to push
    pushed_ms: int
    waited_ms: int  # max(0, now_ms - pushed_ms) at pop


# Heap entry: (-rank, seq, priority, pushed_ms, item). seq is unique, so tuple
# comparison never reaches the item (which need not be comparable).
_Entry = tuple[int, int, int, int, T]


class AgingPriorityQueue(Generic[T]):
    """Bounded priority queue where waiting improves priority: effective = priority + waited_ms / aging_ms_per_level."""

    __slots__ = ("aging_ms_per_level", "max_items", "_heap", "_seq", "_by_priority")

    def __init__(self, aging_ms_per_level: int, max_items: int) -> None:
        """Create an empty queue.

        Raises:
            ValueError: if ``aging_ms_per_level`` or ``max_items`` is < 1.
        """
        for name, value in (("aging_ms_per_level", aging_ms_per_level), ("max_items", max_items)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.aging_ms_per_level = aging_ms_per_level
        self.max_items = max_items
        self._heap: list[_Entry[T]] = []
        self._seq = 0
        self._by_priority: dict[int, int] = {}  # base priority -> number of queued items

    def __len__(self) -> int:
        """Return the number of queued items."""
        return len(self._heap)

    @property
    def is_full(self) -> bool:
        """Return whether the queue holds ``max_items`` items (the next :meth:`push` raises)."""
        return len(self._heap) >= self.max_items

    def push(self, item: T, priority: int, now_ms: int) -> None:
        """Queue ``item`` with base ``priority`` (higher = more urgent) at ``now_ms``. O(log n).

        Raises:
            QueueFull: if the queue already holds ``max_items`` items (nothing is changed).
        """
        if len(self._heap) >= self.max_items:
            raise QueueFull(f"priority queue full ({self.max_items} items); pause the lowest-priority sources")
        rank = priority * self.aging_ms_per_level - now_ms
        heapq.heappush(self._heap, (-rank, self._seq, priority, now_ms, item))
        self._seq += 1
        self._by_priority[priority] = self._by_priority.get(priority, 0) + 1

    def pop_entry(self, now_ms: int) -> Popped[T] | None:
        """Remove and return the item with the highest effective priority at ``now_ms``, with its metadata.

        Ties go to the item pushed first. Which item is returned does not
        depend on ``now_ms`` (see the module docstring); ``now_ms`` sets
        ``waited_ms``. Returns ``None`` when empty. O(log n). Never raises.
        """
        if not self._heap:
            return None
        _, _, priority, pushed_ms, item = heapq.heappop(self._heap)
        self._forget(priority)
        return Popped(item=item, priority=priority, pushed_ms=pushed_ms, waited_ms=max(0, now_ms - pushed_ms))

    def pop(self, now_ms: int) -> T | None:
        """Remove and return the item with the highest effective priority at ``now_ms`` (ties: FIFO); ``None`` when empty. Never raises."""
        popped = self.pop_entry(now_ms)
        return None if popped is None else popped.item

    def peek(self) -> T | None:
        """Return the item :meth:`pop` would return next, without removing it; ``None`` when empty. O(1). Never raises."""
        return self._heap[0][4] if self._heap else None

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Remove every queued item for which ``predicate`` is true (e.g. a stopped pipeline's batches).

        Returns:
            The removed items in pop order. The others keep their rank and
            FIFO position. O(n). Exceptions from ``predicate`` propagate and
            leave the queue unchanged.
        """
        keep: list[_Entry[T]] = []
        removed: list[_Entry[T]] = []
        for entry in self._heap:
            (removed if predicate(entry[4]) else keep).append(entry)
        if not removed:
            return []
        heapq.heapify(keep)
        self._heap = keep
        for entry in removed:
            self._forget(entry[2])
        removed.sort()
        return [entry[4] for entry in removed]

    def _forget(self, priority: int) -> None:
        left = self._by_priority[priority] - 1
        if left:
            self._by_priority[priority] = left
        else:
            del self._by_priority[priority]

    # -- introspection (pausing, metrics) ------------------------------------

    def counts_by_priority(self) -> dict[int, int]:
        """Return ``{base priority: queued items}`` for priorities with at least one queued item, ascending. Never raises."""
        return dict(sorted(self._by_priority.items()))

    def lowest_priorities(self) -> list[int]:
        """Return the distinct base priorities of the queued items, lowest first: the order to pause sources in when full. Never raises."""
        return sorted(self._by_priority)

    def oldest_pushed_ms(self) -> int | None:
        """Return the smallest ``pushed_ms`` among queued items, ``None`` when empty. O(n): for metrics, not the hot path."""
        return min((entry[3] for entry in self._heap), default=None)

    # -- bounds ----------------------------------------------------------------

    def waits_bound_ms(self, priority_gap: int) -> int:
        """Return how long after its push an item can be overtaken by items at most ``priority_gap`` levels above it.

        An item pushed at ``t0`` is popped before every item pushed at or
        after ``t0 + waits_bound_ms(gap)`` whose priority exceeds its own by
        at most ``gap``, under any load: the bound is
        ``max(priority_gap, 0) * aging_ms_per_level`` (derivation in the
        module docstring). Never raises.
        """
        return max(priority_gap, 0) * self.aging_ms_per_level

    def max_wait_ms(self, priority_gap: int, pop_interval_ms: int) -> int:
        """Return the bound on an item's total queue wait when the consumer keeps popping.

        Holds when no queued item's priority exceeds the waiting item's by more
        than ``priority_gap`` and :meth:`pop` is called at least once every
        ``pop_interval_ms`` while the queue is non-empty:
        ``waits_bound_ms(priority_gap) + max_items * pop_interval_ms`` (after the
        overtaking window at most ``max_items - 1`` items are still ahead).

        Raises:
            ValueError: if ``pop_interval_ms`` is negative.
        """
        if pop_interval_ms < 0:
            raise ValueError(f"pop_interval_ms must be >= 0, got {pop_interval_ms}")
        return self.waits_bound_ms(priority_gap) + self.max_items * pop_interval_ms
