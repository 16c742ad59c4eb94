"""DLQ guard: stop a pipeline that dead-letters too much instead of emptying its topic into the DLQ.

Like arroyo's DlqLimit. Fed one batch outcome at a time (records handled,
records dead-lettered). Trips when

- more than ``max_consecutive`` records in a row were dead-lettered (a batch
  whose every record was dead-lettered extends the run; any good record ends
  it), or
- once at least ``window`` records were seen, more than ``max_ratio`` of the
  most recent ≥ ``window`` records were dead-lettered.

Either limit can be ``None`` (off). Pure logic, no clock.
"""

from __future__ import annotations

from collections import deque


class DlqGuard:
    def __init__(self, max_ratio: float | None, max_consecutive: int | None, window: int) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._max_ratio = max_ratio
        self._max_consecutive = max_consecutive
        self._window = window
        self._consecutive = 0
        self._batches: deque[tuple[int, int]] = deque()
        self._total = 0
        self._dead = 0

    def observe(self, records: int, dead: int) -> str | None:
        """Record one batch's outcome; return why the guard trips, or None."""
        if records <= 0:
            return None
        self._consecutive = self._consecutive + dead if dead == records else dead
        self._batches.append((records, dead))
        self._total += records
        self._dead += dead
        # Keep the most recent batches covering at least `window` records.
        while self._batches and self._total - self._batches[0][0] >= self._window:
            old_records, old_dead = self._batches.popleft()
            self._total -= old_records
            self._dead -= old_dead
        if self._max_consecutive is not None and self._consecutive > self._max_consecutive:
            return f"{self._consecutive} consecutive records dead-lettered (dlq.max_consecutive={self._max_consecutive})"
        if self._max_ratio is not None and self._total >= self._window and self._dead / self._total > self._max_ratio:
            return (
                f"{self._dead} of the last {self._total} records dead-lettered (dlq.max_ratio={self._max_ratio})"
            )
        return None
