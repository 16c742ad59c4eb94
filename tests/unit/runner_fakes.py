"""Deterministic stand-ins for the pipeline loop's collaborators (pure logic tests only).

- :class:`FakeClock`: milliseconds that move only when the test says so;
- :class:`SteppedLanes`: a :class:`~ingest.runner.lanes.LanePool` whose batches are written only
  when the test runs a lane (:meth:`SteppedLanes.run_one`), or when the loop waits for one
  (revoke, shutdown) -- then the next queued batch is written, lowest lane first;
- :class:`ModelTable`: a sink table with PostgreSQL's upsert semantics (``ON CONFLICT DO UPDATE``,
  optionally guarded by a version column) or append-only, with failure injection, and a log of
  every write;
- :class:`ModelDlq`: a DLQ with failure injection;
- :class:`MemoryExactlyOnce` / :class:`MemoryOffsetStore`: the exactly-once transaction of
  ``ingest.exactly_once`` (same pure planning, :func:`~ingest.exactly_once.split_fresh`) over the
  model table, all or nothing.

None of these is a test double of an adapter's contract: adapters are tested against real
services. These let the loop's own rules be checked step by step.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ingest.config import RetrySettings
from ingest.core.collapse import CollapseRule, collapse
from ingest.core.isolation import write_groups_isolating
from ingest.dlq.base import DlqEntry
from ingest.errors import PermanentError, TransientError
from ingest.sinks.base import ExactlyOnceResult
from ingest.sinks.postgres.exactly_once import split_fresh
from ingest.types import Failure, Item, Partition
from ingest.runner.writer import BatchWriter, Completion

FAST_RETRY = RetrySettings(max_attempts=3, initial_backoff_ms=1, max_backoff_ms=1)


class FakeClock:
    def __init__(self, start_ms: int = 1_000_000) -> None:
        self.now_ms = start_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


class SteppedLanes:
    """A lane pool driven by the test; see the module docstring."""

    def __init__(self, lanes: int, writer: BatchWriter) -> None:
        self.queues: list[deque[tuple[list[Item], str]]] = [deque() for _ in range(lanes)]
        self._writer = writer
        self._done: list[Completion] = []
        self.halted = False
        self.closed = False

    def start(self) -> None:
        pass

    def submit(self, lane: int, items: list[Item], reason: str) -> None:
        self.queues[lane].append((items, reason))

    def pending(self) -> list[int]:
        return [i for i, q in enumerate(self.queues) if q]

    def run_one(self, lane: int) -> Completion | None:
        """Write the next queued batch of ``lane`` (dropped, when halted). Returns its completion."""
        if not self.queues[lane]:
            return None
        items, reason = self.queues[lane].popleft()
        if self.halted:
            return None
        completion = self._writer.handle(lane, items, reason)
        if completion.error is not None:
            self.halted = True
        self._done.append(completion)
        return completion

    def completed(self, timeout_s: float | None = None) -> list[Completion]:
        if not self._done and timeout_s:
            for lane in self.pending():  # the loop waits: let the lowest busy lane write one batch
                self.run_one(lane)
                break
        done, self._done = self._done, []
        return done

    def halt(self) -> None:
        self.halted = True

    def close(self, timeout_s: float | None) -> None:
        self.closed = True


@dataclass
class Write:
    """One row write the table accepted (or ignored because of the version guard)."""

    key: Any
    row: tuple
    applied: bool


class ModelTable:
    """A table with PostgreSQL's upsert semantics; ``write`` is one transaction (all or nothing).

    ``key_index``: the conflict key columns (None: append-only). ``version_index``: the version
    column (an update applies only when ``EXCLUDED.v >= t.v``). ``keep_first``: ON CONFLICT DO NOTHING.
    Failure injection: ``transient`` makes the next that many writes fail; a row whose column
    ``poison_index`` is in ``poison`` makes its piece fail with PermanentError. ``before_write``, when
    set, is called at every write attempt (a test looks at the world from inside a write).
    """

    def __init__(self, *, key_index: Sequence[int] | None, version_index: int | None = None,
                 keep_first: bool = False, poison_index: int = 0) -> None:
        self.key_index = tuple(key_index) if key_index is not None else None
        self.version_index = version_index
        self.keep_first = keep_first
        self.poison_index = poison_index
        self.rows: dict[Any, tuple] = {}
        self.appended: list[tuple] = []
        self.log: list[Write] = []
        self.transient = 0
        self.poison: set[Any] = set()
        self.before_write: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def key_of(self, row: tuple) -> Any:
        assert self.key_index is not None
        return tuple(row[i] for i in self.key_index)

    def write(self, rows: Sequence[tuple], *, token: str | None = None) -> None:
        if self.before_write is not None:
            self.before_write()
        with self._lock:
            if self.transient:
                self.transient -= 1
                raise TransientError("connection lost (injected)", error_class="connection")
            if any(row[self.poison_index] in self.poison for row in rows):
                raise PermanentError("check constraint violated (injected)", sqlstate="23514",
                                     error_class="integrity_constraint_violation")
            self.apply(rows)

    def apply(self, rows: Iterable[tuple]) -> None:
        for row in rows:
            if self.key_index is None:
                self.appended.append(row)
                self.log.append(Write(None, row, True))
                continue
            key = self.key_of(row)
            old = self.rows.get(key)
            applied = old is None or (not self.keep_first and (
                self.version_index is None or row[self.version_index] >= old[self.version_index]))
            if applied:
                self.rows[key] = row
            self.log.append(Write(key, row, applied))


class ModelDlq:
    def __init__(self) -> None:
        self.entries: list[DlqEntry] = []
        self.transient = 0
        self._lock = threading.Lock()

    def put(self, entries: Sequence[DlqEntry]) -> None:
        with self._lock:
            if self.transient:
                self.transient -= 1
                raise TransientError("DLQ unavailable (injected)", error_class="dlq_unavailable")
            self.entries.extend(entries)

    def close(self) -> None:
        pass


@dataclass
class MemoryOffsetStore:
    """``ingest_offsets`` in memory (an offset never moves backwards)."""

    stored: dict[Partition, int] = field(default_factory=dict)

    def load(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        return {tp: self.stored[tp] for tp in partitions if tp in self.stored}

    def save(self, watermarks: dict[Partition, int]) -> None:
        for tp, off in watermarks.items():
            self.stored[tp] = max(self.stored.get(tp, 0), off)


class MemoryExactlyOnce:
    """The exactly-once lane transaction over a :class:`ModelTable` and :class:`ModelDlq`, all or nothing."""

    def __init__(self, pipeline: str, table: ModelTable, dlq: ModelDlq, rule: CollapseRule) -> None:
        self._pipeline = pipeline
        self._rule = rule
        self.table = table
        self.dlq = dlq
        self.lane_offsets: dict[tuple[Partition, int], int] = {}
        self._lock = threading.Lock()

    def __call__(self, lane: int, items: Sequence[Item]) -> ExactlyOnceResult:
        with self._lock:
            table = self.table
            if table.transient:
                table.transient -= 1
                raise TransientError("connection lost (injected)", error_class="connection")
            stored = {tp: off for (tp, ln), off in self.lane_offsets.items() if ln == lane}
            fresh, high = split_fresh(items, stored)
            failed, groups = collapse(fresh, self._rule)
            failures = [DlqEntry(self._pipeline, item.record, item.failure) for item in failed]
            staged: list[tuple] = []
            calls = [0]

            def savepoint_write(piece: Sequence[Item]) -> None:
                calls[0] += 1
                rows = [item.row for item in piece]
                if any(row[table.poison_index] in table.poison for row in rows):
                    raise PermanentError("check constraint violated (injected)", sqlstate="23514",
                                         error_class="integrity_constraint_violation")
                staged.extend(rows)

            written, poison = write_groups_isolating(groups, savepoint_write)
            for item, exc in poison:
                failures.append(DlqEntry(self._pipeline, item.record,
                                         Failure("write", exc.error_class, str(exc), exc.sqlstate)))
            if failures and self.dlq.transient:
                self.dlq.transient -= 1
                raise TransientError("DLQ unavailable (injected)", error_class="dlq_unavailable")
            # commit: rows, DLQ entries and lane offsets together
            table.apply(staged)
            self.dlq.entries.extend(failures)
            for tp, off in high.items():
                self.lane_offsets[(tp, lane)] = max(self.lane_offsets.get((tp, lane), 0), off)
            return ExactlyOnceResult(len(written), failures, calls[0], len(items) - len(fresh))


def snapshot(table: ModelTable) -> dict[Any, tuple]:
    return copy.copy(table.rows)
