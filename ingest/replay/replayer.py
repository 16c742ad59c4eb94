"""``ingest replay-dlq``: send dead-lettered records back through the pipeline, safely.

Two targets:

- ``--to sink``: each entry's original bytes go through the pipeline's mapper
  and the sink's write, with the same collapse rule (:mod:`ingest.core.collapse`)
  and poison isolation as ``ingest run``. Where the DLQ table lives in the
  sink's database, marking an entry ``replayed`` happens **in the same
  transaction** as writing its row; otherwise the mark follows the write (a
  crash in between re-writes the row once more; the upsert makes that harmless).
- ``--to topic``: the original key, value, headers and timestamp are republished
  to the original partition with ``ingest.replays`` and ``ingest.replay_of``
  (the original position) headers, acknowledged, then marked. ``ingest run``
  treats such a record as the original one (its source position, ``@offset``),
  so the sink's own guards still order it.

Never older (:mod:`ingest.replay.order`): before writing or republishing, the
rows' sources are read where the sink keeps them; an entry older than its row
(same partition) is resolved ``superseded`` without writing; one whose order
ingest cannot tell is left pending and counted as *refused* (``--apply-unordered``
applies it anyway).

Entries are processed in id order, in chunks; each chunk is resolved before the
next is read, so a replay can be interrupted at any time and resumed by running
the same command again. Entries that still fail stay ``pending`` with their
attempt count, replay count and newest error; after ``max_replays`` failed
replays an entry is ``gave_up`` and skipped (the loop guard).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ingest.cdc.mapper import mapper_for
from ingest.config import PipelineSettings
from ingest.core.collapse import collapse
from ingest.core.isolation import write_groups_isolating
from ingest.dlq.base import DlqFilter, DlqReader, DlqRow
from ingest.errors import Filtered, InvalidRecord, NoChange
from ingest.formats.base import Decoder, prepare_all
from ingest.replay.order import Verdict, judge
from ingest.retry import retrying
from ingest.sinks.base import Capabilities, Sink
from ingest.types import Failure, Item

CHUNK = 500


@dataclass
class ReplaySummary:
    selected: int = 0
    replayed: int = 0
    #: resolved without writing: their rows already held newer records
    superseded: int = 0
    #: left pending: ingest cannot tell whether they are older than their rows (see --apply-unordered)
    refused: int = 0
    still_failing: int = 0
    gave_up: int = 0
    skipped: int = 0  # over the loop-guard limit before this run
    #: of ``replayed``: entries a filter of the pipeline's current transforms drops (resolved, nothing written)
    filtered: int = 0

    def line(self, dry_run: bool) -> str:
        if dry_run:
            return (f"dry run: {self.selected} entries would be replayed ({self.skipped} over the replay limit); "
                    "nothing changed")
        text = (f"replayed {self.replayed}, still failing {self.still_failing} (gave up {self.gave_up}), "
                f"skipped {self.skipped}")
        if self.filtered:
            text += f", filtered {self.filtered} (of the replayed: dropped by a filter of the current transforms)"
        if self.superseded:
            text += f", superseded {self.superseded} (their rows already held newer records)"
        if self.refused:
            text += (f"; {self.refused} left pending: their rows were last written from another partition (or "
                     "before ingest kept row sources), so their order is unknown -- rerun with --apply-unordered "
                     "to apply them anyway")
        return text


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
    """Replays DLQ entries of one pipeline. Built by the CLI, which owns the reader, sink and publisher.

    ``sink``: the pipeline's sink (``--to sink``; for ``--to topic`` too when it can tell row sources,
    to guard the order). ``publish``: republishes rows (``--to topic``). ``marks_in_sink_tx``: the
    reader's entries live in the sink's database, so marks join the rows' transaction.
    """

    def __init__(self, pipeline: PipelineSettings, reader: DlqReader, *, sink: Sink | None = None,
                 capabilities: Capabilities = Capabilities(), marks_in_sink_tx: bool = False,
                 publish: Callable[[Sequence[DlqRow]], None] | None = None, max_replays: int,
                 purge: bool = False, rate_per_s: float | None = None, apply_unordered: bool = False,
                 on_progress: Callable[[int], None] | None = None, decoder: Decoder | None = None,
                 key_decoder: Decoder | None = None) -> None:
        self._p = pipeline
        self._reader = reader
        self._sink = sink
        self._in_tx = marks_in_sink_tx and capabilities.transactions
        self._publish = publish
        self._max_replays = max_replays
        self._purge = purge
        self._rate = RateLimiter(rate_per_s)
        self._apply_unordered = apply_unordered
        self.on_progress = on_progress
        self._mapper = mapper_for(pipeline, decoder=decoder, key_decoder=key_decoder)
        existing_tables = getattr(sink, "existing_tables", None)
        if pipeline.routes_tables and existing_tables is not None:  # the case guard knows the tables there
            self._mapper.router.seed_from(existing_tables)
        #: fetches the schemas a chunk names (registry formats) before it is mapped
        self._prepare = prepare_all(decoder, key_decoder)
        self._rule = pipeline.collapse_rule()
        # The order guard needs row sources, and applies only where offsets order the rows (no version) --
        # or, with columns: auto, where some tables have a version of their own and the others none (the
        # carriers' version slot then says nothing of those: the guard holds every table to its rows'
        # sources, which a versioned table's newer record may also have to pass).
        per_table_versions = pipeline.auto_columns and getattr(pipeline.sink, "version", None) is None
        self._guarded = (sink is not None and capabilities.row_sources and pipeline.sink.tracks_sources
                         and (self._rule.version_index is None or per_table_versions))

    def count(self, f: DlqFilter, limit: int | None) -> tuple[int, int]:
        """(entries that would be replayed, entries over the replay limit) -- for --dry-run and progress."""
        selected = skipped = 0
        after: int | str | None = None
        while True:
            rows = self._reader.fetch(f, limit=CHUNK, after=after)
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
        after: int | str | None = None
        while limit is None or summary.selected < limit:
            want = CHUNK if limit is None else min(CHUNK, limit - summary.selected)
            rows = self._reader.fetch(f, limit=want, after=after)
            if not rows:
                break
            after = rows[-1].id
            over = [r for r in rows if r.replays >= self._max_replays]
            todo = [r for r in rows if r.replays < self._max_replays]
            self._reader.give_up([r.id for r in over])
            summary.skipped += len(over)
            if not todo:
                continue
            summary.selected += len(todo)
            self._rate.acquire(len(todo))
            self._replay(todo, summary)
            if self.on_progress is not None:
                self.on_progress(len(todo))
        return summary

    # -- one chunk -------------------------------------------------------------------------
    def _replay(self, rows: list[DlqRow], summary: ReplaySummary) -> None:
        failures: list[tuple[int | str, Failure]] = []
        items: list[Item] = []
        entry_of: dict[int, DlqRow] = {}  # id(item) -> its DLQ entry
        unchanged: list[int | str] = []  # entries that are done without writing a row
        if self._prepare is not None:  # a registry outage is retried, never a reason to give up on an entry
            for attempt in retrying(self._p.retry, what="schema registry lookups"):
                with attempt:
                    self._prepare([row.record for row in rows])
        for row in sorted(rows, key=lambda r: r.record.source_position):
            try:
                mapped, _ = self._mapper.map(row.record)
            except InvalidRecord as exc:
                failures.append((row.id, Failure(exc.stage, exc.error_class, exc.message)))
                continue
            except NoChange as exc:  # handled without a row now (a truncate, since truncate: ignore; a filter)
                unchanged.append(row.id)
                summary.filtered += type(exc) is Filtered
                continue
            item = Item(row.record, mapped, None, 0, 0)
            entry_of[id(item)] = row
            items.append(item)
        if unchanged:
            self._reader.mark_replayed(unchanged, purge=self._purge)
            summary.replayed += len(unchanged)
        _, groups = collapse(items, self._rule)
        if self._guarded:
            groups = self._guard(groups, entry_of, summary)
        if self._publish is not None:
            published = [entry_of[id(c)] for g in groups for c in g]
            self._publish(sorted(published, key=lambda r: r.record.source_position))
            self._reader.mark_replayed([r.id for r in published], purge=self._purge)
            summary.replayed += len(published)
        else:
            failures += self._write(groups, entry_of, summary)
        if failures:
            self._reader.mark_failed(failures, self._max_replays)
            by_id = {r.id: r for r in rows}
            summary.gave_up += sum(1 for i, _ in failures if by_id[i].replays + 1 >= self._max_replays)
        summary.still_failing += len(failures)

    def _guard(self, groups: list[list[Item]], entry_of: dict[int, DlqRow],
               summary: ReplaySummary) -> list[list[Item]]:
        """Drop (and resolve) the candidates that would make their row older; keep the rest."""
        assert self._sink is not None and self._rule.key_index is not None
        key_index = self._rule.key_index
        keys = [tuple(g[0].row[i] for i in key_index) for g in groups]  # type: ignore[index]
        sources = self._sink.row_sources(keys)  # type: ignore[attr-defined]
        kept: list[list[Item]] = []
        superseded: list[int | str] = []
        for key, group in zip(keys, groups):
            row_source = sources.get(key)
            keep = []
            for candidate in group:
                verdict = judge(row_source, candidate.record)
                if verdict is Verdict.SUPERSEDED:
                    superseded.append(entry_of[id(candidate)].id)
                elif verdict is Verdict.UNKNOWN and not self._apply_unordered:
                    summary.refused += 1
                else:
                    keep.append(candidate)
            if keep:
                kept.append(keep)
        self._reader.mark_superseded(superseded)
        summary.superseded += len(superseded)
        return kept

    def _write(self, groups: list[list[Item]], entry_of: dict[int, DlqRow],
               summary: ReplaySummary) -> list[tuple[int | str, Failure]]:
        """Write one candidate per group (falling back past poison ones); returns the poison entries."""
        assert self._sink is not None
        sink = self._sink
        # A written candidate settles itself and the candidates after it (ingest.core.collapse).
        settles = {id(c): [entry_of[id(x)].id for x in group[j:]] for group in groups for j, c in enumerate(group)}

        def write(piece: Sequence[Item]) -> None:
            batch_rows = [c.row for c in piece]
            ids = [entry_id for c in piece for entry_id in settles[id(c)]]
            if self._in_tx:
                sink.write(batch_rows, in_tx=lambda conn: self._reader.replayed_in(conn, ids, purge=self._purge))
            else:
                sink.write(batch_rows)
                self._reader.mark_replayed(ids, purge=self._purge)
            summary.replayed += len(ids)

        _, poison = write_groups_isolating(groups, write)
        return [(entry_of[id(item)].id, Failure.from_write_error(exc)) for item, exc in poison]
