"""GET /status and the operations gauges behind the alert rules, on the scripted source.

The pipeline loop is driven step by step (stepped lanes, fake clock, a model table) and its
:class:`ingest.status.PipelineStatus` and gauges (``ingest_pipeline_state``,
``ingest_dlq_guard_tripped``, ``ingest_pipeline_ready``, ``ingest_consumer_lag_seconds``,
``ingest_committed_offset``, ``ingest_lane_buffered_records``) are read back; the HTTP endpoint is
served on an ephemeral loopback port. The real process is driven through the same states in
``tests/integration/test_status_api.py``.
"""

from __future__ import annotations

import threading
import urllib.request

import orjson
import pytest
from prometheus_client import generate_latest
from runner_fakes import FAST_RETRY, FakeClock, ModelDlq, ModelTable, SteppedLanes

from ingest import redact
from ingest.config import PipelineSettings
from ingest.core.collapse import CollapseRule
from ingest.core.hotkeys import LaneLoad
from ingest.core.offsets import OffsetTracker
from ingest.errors import FatalPipelineError, TransientError
from ingest.http import serve
from ingest.metrics import Metrics
from ingest.runner import Pipeline, RunOptions
from ingest.runner.observe import SMALL_CHUNK, TIMESTAMP_SAMPLE_MS, Observer
from ingest.runner.writer import BatchWriter
from ingest.sources.memory import MemoryLog, MemorySource
from ingest.status import MAX_MESSAGE, STATES, PipelineStatus, StatusBoard, error_class_of
from ingest.types import Partition, Record

pytestmark = pytest.mark.timeout(60)

TOPIC = "t"
P0 = Partition(TOPIC, 0)


def _value(text: str, name: str, **labels: str) -> float | None:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return None


class Run:
    """One pipeline on a MemoryLog with its own Metrics, stepped lanes and a fake clock."""

    def __init__(self, log: MemoryLog, **settings) -> None:
        self.metrics = Metrics()
        self.clock = FakeClock()
        self.table, self.dlq = ModelTable(key_index=(0,)), ModelDlq()
        self.stop, abort = threading.Event(), threading.Event()
        writer = BatchWriter(pipeline="st", write=self.table.write, dlq=self.dlq, retry=FAST_RETRY,
                             collapse_rule=CollapseRule((0,)), abort=abort)
        self.lanes = SteppedLanes(1, writer)
        config = {
            "name": "st", "topics": [TOPIC], "lanes": 1, "commit_interval_ms": 10, "shutdown_timeout_s": 0.05,
            "batch": {"max_rows": 10, "max_latency_ms": 20}, "retry": FAST_RETRY.model_dump(),
            "sink": {"kind": "postgres", "dsn": "postgresql://u@127.0.0.1:1/x", "table": "t",
                     "conflict_key": ["id"], "columns": {"id": {"type": "bigint", "required": True}}},
            **settings,
        }

        def factory(listener):
            self.source = MemorySource(log, listener, [TOPIC])
            return self.source

        self.pipeline = Pipeline(PipelineSettings.model_validate(config), source_factory=factory, writer=writer,
                                 stop=self.stop, abort=abort, options=RunOptions(poll_timeout_ms=0),
                                 lanes=self.lanes, clock=self.clock, metrics=self.metrics.pipeline("st"))
        self.pipeline.start()
        self.source.assign([P0])

    @property
    def status(self) -> dict:
        return self.metrics.status.snapshot()["pipelines"]["st"]

    def gauge(self, name: str, **labels: str) -> float | None:
        return _value(generate_latest(self.metrics.registry).decode(), name, pipeline="st", **labels)

    def turn(self, *, write: bool = True, ms: int = 25) -> bool:
        alive = self.pipeline.step()
        if write:
            for lane in self.lanes.pending():
                self.lanes.run_one(lane)
        self.clock.advance(ms)
        return alive


def _log(good: int, poison: int = 0, timestamp_ms: int | None = None) -> MemoryLog:
    log = MemoryLog({P0: []})
    for i in range(good):
        log.append(P0, b"k%d" % i, orjson.dumps({"id": i}), timestamp_ms=timestamp_ms)
    for _ in range(poison):
        log.append(P0, b"bad", b"{not json", timestamp_ms=timestamp_ms)
    return log


def test_a_pipeline_starts_runs_drains_and_stops_and_the_state_gauge_follows() -> None:
    run = Run(_log(30))
    assert run.status["state"] == "starting"
    assert run.gauge("ingest_pipeline_state", state="starting") == 1
    for _ in range(5):
        run.turn()
    s = run.status
    assert s["state"] == "running" and s["error"] is None and s["error_class"] is None
    assert s["partitions"] == [{"topic": TOPIC, "partition": 0, "committed": 30, "log_end": 30, "lag": 0}]
    assert s["lag"] == 0
    assert run.gauge("ingest_pipeline_state", state="running") == 1
    assert run.gauge("ingest_pipeline_state", state="starting") == 0
    assert run.gauge("ingest_pipeline_ready") == 1
    assert run.gauge("ingest_committed_offset", topic=TOPIC, partition="0") == 30
    assert run.gauge("ingest_consumer_lag_seconds", topic=TOPIC, partition="0") == 0
    assert run.gauge("ingest_lane_buffered_records", lane="0") == 0
    run.stop.set()
    assert run.turn() is False
    run.pipeline.finish()
    assert run.status["state"] == "stopped"
    assert sum(run.gauge("ingest_pipeline_state", state=st) for st in STATES) == 1
    assert run.gauge("ingest_pipeline_state", state="stopped") == 1
    assert run.gauge("ingest_pipeline_ready") == 0


def test_backpressure_shows_as_paused_and_lane_records_as_in_flight() -> None:
    run = Run(_log(40), max_buffered_records=15)
    for _ in range(4):  # lanes never run: batches pile up in flight
        run.turn(write=False)
    assert run.status["state"] == "paused"
    assert run.gauge("ingest_pipeline_state", state="paused") == 1
    assert run.gauge("ingest_lane_buffered_records", lane="0") >= 15
    for _ in range(40):
        run.turn()
    assert run.status["state"] == "running"


def test_a_dlq_guard_trip_is_failed_with_its_class_and_the_trip_gauge() -> None:
    run = Run(_log(5, poison=20), dlq={"max_consecutive": 3})
    for _ in range(50):
        if not run.turn():
            break
    with pytest.raises(FatalPipelineError) as info:
        run.pipeline.finish()
    assert info.value.error_class == "dlq_guard"
    s = run.status
    assert s["state"] == "failed" and s["error_class"] == "dlq_guard"
    assert "DLQ guard tripped" in s["error"]
    assert s["last_error"]["error_class"] == "dlq_guard"
    assert s["dead_lettered"]["total"] >= 4
    assert s["dead_lettered"]["by_class"] == {"invalid_json": s["dead_lettered"]["total"]}
    assert set(s["dead_lettered"]["by_stage_and_class"]) == {"decode/invalid_json"}
    assert run.gauge("ingest_dlq_guard_tripped") == 1
    assert run.gauge("ingest_pipeline_state", state="failed") == 1


class _Source:
    """Just what Observer.observe reads of a source."""

    def __init__(self, highs: dict[Partition, int]) -> None:
        self.highs = highs

    def cached_high(self, tp: Partition) -> int | None:
        return self.highs.get(tp)


def test_lag_in_seconds_is_now_minus_the_last_consumed_timestamp_while_behind() -> None:
    metrics = Metrics()
    pm = metrics.pipeline("st")
    wall = [1_000_000]
    observer = Observer("st", pm, LaneLoad(2), hot_key_share=0.5, hot_key_interval_s=10, now_ms=0,
                        wall_ms=lambda: wall[0])
    p1 = Partition(TOPIC, 1)
    tracker: OffsetTracker[Partition] = OffsetTracker()
    for tp in (P0, p1):
        tracker.assign(tp)
    tracker.mark_committed(P0, 10)
    tracker.mark_committed(p1, 50)
    observer.consumed([Record(TOPIC, 0, 9, None, b"", 990_000), Record(TOPIC, 1, 49, None, b"", 999_000)], 0)
    wall[0] = 1_004_000

    def observe() -> str:
        observer.observe(0, tracker=tracker, source=_Source({P0: 110, p1: 50}), in_flight_records=7,
                         in_flight_bytes=0, lane_in_flight=[5, 2], oldest_ms=[])
        return generate_latest(metrics.registry).decode()

    text = observe()
    assert _value(text, "ingest_consumer_lag_records", partition="0") == 100
    assert _value(text, "ingest_consumer_lag_seconds", partition="0") == 14.0  # behind: 1004 s - 990 s
    assert _value(text, "ingest_consumer_lag_seconds", partition="1") == 0.0  # caught up
    assert _value(text, "ingest_committed_offset", partition="1") == 50
    assert _value(text, "ingest_lane_buffered_records", lane="0") == 5
    assert _value(text, "ingest_lane_buffered_records", lane="1") == 2
    assert pm.status.snapshot()["partitions"][0] == {"topic": TOPIC, "partition": 0, "committed": 10,
                                                     "log_end": 110, "lag": 100}
    wall[0] = 1_010_000  # nothing more consumed (stuck): the time lag grows
    assert _value(observe(), "ingest_consumer_lag_seconds", partition="0") == 20.0
    pm.drop_lag(TOPIC, 0)  # revoked: its series go
    text = generate_latest(metrics.registry).decode()
    assert _value(text, "ingest_consumer_lag_seconds", partition="0") is None
    assert _value(text, "ingest_committed_offset", partition="0") is None


def test_timestamps_of_large_chunks_are_sampled() -> None:
    observer = Observer("st", Metrics().pipeline("st"), LaneLoad(1), hot_key_share=0.5, hot_key_interval_s=10,
                        now_ms=0)
    big = [Record(TOPIC, 0, i, None, b"", 1000 + i) for i in range(SMALL_CHUNK + 1)]
    observer.consumed(big, 0)
    assert observer._last_ts_ms[(TOPIC, 0)] == 1000 + SMALL_CHUNK
    later = [Record(TOPIC, 0, i, None, b"", 5000 + i) for i in range(SMALL_CHUNK + 1)]
    observer.consumed(later, TIMESTAMP_SAMPLE_MS - 1)  # too soon: skipped
    assert observer._last_ts_ms[(TOPIC, 0)] == 1000 + SMALL_CHUNK
    observer.consumed(later[:2], TIMESTAMP_SAMPLE_MS - 1)  # small chunks are always read
    assert observer._last_ts_ms[(TOPIC, 0)] == 5001
    observer.consumed(later, TIMESTAMP_SAMPLE_MS * 2)
    assert observer._last_ts_ms[(TOPIC, 0)] == 5000 + SMALL_CHUNK


def test_messages_are_scrubbed_of_secrets_and_cut() -> None:
    redact.register("hunter2-status-secret")
    status = PipelineStatus("p")
    status.error("transient", "connect to postgresql://u:hunter2-status-secret@db/x failed")
    assert "hunter2" not in orjson.dumps(status.snapshot()).decode()
    assert redact.MASK in status.snapshot()["last_error"]["message"]
    status.stopped(FatalPipelineError("x" * (MAX_MESSAGE + 50) + " hunter2-status-secret", error_class="fatal"))
    snap = status.snapshot()
    assert snap["state"] == "failed" and snap["error_class"] == "fatal"
    assert len(snap["error"]) == MAX_MESSAGE + 1 and "hunter2" not in snap["error"]


def test_states_are_checked_and_error_classes_named() -> None:
    seen: list[tuple[str, str, str]] = []
    board = StatusBoard(on_state=lambda *change: seen.append(change))
    p = board.pipeline("a")
    with pytest.raises(ValueError):
        p.set_state("sleeping")
    p.set_state("running")
    p.set_state("running")  # unchanged: no call
    assert seen == [("a", "starting", "running")]
    assert board.snapshot()["ok"] is True
    board.pipeline("b")
    assert board.snapshot()["ok"] is False  # b still starting
    assert StatusBoard().snapshot()["ok"] is False
    assert error_class_of(TransientError("x", error_class="schema_registry_unavailable")) == \
        "schema_registry_unavailable"
    assert error_class_of(RuntimeError("x")) == "RuntimeError"


def test_the_http_endpoint_serves_status_as_json() -> None:
    metrics = Metrics()
    pm = metrics.pipeline("web")
    pm.status.set_state("held")
    pm.status.error("schema_registry_unavailable", "registry down")
    server = serve(metrics, 0, host="127.0.0.1")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
            body = orjson.loads(resp.read())
    finally:
        server.shutdown()
        server.server_close()
    assert body["ok"] is False
    web = body["pipelines"]["web"]
    assert web["state"] == "held"
    assert web["last_error"]["error_class"] == "schema_registry_unavailable"
    assert set(web) == {"state", "since", "error_class", "error", "lag", "partitions", "dead_lettered",
                        "last_error"}
