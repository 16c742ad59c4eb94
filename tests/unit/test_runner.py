"""The pipeline loop on the scripted source, step by step: --until-idle, commits past markers, lost
partitions, backpressure. (The random search over all of it is test_runner_model.py.)"""

from __future__ import annotations

import threading

import orjson
import pytest
from runner_fakes import FAST_RETRY, FakeClock, ModelDlq, ModelTable, SteppedLanes

from ingest.config import PipelineSettings
from ingest.core.collapse import CollapseRule
from ingest.errors import FatalPipelineError
from ingest.runner import Pipeline, RunOptions
from ingest.runner.drain import DrainWatch
from ingest.sources.base import Backlog
from ingest.sources.memory import MemoryLog, MemorySource
from ingest.types import Partition
from ingest.runner.writer import BatchWriter

TOPIC = "t"
P0, P1 = Partition(TOPIC, 0), Partition(TOPIC, 1)


def _settings(**extra) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "unit", "topics": [TOPIC], "lanes": 1, "commit_interval_ms": 10, "shutdown_timeout_s": 30,
        "batch": {"max_rows": 100, "max_latency_ms": 20}, "retry": FAST_RETRY.model_dump(),
        "sink": {"kind": "postgres", "dsn": "postgresql://u@127.0.0.1:1/x", "table": "t", "conflict_key": ["id"],
                 "columns": {"id": {"type": "bigint", "required": True}}},
        **extra,
    })


class Harness:
    """One member on a MemoryLog, with a model table, stepped lanes and a fake clock."""

    def __init__(self, log: MemoryLog, *, until_idle_s: float | None = None, drain_timeout_s: float | None = None,
                 assign: tuple[Partition, ...] = (P0,), settings: PipelineSettings | None = None) -> None:
        self.log, self.clock = log, FakeClock()
        self.table, self.dlq = ModelTable(key_index=(0,)), ModelDlq()
        self.stop, abort = threading.Event(), threading.Event()
        writer = BatchWriter(pipeline="unit", write=self.table.write, dlq=self.dlq, retry=FAST_RETRY,
                             collapse_rule=CollapseRule((0,)), abort=abort)
        self.lanes = SteppedLanes(1, writer)
        self.source: MemorySource | None = None

        def factory(listener):
            self.source = MemorySource(log, listener, [TOPIC])
            return self.source

        self.pipeline = Pipeline(settings or _settings(), source_factory=factory, writer=writer, stop=self.stop, abort=abort,
                                 options=RunOptions(poll_timeout_ms=0, until_idle_s=until_idle_s,
                                                    drain_timeout_s=drain_timeout_s),
                                 lanes=self.lanes, clock=self.clock)
        self.pipeline.start()
        assert self.source is not None
        self.source.assign(list(assign))

    def turn(self, ms: int = 25) -> bool:
        """One step, then every queued batch written, then the clock moves on."""
        alive = self.pipeline.step()
        for lane in self.lanes.pending():
            self.lanes.run_one(lane)
        self.clock.advance(ms)
        return alive

    def run_until_done(self, max_turns: int = 500) -> int:
        for turn in range(max_turns):
            if not self.turn():
                return turn
        raise AssertionError("the loop did not end")


def _log(records: dict[Partition, int]) -> MemoryLog:
    log = MemoryLog({P0: [], P1: []})
    for tp, n in records.items():
        for i in range(n):
            log.append(tp, b"k", orjson.dumps({"id": tp.partition * 1000 + i}))
    return log


def test_until_idle_finishes_once_the_group_drained() -> None:
    log = _log({P0: 5})
    h = Harness(log, until_idle_s=0.1, assign=(P0, P1))
    h.run_until_done()
    h.pipeline.finish()
    assert log.committed == {P0: 5} and len(h.table.rows) == 5


def test_until_idle_waits_for_partitions_other_members_hold() -> None:
    log = _log({P0: 3, P1: 4})
    h = Harness(log, until_idle_s=0.1, drain_timeout_s=5, assign=(P0,))  # P1 belongs to someone else
    for _ in range(40):  # 1 s: long idle, P1 still behind
        assert h.turn(), "finished while another member's partition was not drained"
    log.committed[P1] = 4  # the other member finishes P1
    h.run_until_done()
    h.pipeline.finish()
    assert h.pipeline.stats.undrained == []


def test_until_idle_gives_up_after_the_drain_timeout_naming_what_is_left() -> None:
    log = _log({P0: 3, P1: 4})
    log.committed[P1] = 1
    h = Harness(log, until_idle_s=0.1, drain_timeout_s=0.5, assign=(P0,))
    turns = h.run_until_done()
    assert 20 <= turns <= 40  # idle (0.1 s) + the timeout (0.5 s), in 25 ms turns
    with pytest.raises(FatalPipelineError, match=r"did not drain the topics within 0.5 s: t\[1\] 3 behind"):
        h.pipeline.finish()
    assert h.pipeline.stats.undrained == [{"topic": TOPIC, "partition": 1, "committed": 1, "behind": 3}]
    assert log.committed[P0] == 3, "its own partition is committed"


@pytest.mark.timeout(60)
def test_a_batch_failing_during_the_shutdown_drain_ends_the_wait_at_once() -> None:
    """Its retries spent, a batch halts the lanes: nothing more can complete, so the drain stops
    waiting (it used to spin until shutdown_timeout_s -- an hour here -- before exiting)."""
    log = _log({P0: 150})
    h = Harness(log, settings=_settings(shutdown_timeout_s=3600))
    assert h.pipeline.step()  # 100 records dispatched to the lane, 50 buffered
    assert h.lanes.pending() == [0]
    h.table.transient = 1_000  # every write attempt fails: the batch's retries run out
    h.stop.set()
    with pytest.raises(FatalPipelineError):
        h.pipeline.finish()
    assert log.committed.get(P0, 0) == 0 and h.table.rows == {}, "nothing written, nothing committed"


def test_retries_reach_the_metric_as_they_happen_and_once() -> None:
    """ingest_retries_total moves while a batch is still retrying (an alert on a retry storm must not
    wait for the batch to complete), and the completion does not count them again."""
    log = _log({P0: 5})
    h = Harness(log)
    retries = h.pipeline.metrics.retries
    seen: list[float] = []  # the metric at each write attempt, before the batch completes
    h.table.before_write = lambda: seen.append(retries._value.get())
    h.table.transient = 2  # two failed attempts, then the write goes through (FAST_RETRY: 3 attempts)
    for _ in range(3):
        h.turn()
    assert seen[:3] == [0, 1, 2], seen
    assert retries._value.get() == 2
    assert h.pipeline.stats.retries == 2 and len(h.table.rows) == 5


def test_new_records_end_the_wait() -> None:
    watch = DrainWatch("p", idle_s=1, drain_timeout_s=2)

    class Behind:
        def backlog(self, timeout_s: float) -> list[Backlog]:
            return [Backlog(P1, 0, 1)]

    assert not watch.check(0, Behind()).done
    assert not watch.check(1500, Behind()).done
    watch.busy()  # records arrived: waiting starts over
    assert not watch.check(2500, Behind()).done
    assert watch.check(4500, Behind()).failed


def test_a_partition_ending_with_a_transaction_marker_commits_its_end() -> None:
    log = _log({P0: 3})
    log.append_marker(P0)
    h = Harness(log, until_idle_s=0.1)
    h.run_until_done()
    h.pipeline.finish()
    assert log.committed[P0] == 4 == log.end(P0)


def test_a_lost_partition_commits_nothing_more_and_its_buffered_records_are_read_again() -> None:
    log = _log({P0: 3})
    h = Harness(log)
    h.pipeline.step()  # polled and buffered (max_latency 20 ms not reached yet)
    assert h.pipeline._flow.records == 3  # noqa: SLF001 - the loop's own accounting
    assert h.source is not None
    h.source.lose([P0])
    h.pipeline.step()
    assert h.pipeline._flow.records == 0  # noqa: SLF001
    h.source.assign([P0])
    for _ in range(10):
        h.turn()
    assert log.committed == {P0: 3} and len(h.table.log) == 3, "each record written once"
