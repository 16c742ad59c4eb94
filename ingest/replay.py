"""``ingest replay-dlq``: send dead-lettered records back through the pipeline, safely.

Two targets:

- ``--to sink``: each entry's original bytes go through the pipeline's mapper
  and the sink's upsert (with the same in-batch dedupe and poison isolation as
  ``ingest run``). When the DLQ table lives in the sink's database, marking an
  entry ``replayed`` happens **in the same transaction** as writing its row, so
  an interrupted replay never replays an entry twice nor marks an unwritten
  one. Otherwise the mark follows the write (a crash in between re-writes the
  row once more; the upsert makes that harmless).
- ``--to topic``: the original key, value and headers are republished to the
  original topic with ``ingest.replays`` (and ``ingest.replay_of``) headers,
  acknowledged, then marked. If such a record fails again, the pipeline
  dead-letters it with its replay count, so the loop guard still holds.

Entries are processed in id order, in chunks; each chunk is its own
transaction, so a replay can be interrupted at any time and resumed by running
the same command again. Entries that still fail stay ``pending`` with their
attempt count, replay count and newest error; after ``max_replays`` failed
replays an entry is ``gave_up`` and skipped (the loop guard).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ingest.config import PipelineSettings
from ingest.core.collapse import collapse
from ingest.core.isolation import write_groups_isolating
from ingest.core.mapping import Mapper
from ingest.dlq.postgres import REPLAYS_HEADER
from ingest.dlq.store import DlqFilter, DlqRow, DlqStore
from ingest.errors import InvalidRecord, PermanentError
from ingest.types import Failure, Item

CHUNK = 500


@dataclass
class ReplaySummary:
    selected: int = 0
    replayed: int = 0
    still_failing: int = 0
    gave_up: int = 0
    skipped: int = 0  # over the loop-guard limit before this run

    def line(self, dry_run: bool) -> str:
        if dry_run:
            return f"dry run: {self.selected} entries would be replayed ({self.skipped} over the replay limit); nothing changed"
        return (f"replayed {self.replayed}, still failing {self.still_failing} (gave up {self.gave_up}), "
                f"skipped {self.skipped}")


class RateLimiter:
    """At most ``per_s`` records per second (``None``: unlimited). Sleeps in the caller's thread."""

    def __init__(self, per_s: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._per_s = per_s
        self._clock = clock
        self._sleep = sleep
        self._next = clock()

    def acquire(self, n: int = 1) -> None:
        if not self._per_s:
            return
        now = self._clock()
        if self._next > now:
            self._sleep(self._next - now)
        self._next = max(now, self._next) + n / self._per_s


class Replayer:
    """Replays DLQ entries of one pipeline. Built by the CLI, which owns the sink and producer."""

    def __init__(
        self,
        pipeline: PipelineSettings,
        store: DlqStore,
        *,
        sink: Any | None = None,
        same_database: bool = False,
        publish: Callable[[Sequence[DlqRow]], None] | None = None,
        max_replays: int,
        purge: bool = False,
        rate_per_s: float | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self._p = pipeline
        self._store = store
        self._sink = sink
        self._same_db = same_database
        self._publish = publish
        self._max_replays = max_replays
        self._purge = purge
        self._rate = RateLimiter(rate_per_s)
        self._on_progress = on_progress
        self._mapper = Mapper(pipeline.sink.columns, pipeline.key)
        self._rule = pipeline.sink.collapse_rule()

    def count(self, f: DlqFilter, limit: int | None) -> tuple[int, int]:
        """(entries that would be replayed, entries over the replay limit) -- for --dry-run and progress."""
        selected = skipped = 0
        after = 0
        while True:
            rows = self._store.fetch(f, limit=CHUNK, after_id=after)
            if not rows:
                break
            for row in rows:
                if row.replays >= self._max_replays:
                    skipped += 1
                elif limit is None or selected < limit:
                    selected += 1
            after = rows[-1].id
            if limit is not None and selected >= limit:
                break
        return selected, skipped

    def run(self, f: DlqFilter, limit: int | None) -> ReplaySummary:
        summary = ReplaySummary()
        after = 0
        while limit is None or summary.selected < limit:
            want = CHUNK if limit is None else min(CHUNK, limit - summary.selected)
            rows = self._store.fetch(f, limit=want, after_id=after)
            if not rows:
                break
            after = rows[-1].id
            over = [r for r in rows if r.replays >= self._max_replays]
            todo = [r for r in rows if r.replays < self._max_replays]
            if over:
                with self._store.connect() as conn:
                    self._store.give_up(conn, [r.id for r in over])
                summary.skipped += len(over)
            if not todo:
                continue
            summary.selected += len(todo)
            self._rate.acquire(len(todo))
            if self._publish is not None:
                self._replay_to_topic(todo, summary)
            else:
                self._replay_to_sink(todo, summary)
            if self._on_progress is not None:
                self._on_progress(len(todo))
        return summary

    # -- targets -----------------------------------------------------------------
    def _replay_to_topic(self, rows: list[DlqRow], summary: ReplaySummary) -> None:
        assert self._publish is not None
        self._publish(rows)  # raises TransientError if not acknowledged: nothing marked
        with self._store.connect() as conn:
            self._store.mark_replayed(conn, [r.id for r in rows], purge=self._purge)
        summary.replayed += len(rows)

    def _replay_to_sink(self, rows: list[DlqRow], summary: ReplaySummary) -> None:
        failures: list[tuple[int, Failure]] = []
        items: list[Item] = []
        entry_of: dict[int, DlqRow] = {}  # id(item) -> its DLQ entry
        for row in sorted(rows, key=lambda r: (r.record.topic, r.record.partition, r.record.offset)):
            try:
                mapped, _ = self._mapper.map(row.record)
            except InvalidRecord as exc:
                failures.append((row.id, Failure(exc.stage, exc.error_class, exc.message)))
                continue
            item = Item(row.record, mapped, None, 0, 0)
            entry_of[id(item)] = row
            items.append(item)
        # The same collapse rule as `ingest run` (ingest.core.collapse): one candidate per row, in order of
        # preference; a written candidate settles itself and the candidates after it, a poison one falls back.
        _, groups = collapse(items, self._rule)
        settles = {id(c): [entry_of[id(x)].id for x in group[j:]] for group in groups for j, c in enumerate(group)}

        def write(piece: Sequence[Item]) -> None:
            batch_rows = [c.row for c in piece]
            ids = [entry_id for c in piece for entry_id in settles[id(c)]]
            if self._same_db:
                self._sink.write(batch_rows, in_tx=lambda conn: self._store.mark_replayed(conn, ids, purge=self._purge))
            else:
                self._sink.write(batch_rows)
                with self._store.connect() as conn:
                    self._store.mark_replayed(conn, ids, purge=self._purge)

        _, poison = write_groups_isolating(groups, write)
        for item, exc in poison:
            failures.append((entry_of[id(item)].id, Failure("write", exc.error_class, str(exc), exc.sqlstate)))
        if failures:
            with self._store.connect() as conn:
                self._store.mark_failed(conn, failures, self._max_replays)
            summary.gave_up += sum(1 for i, _ in failures if _replays_after(rows, i) >= self._max_replays)
        summary.still_failing += len(failures)
        summary.replayed += len(rows) - len(failures)


def _replays_after(rows: list[DlqRow], entry_id: int) -> int:
    for row in rows:
        if row.id == entry_id:
            return row.replays + 1
    return 0


def republish_headers(row: DlqRow) -> list[tuple[str, bytes]]:
    """Original headers (minus old replay markers) plus the replay count and origin."""
    rec = row.record
    kept = [(k, v) for k, v in rec.headers if k not in (REPLAYS_HEADER, "ingest.replay_of")]
    return kept + [  # type: ignore[return-value]
        (REPLAYS_HEADER, str(row.replays + 1).encode()),
        ("ingest.replay_of", f"{rec.topic}/{rec.partition}/{rec.offset}".encode()),
    ]


__all__ = ["Replayer", "ReplaySummary", "RateLimiter", "republish_headers", "PermanentError"]
