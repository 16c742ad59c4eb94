"""Prometheus metrics and the health state behind ``/healthz`` and ``/readyz``.

One :class:`Metrics` per process (own registry, so tests can make their own);
each pipeline gets a :class:`PipelineMetrics` with its label bound. The runner
calls the ``on_*`` / ``set_*`` methods from its own thread; prometheus-client
metrics are thread-safe.

Names follow Prometheus conventions: counters end in ``_total``, durations are
``_seconds``, sizes ``_bytes``; every series carries ``pipeline``.

The alert rules (``deploy/prometheus/alerts.yaml``) and the dashboard
(``deploy/grafana/ingest.json``) query these names; ``tests/integration/test_prometheus_scrape.py``
checks every one of their expressions against a real Prometheus scraping a real process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from ingest.status import STATES, StatusBoard

_BATCH_ROWS_BUCKETS = (1, 10, 50, 100, 500, 1000, 2000, 5000, 10000, 50000)
_BATCH_BYTES_BUCKETS = (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """Every metric of the process, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # no *_created series: they double the output for nothing
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = ["pipeline"]
        self.records_consumed = Counter("ingest_records_consumed_total", "Records fetched from Kafka.", p, registry=r)
        self.rows_written = Counter("ingest_rows_written_total", "Rows written to the sink (after in-batch dedupe).",
                                    p, registry=r)
        self.rows_deleted = Counter("ingest_rows_deleted_total",
                                    "Of the rows written, the rows that deleted their key (change data capture).",
                                    p, registry=r)
        self.records_done = Counter("ingest_records_handled_total",
                                    "Records fully handled (in the sink or the DLQ).", p, registry=r)
        self.dead_lettered = Counter("ingest_dead_lettered_total", "Records sent to the DLQ.",
                                     [*p, "stage", "error_class"], registry=r)
        self.table_rows_written = Counter("ingest_table_rows_written_total",
                                          "Rows written per table, for pipelines that route to many tables "
                                          "(sink.table a template).", [*p, "table"], registry=r)
        self.table_dead_lettered = Counter("ingest_table_dead_lettered_total",
                                           "Records a routed table's database refused (dead-lettered at stage "
                                           "write), per table.", [*p, "table"], registry=r)
        self.records_filtered = Counter("ingest_records_filtered_total",
                                        "Records a filter transform dropped (handled: their offsets are committed).",
                                        [*p, "step"], registry=r)
        self.batch_rows = Histogram("ingest_batch_rows", "Records per flushed batch.", p,
                                    buckets=_BATCH_ROWS_BUCKETS, registry=r)
        self.batch_bytes = Histogram("ingest_batch_bytes", "Payload bytes per flushed batch.", p,
                                     buckets=_BATCH_BYTES_BUCKETS, registry=r)
        self.flush_seconds = Histogram("ingest_flush_duration_seconds",
                                       "Time to write one batch (incl. retries, isolation, DLQ).", p,
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.flushes = Counter("ingest_flushes_total", "Batches flushed, by trigger.", [*p, "trigger"], registry=r)
        self.retries = Counter("ingest_retries_total", "Transient failures retried.", p, registry=r)
        self.write_calls = Counter("ingest_write_calls_total", "Sink write transactions attempted.", p, registry=r)
        self.commits = Counter("ingest_commits_total", "Offset commits sent.", p, registry=r)
        self.paused_seconds = Counter("ingest_paused_seconds_total", "Time consumption was paused by backpressure.",
                                      p, registry=r)
        self.buffered_records = Gauge("ingest_buffered_records", "Records in flight (buffered or being written).",
                                      p, registry=r)
        self.buffered_bytes = Gauge("ingest_buffered_bytes", "Bytes in flight.", p, registry=r)
        self.offset_gaps = Gauge("ingest_offset_gaps", "Done offsets above the committable watermark.", p, registry=r)
        self.oldest_unfinished_age = Gauge("ingest_oldest_unfinished_age_seconds",
                                           "Age of the oldest record consumed but not yet handled.", p, registry=r)
        self.lag = Gauge("ingest_consumer_lag_records", "Log end minus committed watermark, per partition.",
                         [*p, "topic", "partition"], registry=r)
        self.e2e_latency = Histogram("ingest_end_to_end_latency_seconds",
                                     "Record timestamp to written in the sink (oldest record of each batch).", p,
                                     buckets=_SECONDS_BUCKETS, registry=r)
        self.hot_key_share = Gauge("ingest_hot_key_share", "Share of a lane's recent records taken by its top key.",
                                   [*p, "lane"], registry=r)
        self.assigned_partitions = Gauge("ingest_assigned_partitions", "Partitions assigned to this process.", p,
                                         registry=r)
        tp = [*p, "topic", "partition"]
        self.lag_seconds = Gauge("ingest_consumer_lag_seconds",
                                 "Time lag per partition: now minus the timestamp of the last record consumed from "
                                 "it, while it has lag (0 when caught up).", tp, registry=r)
        self.committed_offset = Gauge("ingest_committed_offset",
                                      "Committed watermark (next offset to read) per partition.", tp, registry=r)
        self.lane_buffered = Gauge("ingest_lane_buffered_records",
                                   "Records in flight per lane (buffered or being written).", [*p, "lane"], registry=r)
        self.state = Gauge("ingest_pipeline_state", "1 for the pipeline's current state (see GET /status), "
                           "0 for the others.", [*p, "state"], registry=r)
        self.ready = Gauge("ingest_pipeline_ready", "1 while the pipeline is ready as /readyz means it "
                           "(running, partitions assigned, sink answered), else 0.", p, registry=r)
        self.dlq_guard_tripped = Gauge("ingest_dlq_guard_tripped", "1 once the DLQ guard stopped the pipeline.", p,
                                       registry=r)
        self.health = HealthState()
        self.status = StatusBoard(on_state=self._state_changed)

    def _state_changed(self, pipeline: str, old: str, new: str) -> None:
        self.state.labels(pipeline, old).set(0)
        self.state.labels(pipeline, new).set(1)

    def pipeline(self, name: str) -> PipelineMetrics:
        return PipelineMetrics(self, name)


class PipelineMetrics:
    """The metrics of one pipeline, label bound. Methods are cheap; call them per poll or per batch."""

    def __init__(self, m: Metrics, name: str) -> None:
        self.name = name
        self._m = m
        self.records_consumed = m.records_consumed.labels(name)
        self.rows_written = m.rows_written.labels(name)
        self.rows_deleted = m.rows_deleted.labels(name)
        self.records_done = m.records_done.labels(name)
        self.batch_rows = m.batch_rows.labels(name)
        self.batch_bytes = m.batch_bytes.labels(name)
        self.flush_seconds = m.flush_seconds.labels(name)
        self.retries = m.retries.labels(name)
        self.write_calls = m.write_calls.labels(name)
        self.commits = m.commits.labels(name)
        self.paused_seconds = m.paused_seconds.labels(name)
        self.buffered_records = m.buffered_records.labels(name)
        self.buffered_bytes = m.buffered_bytes.labels(name)
        self.offset_gaps = m.offset_gaps.labels(name)
        self.oldest_unfinished_age = m.oldest_unfinished_age.labels(name)
        self.e2e_latency = m.e2e_latency.labels(name)
        self.assigned = m.assigned_partitions.labels(name)
        self.health = m.health.pipeline(name)
        self.status = m.status.pipeline(name)
        self.ready = m.ready.labels(name)
        self.dlq_guard_tripped = m.dlq_guard_tripped.labels(name)
        for trigger in ("size", "bytes", "time", "shutdown", "revoke"):
            m.flushes.labels(name, trigger)
        for state in STATES:  # every state's series exists from the start (0), so queries on them never come back empty
            m.state.labels(name, state).set(1 if state == self.status.state else 0)
        self.ready.set(0)
        self.dlq_guard_tripped.set(0)

    def flushed(self, trigger: str) -> None:
        self._m.flushes.labels(self.name, trigger).inc()

    def dead_lettered(self, stage: str, error_class: str, n: int) -> None:
        self._m.dead_lettered.labels(self.name, stage, error_class).inc(n)

    def filtered(self, step: str, n: int) -> None:
        self._m.records_filtered.labels(self.name, step).inc(n)

    def table_rows_written(self, table: str, n: int) -> None:
        self._m.table_rows_written.labels(self.name, table).inc(n)

    def table_dead_lettered(self, table: str, n: int) -> None:
        self._m.table_dead_lettered.labels(self.name, table).inc(n)

    def set_lag(self, topic: str, partition: int, lag: int, lag_s: float | None = None,
                committed: int | None = None) -> None:
        """One partition's lag in records, and (when given) in seconds and its committed offset."""
        labels = (self.name, topic, str(partition))
        self._m.lag.labels(*labels).set(lag)
        if lag_s is not None:
            self._m.lag_seconds.labels(*labels).set(lag_s)
        if committed is not None:
            self._m.committed_offset.labels(*labels).set(committed)

    def drop_lag(self, topic: str, partition: int) -> None:
        """The partition is no longer assigned here: its per-partition series go (another member reports it)."""
        for gauge in (self._m.lag, self._m.lag_seconds, self._m.committed_offset):
            try:
                gauge.remove(self.name, topic, str(partition))
            except KeyError:
                pass

    def set_lane_buffered(self, lane: int, records: int) -> None:
        self._m.lane_buffered.labels(self.name, str(lane)).set(records)

    def set_hot_key_share(self, lane: int, share: float) -> None:
        self._m.hot_key_share.labels(self.name, str(lane)).set(share)


@dataclass
class PipelineHealth:
    """Liveness and readiness facts of one pipeline, updated by its thread."""

    last_loop_s: float = field(default_factory=time.monotonic)
    assigned: int = 0
    sink_ok: bool = True
    running: bool = True
    stopped_cleanly: bool = False

    def tick(self) -> None:
        self.last_loop_s = time.monotonic()


class HealthState:
    """What ``/healthz`` and ``/readyz`` report. Thread-safe enough: plain attribute writes."""

    def __init__(self, stuck_after_s: float = 60.0) -> None:
        self.stuck_after_s = stuck_after_s
        self._pipelines: dict[str, PipelineHealth] = {}
        self._lock = threading.Lock()

    def pipeline(self, name: str) -> PipelineHealth:
        with self._lock:
            return self._pipelines.setdefault(name, PipelineHealth())

    def live(self, now_s: float | None = None) -> tuple[bool, dict[str, object]]:
        """Healthy unless a running pipeline's loop has not turned for ``stuck_after_s``."""
        now_s = time.monotonic() if now_s is None else now_s
        detail: dict[str, object] = {}
        ok = True
        for name, h in list(self._pipelines.items()):
            age = now_s - h.last_loop_s
            stuck = h.running and age > self.stuck_after_s
            ok = ok and not stuck
            detail[name] = {"loop_age_s": round(age, 3), "stuck": stuck, "running": h.running}
        return ok, detail

    def ready(self) -> tuple[bool, dict[str, object]]:
        """Ready when every running pipeline has partitions assigned and its sink answered its last write."""
        detail: dict[str, object] = {}
        ok = bool(self._pipelines)
        for name, h in list(self._pipelines.items()):
            this = h.running and h.assigned > 0 and h.sink_ok
            ok = ok and this
            detail[name] = {"assigned_partitions": h.assigned, "sink_ok": h.sink_ok, "running": h.running}
        return ok, detail
