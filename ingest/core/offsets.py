"""Per-partition commit watermarks over records handled out of order.

Records of one partition are consumed in offset order but finish (written to
the sink or dead-lettered) in any order, because lanes flush independently.
Kafka commits a single *next offset* per partition, so the only safe value is
the contiguous low watermark: the smallest offset still in flight, or one past
the last tracked offset when nothing is in flight. Committing it means every
record below it is handled.

Per partition the tracker keeps (in a small slots dataclass):

- ``queue``: a deque of tracked offsets in tracking (= increasing) order whose
  head is the watermark; done offsets stay in it until they reach the head;
- ``pending``: the set of tracked offsets not done yet (O(1) validity check
  for :meth:`OffsetTracker.done`, since offsets may have gaps);
- ``last``: the last tracked offset, ``committed``: the last commit remembered.

``done`` removes the offset from ``pending`` and pops the queue head while the
head is not pending, so every operation is O(1) amortized per record. Offsets
done above the head are *gaps*: ``gap_count = len(queue) - len(pending)``.

Each :meth:`OffsetTracker.assign` returns a new *epoch* from one counter for
the whole tracker (unique and increasing). Completions carry the epoch they
were consumed under; after a revoke and re-assign the old epoch no longer
matches and stale completions are ignored, so a record from an earlier
assignment can never move the new assignment's watermark.

Pure logic: no I/O, no clock. Not thread-safe: owned by one pipeline thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)

__all__ = ["OffsetTracker"]


@dataclass(slots=True)
class _PartitionState:
    epoch: int
    queue: deque[int] = field(default_factory=deque)  # tracked offsets not yet below the watermark
    pending: set[int] = field(default_factory=set)  # tracked and not done
    last: int | None = None  # last tracked offset
    committed: int | None = None  # last value passed to mark_committed


def _watermark(state: _PartitionState) -> int | None:
    if state.queue:
        return state.queue[0]
    return None if state.last is None else state.last + 1


class OffsetTracker(Generic[P]):
    """Per-partition contiguous low watermark of fully handled records. Not thread-safe: owned by one pipeline thread."""

    __slots__ = ("_states", "_last_epoch")

    def __init__(self) -> None:
        """Create a tracker with no partitions assigned."""
        self._states: dict[P, _PartitionState] = {}
        self._last_epoch = 0

    def _state(self, tp: P) -> _PartitionState:
        try:
            return self._states[tp]
        except KeyError:
            raise KeyError(f"partition not assigned: {tp}") from None

    # -- assignment -----------------------------------------------------------

    def assign(self, tp: P) -> int:
        """Start fresh state for ``tp``, dropping any old state (tracked offsets, commit).

        Returns:
            The new epoch of ``tp``: unique and increasing across the whole
            tracker (the first is 1). Never raises.
        """
        self._last_epoch += 1
        self._states[tp] = _PartitionState(epoch=self._last_epoch)
        return self._last_epoch

    def revoke(self, tp: P) -> None:
        """Drop all state for ``tp``; no-op if unknown. Never raises."""
        self._states.pop(tp, None)

    def partitions(self) -> list[P]:
        """Return the assigned partitions, in assignment order. Never raises."""
        return list(self._states)

    def epoch(self, tp: P) -> int | None:
        """Return the current epoch of ``tp``, ``None`` if unassigned. Never raises."""
        state = self._states.get(tp)
        return None if state is None else state.epoch

    # -- records --------------------------------------------------------------

    def track(self, tp: P, offset: int) -> None:
        """Record that ``offset`` of ``tp`` was consumed and is now in flight.

        Offsets must strictly increase per partition but may have gaps
        (compaction, transaction markers).

        Raises:
            KeyError: if ``tp`` is not assigned.
            ValueError: if ``offset`` is <= the last offset tracked for ``tp``.
        """
        state = self._state(tp)
        if state.last is not None and offset <= state.last:
            raise ValueError(f"{tp}: offset {offset} not after last tracked offset {state.last}")
        state.queue.append(offset)
        state.pending.add(offset)
        state.last = offset

    def track_many(self, tp: P, offsets: list[int]) -> None:
        """:meth:`track` for a run of offsets of ``tp``, in one step (the pipeline's hot path).

        Raises:
            KeyError: if ``tp`` is not assigned.
            ValueError: if ``offsets`` is not strictly increasing or does not start after the
                last tracked offset (nothing is changed).
        """
        if not offsets:
            return
        state = self._state(tp)
        first = offsets[0]
        if state.last is not None and first <= state.last:
            raise ValueError(f"{tp}: offset {first} not after last tracked offset {state.last}")
        # Strictly increasing <=> sorted without duplicates; both checks run in C.
        if len(offsets) > 1 and (offsets != sorted(offsets) or len(set(offsets)) != len(offsets)):
            raise ValueError(f"{tp}: offsets to track are not strictly increasing")
        state.queue.extend(offsets)
        state.pending.update(offsets)
        state.last = offsets[-1]

    def last_tracked(self, tp: P) -> int | None:
        """Return the last offset tracked for ``tp`` since its assign, ``None`` if none or unassigned. Never raises."""
        state = self._states.get(tp)
        return None if state is None else state.last

    def done(self, tp: P, offset: int, epoch: int) -> bool:
        """Mark one tracked offset handled (written or dead-lettered).

        Returns:
            ``True`` if accepted. ``False``, changing nothing, if ``tp`` is
            unassigned, ``epoch`` is not the current epoch of ``tp``, or
            ``offset`` is not pending (never tracked, or already done).
            Never raises.
        """
        state = self._states.get(tp)
        if state is None or state.epoch != epoch or offset not in state.pending:
            return False
        state.pending.remove(offset)
        queue, pending = state.queue, state.pending
        while queue and queue[0] not in pending:
            queue.popleft()
        return True

    def done_many(self, tp: P, offsets: Iterable[int], epoch: int) -> int:
        """:meth:`done` for each offset, in one step; return how many were accepted. Never raises."""
        state = self._states.get(tp)
        if state is None or state.epoch != epoch:
            return 0
        pending, queue = state.pending, state.queue
        before = len(pending)
        pending.difference_update(offsets)
        # the queue's head runs up to its first pending offset (found by a C scan), then is dropped
        head = next(itertools.compress(itertools.count(), map(pending.__contains__, queue)), len(queue))
        if 2 * head >= len(queue):
            state.queue = deque(itertools.islice(queue, head, None))
        else:
            for _ in itertools.repeat(None, head):
                queue.popleft()
        return before - len(pending)

    def advance(self, tp: P, offset: int) -> bool:
        """Move the watermark of an idle ``tp`` up to ``offset`` (never down).

        For offsets that are never delivered -- a transaction's commit marker, records
        a ``read_committed`` consumer skips -- so that a fully consumed partition can
        commit its true end. Only when nothing of ``tp`` is pending: every offset below
        ``offset`` that was tracked is done. Later :meth:`track` calls must be ``>= offset``.

        Returns:
            ``True`` if the watermark moved. ``False`` (nothing changed) when ``tp`` is
            unassigned, has pending offsets, or its watermark is already ``>= offset``.
            Never raises.
        """
        state = self._states.get(tp)
        if state is None or state.pending:
            return False
        mark = _watermark(state)
        if mark is not None and offset <= mark:
            return False
        state.queue.clear()
        state.last = offset - 1
        return True

    # -- watermarks and commits ----------------------------------------------

    def watermark(self, tp: P) -> int | None:
        """Return the next offset to commit for ``tp``.

        Returns:
            The smallest pending offset; if none is pending, the last tracked
            offset + 1; ``None`` if nothing was tracked since ``assign``.

        Raises:
            KeyError: if ``tp`` is not assigned.
        """
        return _watermark(self._state(tp))

    def commit_candidates(self) -> dict[P, int]:
        """Return ``{tp: watermark}`` for partitions whose watermark moved past the last commit.

        Includes ``tp`` iff its watermark is not ``None`` and either nothing
        was passed to :meth:`mark_committed` since ``assign`` or the watermark
        is greater than the value last passed. Never raises.
        """
        out: dict[P, int] = {}
        for tp, state in self._states.items():
            mark = _watermark(state)
            if mark is not None and (state.committed is None or mark > state.committed):
                out[tp] = mark
        return out

    def mark_committed(self, tp: P, offset: int) -> None:
        """Remember that ``offset`` was committed for ``tp``; ignored if ``tp`` is unassigned. Never raises."""
        state = self._states.get(tp)
        if state is not None:
            state.committed = offset

    def committed(self, tp: P) -> int | None:
        """Return the value last passed to :meth:`mark_committed` for ``tp`` since its assign.

        ``None`` if nothing was marked or ``tp`` is unassigned. Never raises.
        """
        state = self._states.get(tp)
        return None if state is None else state.committed

    # -- introspection (metrics) ---------------------------------------------

    def gap_count(self, tp: P | None = None) -> int:
        """Return the number of done offsets above the watermark, for ``tp`` or summed over all partitions.

        Raises:
            KeyError: if ``tp`` is given and not assigned.
        """
        states = self._states.values() if tp is None else (self._state(tp),)
        return sum(len(s.queue) - len(s.pending) for s in states)

    def in_flight(self, tp: P | None = None) -> int:
        """Return the number of tracked, not done offsets, for ``tp`` or summed over all partitions.

        Raises:
            KeyError: if ``tp`` is given and not assigned.
        """
        states = self._states.values() if tp is None else (self._state(tp),)
        return sum(len(s.pending) for s in states)

    def oldest_pending(self, tp: P) -> int | None:
        """Return the smallest tracked, not done offset of ``tp``, ``None`` if none.

        Raises:
            KeyError: if ``tp`` is not assigned.
        """
        state = self._state(tp)
        return state.queue[0] if state.queue else None
