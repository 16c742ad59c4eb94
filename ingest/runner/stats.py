"""Counters of one pipeline run, owned by the pipeline thread; the run summary and ``--summary-json``."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ingest.metrics import PipelineMetrics
    from ingest.runner.writer import Completion


@dataclass
class PipelineStats:
    """Counters of one pipeline run (owned by the pipeline thread)."""

    records_consumed: int = 0
    rows_written: int = 0
    #: of rows_written, the rows that deleted their key (change data capture)
    rows_deleted: int = 0
    dead_lettered: Counter[tuple[str, str]] = field(default_factory=Counter)
    skipped: int = 0
    #: records a ``filter`` transform dropped, by the filter's label (done, committed; not in ``skipped``)
    filtered: Counter[str] = field(default_factory=Counter)
    #: records handed to the mapper, and those of them its compiled fast path declined (mapped by the
    #: generic loop instead, which alone decides poison): the fast path's hit rate
    records_mapped: int = 0
    fast_path_misses: int = 0
    #: of those, the records the typed tier (msgspec, JSON) handed to the orjson tier (ingest.core.mapping.fastmap)
    typed_misses: int = 0
    #: records written by the columnar tier (``columnar: true``; ingest.runner.columnar): its hit rate
    #: is ``columnar_records / records_mapped``
    columnar_records: int = 0
    #: pipelines that route to many tables: rows written per table
    rows_by_table: Counter[str] = field(default_factory=Counter)
    #: ... and the records each table's database refused (dead-lettered at stage ``write``)
    refused_by_table: Counter[str] = field(default_factory=Counter)
    #: "columnar", or "rows (<why>)": what the pipeline was built to write with (ingest.runner.columnar)
    write_tier: str | None = None
    #: exactly-once: records re-read after a restart that the database already had
    already_written: int = 0
    batches: int = 0
    flushes: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    write_calls: int = 0
    commits: int = 0
    paused_s: float = 0.0
    #: seconds the lanes spent writing batches, all lanes together (:attr:`Completion.write_s`), and the
    #: seconds planning them took (:attr:`Completion.prepare_s`): against ``busy_s`` they show how much of
    #: the time the lanes wait on the database and how much planning overlaps it
    lane_write_s: float = 0.0
    prepare_s: float = 0.0
    #: seconds each batch waited for a write slot (only with a write scheduler)
    queue_waits_s: list[float] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)
    #: when the first record arrived and when the last batch was handled (throughput window)
    first_record_s: float | None = None
    last_done_s: float | None = None
    finished_s: float | None = None
    #: --until-idle gave up: the partitions the group had not finished ({topic, partition, committed, behind})
    undrained: list[dict[str, object]] = field(default_factory=list)

    def count(self, c: Completion, m: PipelineMetrics) -> None:
        """A handled batch's counters, into these stats and the metrics."""
        self.batches += 1
        self.last_done_s = time.monotonic()
        self.rows_written += c.rows_written
        self.rows_deleted += c.rows_deleted
        self.dead_lettered.update(c.dead_lettered)
        self.retries += c.retries
        self.write_calls += c.write_calls
        self.already_written += c.skipped
        self.lane_write_s += c.write_s
        self.prepare_s += c.prepare_s
        self.columnar_records += c.columnar_records
        if c.rows_by_table:
            self.rows_by_table.update(c.rows_by_table)
            for table, n in c.rows_by_table.items():
                m.table_rows_written(table, n)
        if c.refused_by_table:
            self.refused_by_table.update(c.refused_by_table)
            for table, n in c.refused_by_table.items():
                m.table_dead_lettered(table, n)
        if c.filtered:  # dropped by a filter in a batch mapped at once (the columnar tier), counted as the
            # row path counts them when it maps records one by one (ingest.runner.accept)
            self.filtered.update(c.filtered)
            self.records_mapped -= sum(c.filtered.values())
            for step, n in c.filtered.items():
                m.filtered(step, n)
        if c.unchanged:  # handled without a row in a batch mapped at once, counted as ingest.runner.accept does
            self.skipped += c.unchanged
            self.records_mapped -= c.unchanged
        if c.queue_wait_s is not None:
            self.queue_waits_s.append(c.queue_wait_s)
        m.batch_rows.observe(c.records)
        m.batch_bytes.observe(c.size_bytes)
        m.flush_seconds.observe(c.duration_s)
        m.rows_written.inc(c.rows_written)
        if c.rows_deleted:
            m.rows_deleted.inc(c.rows_deleted)
        m.records_done.inc(c.records - sum(c.filtered.values()) - c.unchanged)  # in the sink or the DLQ
        # m.retries counts each retry as it happens (BatchWriter.on_retry), not here
        m.write_calls.inc(c.write_calls)
        for (stage, error_class), n in c.dead_lettered.items():
            m.dead_lettered(stage, error_class, n)
        if c.min_timestamp_ms is not None:
            m.e2e_latency.observe(max(0.0, time.time() - c.min_timestamp_ms / 1000))

    @property
    def dead_lettered_total(self) -> int:
        return sum(self.dead_lettered.values())

    @property
    def filtered_total(self) -> int:
        return sum(self.filtered.values())

    def rate_per_s(self) -> float:
        """Records per second between the first record and the last handled batch."""
        if self.first_record_s is None or self.last_done_s is None:
            return 0.0
        elapsed = self.last_done_s - self.first_record_s
        return self.records_consumed / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "write_tier": self.write_tier,
            "records_consumed": self.records_consumed,
            "rows_written": self.rows_written,
            "rows_deleted": self.rows_deleted,
            "dead_lettered": self.dead_lettered_total,
            "dead_lettered_by_class": {f"{k[0]}/{k[1]}": v for k, v in self.dead_lettered.items()},
            "skipped": self.skipped,
            "filtered": self.filtered_total,
            "filtered_by_step": dict(self.filtered),
            "records_mapped": self.records_mapped,
            "fast_path_misses": self.fast_path_misses,
            "typed_misses": self.typed_misses,
            "columnar_records": self.columnar_records,
            "already_written": self.already_written,
            **({"rows_written_by_table": dict(sorted(self.rows_by_table.items()))} if self.rows_by_table else {}),
            **({"dead_lettered_by_table": dict(sorted(self.refused_by_table.items()))}
               if self.refused_by_table else {}),
            "batches": self.batches,
            "flushes": dict(self.flushes),
            "retries": self.retries,
            "write_calls": self.write_calls,
            "commits": self.commits,
            "paused_s": round(self.paused_s, 3),
            "lane_write_s": round(self.lane_write_s, 3),
            "prepare_s": round(self.prepare_s, 3),
            "rate_per_s": round(self.rate_per_s(), 1),
            "queue_wait_s": percentiles(self.queue_waits_s),
            "busy_s": round((self.last_done_s or 0) - (self.first_record_s or 0), 3),
            # the same window on the system-wide monotonic clock, so --processes can merge it
            "busy_window_s": [self.first_record_s, self.last_done_s],
            "undrained": list(self.undrained),
        }


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50 / p95 / p99 / max of a sample (nearest rank), or None when empty."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 4)

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99), "max": round(ordered[-1], 4),
            "count": len(ordered)}
