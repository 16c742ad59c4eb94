"""ingest.lag: clamping, totals, the hot-partition rule, rendering; measuring against fake handles."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest
from confluent_kafka import (
    OFFSET_INVALID,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_NOT_AVAILABLE,
    KafkaError,
    KafkaException,
)

from ingest.lag import (
    HOT_MIN_LAG,
    LagReport,
    PartitionLag,
    age_seconds,
    consume_position,
    format_age,
    is_hot,
    measure_partitions,
    oldest_timestamps,
    records_behind,
    render_json,
    render_tables,
    summarize,
)


def row(partition: int, committed: int | None, end: int, *, low: int = 0, topic: str = "t",
        lag_s: float | None = None) -> PartitionLag:
    return PartitionLag(topic, partition, committed, low, end, records_behind(committed, low, end), lag_s=lag_s)


# --------------------------------------------------------------------------- clamping
@pytest.mark.parametrize(
    ("committed", "low", "end", "expected"),
    [
        (10, 0, 25, 15),
        (25, 0, 25, 0),
        (30, 0, 25, 0),  # watermark reported below the commit (Tansu): clamped, never negative
        (None, 0, 25, 25),  # no commit: from the low watermark
        (None, 7, 25, 18),
        (3, 7, 25, 18),  # commit below the low watermark (retention): from the low watermark
        (None, 0, 0, 0),
        (0, 0, 0, 0),
    ],
)
def test_records_behind(committed, low, end, expected) -> None:
    assert records_behind(committed, low, end) == expected


def test_consume_position() -> None:
    assert consume_position(None, 5) == 5
    assert consume_position(3, 5) == 5
    assert consume_position(9, 5) == 9


def test_age_seconds_clamps_future_timestamps() -> None:
    assert age_seconds(None, 1000) is None
    assert age_seconds(1000, 3500) == 2.5
    assert age_seconds(5000, 3500) == 0.0


# --------------------------------------------------------------------------- hot rule
def test_is_hot_rule() -> None:
    assert is_hot(600, 1000, 3)
    assert not is_hot(500, 1000, 3)  # exactly half does not dominate
    assert not is_hot(99, 99, 3)  # below the minimum pipeline lag
    assert is_hot(HOT_MIN_LAG, HOT_MIN_LAG, 2)
    assert not is_hot(1000, 1000, 1)  # a lone partition is never hot
    assert not is_hot(0, 0, 3)
    assert is_hot(31, 60, 3, min_lag=50)
    assert not is_hot(31, 60, 3, share=0.6, min_lag=50)


def test_summarize_totals_and_hot_flag() -> None:
    rows = [row(2, 100, 110), row(0, 0, 900, lag_s=4.0), row(1, None, 50, lag_s=9.5)]
    pl = summarize("orders", "ingest-orders", ["t"], rows)
    assert [p.partition for p in pl.partitions] == [0, 1, 2]
    assert [p.lag for p in pl.partitions] == [900, 50, 10]
    assert pl.lag == 960
    assert pl.max_lag_s == 9.5
    assert pl.uncommitted == 1
    assert [p.partition for p in pl.hot] == [0]
    assert [p.hot for p in pl.partitions] == [True, False, False]


def test_summarize_no_hot_when_balanced_or_small() -> None:
    balanced = summarize("p", "g", ["t"], [row(0, 0, 400), row(1, 0, 400), row(2, 0, 300)])
    assert balanced.lag == 1100 and balanced.hot == ()
    small = summarize("p", "g", ["t"], [row(0, 0, 90), row(1, 0, 2)])
    assert small.lag == 92 and small.hot == ()
    idle = summarize("p", "g", ["t"], [row(0, 10, 10), row(1, 12, 5)])
    assert idle.lag == 0 and idle.hot == () and idle.max_lag_s is None


def test_summarize_sorts_across_topics_and_keeps_errors() -> None:
    pl = summarize("p", "g", ["b", "a"], [row(1, 0, 1, topic="b"), row(0, 0, 1, topic="b"), row(3, 0, 1, topic="a")],
                   ["topic c: Broker: Unknown topic or partition"])
    assert [p.key for p in pl.partitions] == [("a", 3), ("b", 0), ("b", 1)]
    assert pl.errors == ("topic c: Broker: Unknown topic or partition",)
    assert pl.topics == ("b", "a")


def test_report_json_document() -> None:
    a = summarize("a", "ga", ["t"], [row(0, 0, 900, lag_s=1.23456), row(1, 100, 100)])
    b = summarize("b", "gb", ["u"], [row(0, None, 5, topic="u")], ["boom"])
    report = LagReport(at_ms=1_700_000_000_123, pipelines=(a, b))
    doc = orjson.loads(render_json(report))
    assert doc["at"] == "2023-11-14T22:13:20.123Z"
    assert list(doc["pipelines"]) == ["a", "b"]
    pa = doc["pipelines"]["a"]
    assert pa["group_id"] == "ga"
    assert pa["partitions"][0] == {"topic": "t", "partition": 0, "committed": 0, "low": 0, "end": 900, "lag": 900,
                                   "oldest_ts_ms": None, "lag_s": 1.235, "hot": True}
    assert pa["partitions"][1]["lag"] == 0 and pa["partitions"][1]["lag_s"] is None
    assert pa["totals"] == {"partitions": 2, "lag": 900, "end": 1000, "max_lag_s": 1.235,
                            "uncommitted_partitions": 0,
                            "hot_partitions": [{"topic": "t", "partition": 0, "lag": 900, "share": 1.0}]}
    assert doc["pipelines"]["b"]["partitions"][0]["committed"] is None
    assert doc["pipelines"]["b"]["errors"] == ["boom"]
    assert doc["totals"] == {"pipelines": 2, "partitions": 3, "lag": 905, "max_lag_s": 1.235,
                             "hot_partitions": 1, "errors": 1}
    assert report.errors == ["pipeline b: boom"]
    assert b"\n" not in render_json(report, compact=True)


def test_render_tables_mentions_every_partition() -> None:
    from rich.console import Console

    pl = summarize("orders", "ingest-orders", ["t"], [row(0, 0, 900, lag_s=75), row(1, None, 3)])
    console = Console(width=200, record=True, force_terminal=False)
    for r in render_tables(LagReport(at_ms=0, pipelines=(pl,))):
        console.print(r)
    text = console.export_text()
    assert "pipeline orders" in text and "ingest-orders" in text
    assert "HOT" in text and "no commit" in text and "1m15s" in text
    assert "total lag 903 records" in text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (0.25, "250ms"), (12.34, "12.3s"), (245, "4m05s"), (7620, "2h07m"), (273600, "3d04h")],
)
def test_format_age(seconds, text) -> None:
    assert format_age(seconds) == text


# --------------------------------------------------------------------------- measuring with fake handles
class FakeMessage:
    def __init__(self, topic: str, partition: int, offset: int, ts: int | None) -> None:
        self._t, self._p, self._o, self._ts = topic, partition, offset, ts

    def error(self):
        return None

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def timestamp(self):
        return (TIMESTAMP_NOT_AVAILABLE, -1) if self._ts is None else (TIMESTAMP_CREATE_TIME, self._ts)


class FakeBroker:
    """Group consumer and probe in one: {topic: {partition: (low, high, committed, {offset: ts})}}."""

    def __init__(self, topics: dict) -> None:
        self.topics = topics
        self.assigned: list | None = None
        self.unassigned = False
        self.subscribed = False
        self.paused: list = []

    # group consumer
    def list_topics(self, topic=None, timeout=-1):
        if topic not in self.topics:
            err = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            return SimpleNamespace(topics={topic: SimpleNamespace(error=err, partitions={})})
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=dict.fromkeys(self.topics[topic]))})

    def get_watermark_offsets(self, tp, timeout=-1, cached=True):
        assert cached is False
        low, high, _, _ = self.topics[tp.topic][tp.partition]
        return low, high

    def committed(self, tps, timeout=-1):
        out = []
        for tp in tps:
            c = self.topics[tp.topic][tp.partition][2]
            out.append(SimpleNamespace(topic=tp.topic, partition=tp.partition,
                                       offset=OFFSET_INVALID if c is None else c, error=None))
        return out

    def subscribe(self, *a, **k):  # pragma: no cover - must never be called
        self.subscribed = True

    # probe
    def assign(self, tps):
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in tps]
        self._queue = []
        for t, p, off in self.assigned:
            stamps = self.topics[t][p][3]
            later = sorted(o for o in stamps if o >= off)
            if later:
                self._queue.append(FakeMessage(t, p, later[0], stamps[later[0]]))

    def consume(self, num_messages=1, timeout=-1):
        out, self._queue = self._queue[:num_messages], self._queue[num_messages:]
        return out

    def pause(self, tps):
        self.paused.extend((tp.topic, tp.partition) for tp in tps)

    def unassign(self):
        self.unassigned = True


def test_measure_partitions_with_fake_handles() -> None:
    broker = FakeBroker({
        "t": {
            0: (0, 1000, 400, {400: 1_000_000, 401: 1_000_500}),  # 600 behind, oldest at 1_000_000 ms
            1: (0, 50, None, {0: 1_010_000}),  # no commit: from low
            2: (0, 20, 20, {}),  # caught up: not probed
            3: (0, 7, 9, {}),  # watermark below commit (Tansu): clamped
        },
        "u": {0: (5, 8, None, {5: None})},  # no timestamp
    })
    rows, errors = measure_partitions(broker, broker, ["t", "u", "missing", "t"], timeout_s=1,
                                      clock=lambda: 1_020.0)
    assert errors == ["topic missing: Broker: Unknown topic or partition"]
    assert not broker.subscribed and broker.unassigned
    assert sorted(broker.assigned) == [("t", 0, 400), ("t", 1, 0), ("u", 0, 5)]
    by = {(r.topic, r.partition): r for r in rows}
    assert len(rows) == 5
    assert (by["t", 0].committed, by["t", 0].end, by["t", 0].lag, by["t", 0].lag_s) == (400, 1000, 600, 20.0)
    assert (by["t", 1].committed, by["t", 1].lag, by["t", 1].oldest_ts_ms, by["t", 1].lag_s) == (None, 50, 1_010_000,
                                                                                                    10.0)
    assert (by["t", 2].lag, by["t", 2].lag_s) == (0, None)
    assert (by["t", 3].committed, by["t", 3].end, by["t", 3].lag) == (9, 7, 0)
    assert (by["u", 0].low, by["u", 0].lag, by["u", 0].lag_s) == (5, 3, None)

    pl = summarize("p", "g", ["t", "u"], rows, errors)
    assert pl.lag == 653 and [p.key for p in pl.hot] == [("t", 0)] and pl.max_lag_s == 20.0


def test_measure_without_probe_skips_time_lag() -> None:
    broker = FakeBroker({"t": {0: (0, 10, 2, {2: 5})}})
    rows, errors = measure_partitions(broker, None, ["t"])
    assert errors == [] and broker.assigned is None
    assert rows == [PartitionLag("t", 0, 2, 0, 10, 8)]


def test_oldest_timestamps_gives_up_after_timeout() -> None:
    broker = FakeBroker({"t": {0: (0, 10, 0, {}), 1: (0, 10, 0, {3: 42})}})
    out = oldest_timestamps(broker, {("t", 0): 0, ("t", 1): 0}, timeout_s=0.2)
    assert out == {("t", 1): 42}
    assert broker.paused == [("t", 1)] and broker.unassigned


def test_measure_propagates_broker_failure() -> None:
    class Down(FakeBroker):
        def list_topics(self, topic=None, timeout=-1):
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))

    with pytest.raises(KafkaException):
        measure_partitions(Down({}), None, ["t"])
