"""DecodeHold (ingest/runner/hold.py): polled records wait, in order and untracked, while the decoder's
schema registry cannot answer; and Flow.regulate keeps every partition paused while they do.

Pure logic: a scripted ``prepare``, a real :class:`~ingest.runner.flow.Flow`, a seeded RNG and
explicit millisecond times (DecodeHold reads no clock of its own).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from ingest.config import RetrySettings
from ingest.errors import FatalPipelineError, TransientError
from ingest.metrics import Metrics
from ingest.runner import flow as flow_module
from ingest.runner.flow import Flow, Signal
from ingest.runner.hold import DecodeHold
from ingest.runner.stats import PipelineStats
from ingest.sources.memory import MemoryLog, MemorySource
from ingest.types import Partition, Record

P0 = Partition("t", 0)
P1 = Partition("t", 1)
P2 = Partition("t", 2)


class RecordingRandom(random.Random):
    """A seeded Random that records each backoff it draws: (low, high, value)."""

    def __init__(self, seed: int = 1234) -> None:
        super().__init__(seed)
        self.draws: list[tuple[float, float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        value = super().uniform(a, b)
        self.draws.append((a, b, value))
        return value

    @property
    def last_backoff_ms(self) -> int:
        return int(self.draws[-1][2])


class Prepare:
    """Raises ``error`` (TransientError by default) the first ``failures`` calls, then succeeds. Records
    a copy of what each call was given."""

    def __init__(self, failures: int, error: BaseException | None = None) -> None:
        self.failures = failures
        self.error = error
        self.calls: list[list[Record]] = []

    def __call__(self, records: Sequence[Record]) -> None:
        self.calls.append(list(records))
        if len(self.calls) <= self.failures:
            raise self.error or TransientError("schema registry at http://r:1 could not give schema id 1: HTTP 503",
                                               error_class="schema_registry_unavailable")


def make_flow(max_records: int = 1000, max_bytes: int = 1 << 20) -> Flow:
    return Flow("p", 1, max_records, max_bytes, stats=PipelineStats(), metrics=Metrics().pipeline("p"))


def recs(tp: Partition, *offsets: int) -> list[Record]:
    return [Record(tp.topic, tp.partition, o, b"k", b"\x00\x00\x00\x00\x01v", None) for o in offsets]


def positions(records: Sequence[Record]) -> list[tuple[int, int]]:
    return [(r.partition, r.offset) for r in records]


def make_hold(prepare: Prepare, *, max_attempts: int = 10, initial: int = 100, maximum: int = 10_000,
              flow: Flow | None = None, rng: random.Random | None = None) -> tuple[DecodeHold, Flow, RecordingRandom]:
    flow = flow or make_flow()
    rng = rng or RecordingRandom()
    retry = RetrySettings(max_attempts=max_attempts, initial_backoff_ms=initial, max_backoff_ms=maximum)
    return DecodeHold("p", prepare, retry, flow, rng=rng), flow, rng  # type: ignore[return-value]


# -- the registry answers: nothing held ---------------------------------------------------------------

def test_records_pass_straight_through_when_prepare_succeeds() -> None:
    prepare = Prepare(0)
    hold, flow, _ = make_hold(prepare)
    batch = recs(P0, 0, 1, 2)
    assert hold.admit(batch, 0) == batch
    assert prepare.calls == [batch]
    assert not hold.active and hold.held == 0 and flow.held is False


def test_an_empty_poll_calls_no_prepare() -> None:
    prepare = Prepare(0)
    hold, _, _ = make_hold(prepare)
    assert hold.admit([], 0) == []
    assert prepare.calls == []


# -- held, then released ----------------------------------------------------------------------------------

def test_records_polled_while_held_join_in_order_and_are_released_together() -> None:
    prepare = Prepare(2)
    hold, flow, rng = make_hold(prepare, initial=100, maximum=10_000)
    first = recs(P0, 0, 1)
    assert hold.admit(first, 1000) == []
    assert hold.active and hold.held == 2 and flow.held is True
    t = 1000 + rng.last_backoff_ms
    second = recs(P1, 0) + recs(P0, 2)
    assert hold.admit(second, t) == []  # the retry fails again
    assert hold.held == 4 and flow.held is True
    t += rng.last_backoff_ms
    third = recs(P1, 1)
    released = hold.admit(third, t)
    assert positions(released) == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]  # poll order kept
    assert released == first + second + third
    assert not hold.active and hold.held == 0 and flow.held is False
    # prepare saw the whole chunk at each try
    assert [positions(c) for c in prepare.calls] == [
        [(0, 0), (0, 1)], [(0, 0), (0, 1), (1, 0), (0, 2)], [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]]


def test_nothing_is_returned_or_tried_before_the_backoff_has_passed() -> None:
    prepare = Prepare(1)
    hold, flow, rng = make_hold(prepare, initial=1000, maximum=1000, rng=RecordingRandom(seed=7))
    assert hold.admit(recs(P0, 0), 5000) == []
    backoff = rng.last_backoff_ms
    assert 0 < backoff <= 1000  # seed 7 draws a non-zero backoff (checked here so the test means something)
    for now in (5000, 5000 + backoff // 2, 5000 + backoff - 1):
        assert hold.admit(recs(P0, now), now) == []  # a record polled meanwhile joins
        assert len(prepare.calls) == 1  # no retry before the backoff
        assert flow.held is True
    released = hold.admit([], 5000 + backoff)
    assert len(prepare.calls) == 2
    assert positions(released)[0] == (0, 0) and len(released) == 4
    assert flow.held is False


def test_an_empty_poll_after_the_backoff_retries_the_held_records() -> None:
    prepare = Prepare(1)
    hold, _, rng = make_hold(prepare)
    hold.admit(recs(P0, 0, 1), 0)
    released = hold.admit([], rng.last_backoff_ms)
    assert positions(released) == [(0, 0), (0, 1)]


def test_after_a_release_the_next_outage_backs_off_from_the_start_again() -> None:
    prepare = Prepare(3)
    hold, _, rng = make_hold(prepare, initial=100, maximum=100_000)
    t = 0
    assert hold.admit(recs(P0, 0), t) == []  # 1st try fails
    t += rng.last_backoff_ms
    assert hold.admit([], t) == []  # 2nd
    t += rng.last_backoff_ms
    assert hold.admit([], t) == []  # 3rd
    assert [d[1] for d in rng.draws] == [100, 200, 400]  # exponential caps
    t += rng.last_backoff_ms
    assert positions(hold.admit([], t)) == [(0, 0)]  # 4th succeeds: released
    assert not hold.active
    prepare.failures = len(prepare.calls) + 1  # the next call fails once more
    assert hold.admit(recs(P0, 1), t) == []
    assert hold.active
    assert rng.draws[-1][1] == 100  # attempts were reset by the release


# -- forget: revoked or lost partitions -----------------------------------------------------------------

def test_forget_drops_only_those_partitions_records() -> None:
    prepare = Prepare(1)
    hold, flow, rng = make_hold(prepare)
    hold.admit(recs(P0, 0) + recs(P1, 0) + recs(P2, 0) + recs(P1, 1) + recs(P0, 1), 0)
    hold.forget([P1])
    assert hold.held == 3 and hold.active and flow.held is True
    released = hold.admit([], rng.last_backoff_ms)
    assert positions(released) == [(0, 0), (2, 0), (0, 1)]


def test_forget_of_every_held_partition_releases_the_hold() -> None:
    prepare = Prepare(1)
    hold, flow, _ = make_hold(prepare)
    hold.admit(recs(P0, 0) + recs(P1, 0), 0)
    hold.forget([P0, P1])
    assert not hold.active and hold.held == 0
    assert flow.held is False


def test_forget_of_partitions_not_held_changes_nothing() -> None:
    prepare = Prepare(1)
    hold, flow, _ = make_hold(prepare)
    hold.admit(recs(P0, 0), 0)
    hold.forget([P1, Partition("other", 0)])
    assert hold.held == 1 and flow.held is True


def test_forget_of_another_topics_same_partition_number_keeps_the_records() -> None:
    prepare = Prepare(1)
    hold, _, _ = make_hold(prepare)
    hold.admit(recs(P0, 0), 0)
    hold.forget([Partition("u", 0)])
    assert hold.held == 1


def test_forget_with_nothing_held_is_harmless() -> None:
    hold, flow, _ = make_hold(Prepare(0))
    hold.forget([P0])
    assert not hold.active and flow.held is False


def test_after_forget_releases_the_next_failure_starts_over() -> None:
    prepare = Prepare(2)
    hold, _, rng = make_hold(prepare, initial=50, maximum=100_000)
    hold.admit(recs(P0, 0), 0)
    hold.forget([P0])
    assert not hold.active
    assert hold.admit(recs(P1, 0), 10) == []  # the second call fails too: a fresh hold
    assert hold.held == 1
    assert rng.draws[-1][1] == 50  # first attempt of a new hold


# -- retries run out ----------------------------------------------------------------------------------

def test_giving_up_raises_and_keeps_the_records_held() -> None:
    prepare = Prepare(100)
    hold, flow, rng = make_hold(prepare, max_attempts=3)
    batch = recs(P0, 0, 1) + recs(P1, 0)
    t = 0
    assert hold.admit(batch, t) == []
    t += rng.last_backoff_ms
    assert hold.admit([], t) == []
    t += rng.last_backoff_ms
    with pytest.raises(TransientError) as info:
        hold.admit([], t)
    assert "gave up after 3 attempts" in str(info.value)
    assert info.value.error_class == "schema_registry_unavailable"
    assert isinstance(info.value.__cause__, TransientError)
    assert len(prepare.calls) == 3
    # still held: this is what stops the pipeline from committing past them
    assert hold.active and hold.held == 3 and flow.held is True


def test_max_attempts_1_gives_up_on_the_first_failure_and_holds() -> None:
    prepare = Prepare(100)
    hold, flow, _ = make_hold(prepare, max_attempts=1)
    with pytest.raises(TransientError, match="gave up after 1 attempts"):
        hold.admit(recs(P0, 0), 0)
    assert hold.active and hold.held == 1 and flow.held is True


def test_max_attempts_0_retries_forever() -> None:
    prepare = Prepare(200)
    hold, flow, rng = make_hold(prepare, max_attempts=0, initial=1, maximum=5)
    t = 0
    hold.admit(recs(P0, 0), t)
    for _ in range(150):
        t += rng.last_backoff_ms
        assert hold.admit([], t) == []
    assert len(prepare.calls) == 151
    assert hold.active and flow.held is True


def test_the_backoff_never_exceeds_max_backoff_ms() -> None:
    prepare = Prepare(10_000)
    hold, _, rng = make_hold(prepare, max_attempts=0, initial=100, maximum=3000, rng=RecordingRandom(seed=99))
    t = 0
    hold.admit(recs(P0, 0), t)
    for _ in range(80):  # 2**79 * 100 would be astronomically large without the cap
        t += rng.last_backoff_ms
        hold.admit([], t)
    caps = [d[1] for d in rng.draws]
    assert caps[:7] == [100, 200, 400, 800, 1600, 3000, 3000]
    assert max(caps) == 3000
    assert all(d[0] == 0 for d in rng.draws)  # full jitter: from 0
    assert all(0 <= d[2] <= 3000 for d in rng.draws)
    assert max(d[2] for d in rng.draws) > 1600  # some draws do use the higher caps


@pytest.mark.parametrize("seed", range(5))
def test_the_waits_between_tries_stay_within_the_cap(seed: int) -> None:
    """Measured from the outside: the earliest time a retry happens is never more than max_backoff_ms
    after the previous try."""
    prepare = Prepare(30)
    hold, _, _ = make_hold(prepare, max_attempts=0, initial=7, maximum=40, rng=random.Random(seed))
    hold.admit(recs(P0, 0), 0)
    tries = [0]
    for now in range(1, 3000):
        hold.admit([], now)
        if len(prepare.calls) > len(tries):
            tries.append(now)
        if len(prepare.calls) > 30:
            break
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert len(gaps) == 30
    assert max(gaps) <= 40


# -- a non-transient failure ---------------------------------------------------------------------------

def test_a_fatal_error_from_prepare_propagates_and_keeps_the_records_held() -> None:
    prepare = Prepare(1, FatalPipelineError("the schema registry at http://r:1 holds no subjects at all"))
    hold, flow, _ = make_hold(prepare)
    batch = recs(P0, 0, 1)
    with pytest.raises(FatalPipelineError, match="holds no subjects"):
        hold.admit(batch, 0)
    assert hold.active and hold.held == 2 and flow.held is True


def test_a_fatal_error_on_a_retry_keeps_every_held_record() -> None:
    errors: list[BaseException] = [TransientError("503", error_class="schema_registry_unavailable"),
                                   FatalPipelineError("empty registry")]

    def prepare(records: Sequence[Record]) -> None:
        raise errors.pop(0)

    flow = make_flow()
    rng = RecordingRandom()
    hold = DecodeHold("p", prepare, RetrySettings(max_attempts=10, initial_backoff_ms=100, max_backoff_ms=100),
                      flow, rng=rng)
    assert hold.admit(recs(P0, 0), 0) == []
    with pytest.raises(FatalPipelineError):
        hold.admit(recs(P1, 0), rng.last_backoff_ms)
    assert hold.held == 2 and hold.active and flow.held is True


# -- Flow.regulate while held -----------------------------------------------------------------------------

class Listener:
    def on_assign(self, partitions: list[Partition]) -> dict[Partition, int] | None:
        return None

    def on_revoke(self, partitions: list[Partition]) -> None:
        pass

    def on_lost(self, partitions: list[Partition]) -> None:
        pass


def memory_source(partitions: int = 2, per_partition: int = 3) -> tuple[MemorySource, MemoryLog]:
    log = MemoryLog.with_topic("t", partitions)
    for p in range(partitions):
        for i in range(per_partition):
            log.append(Partition("t", p), b"k", b"v%d" % i)
    source = MemorySource(log, Listener(), ["t"])
    return source, log


def test_regulate_pauses_while_held_even_with_nothing_in_flight_and_resumes_after() -> None:
    source, _ = memory_source(per_partition=0)
    source.assign([P0, P1])
    assert source.poll(100, 0) == []  # the assignment takes effect inside poll
    flow = make_flow()
    assert flow.records == 0 and flow.bytes == 0
    flow.held = True
    assert flow.regulate(source) is Signal.PAUSED
    assert flow.paused is True
    source.log.append(P0, b"k", b"late")
    assert source.poll(100, 0) == []  # paused: nothing delivered
    for _ in range(3):
        assert flow.regulate(source) is Signal.NONE  # nothing in flight, still no resume
        assert source.poll(100, 0) == []
    flow.held = False
    assert flow.regulate(source) is Signal.RESUMED
    assert flow.paused is False
    assert [r.value for r in source.poll(100, 0)] == [b"late"]


def test_a_partition_assigned_while_held_is_paused_on_the_next_regulate() -> None:
    source, _ = memory_source(partitions=3, per_partition=0)
    source.assign([P0])
    source.poll(100, 0)
    flow = make_flow()
    flow.held = True
    flow.regulate(source)
    source.assign([P1])
    source.poll(100, 0)  # P1 is assigned here
    source.log.append(P1, b"k", b"x")
    source.log.append(P0, b"k", b"y")
    assert flow.regulate(source) is Signal.NONE
    assert source.poll(100, 0) == []  # P1 paused too


def test_regulate_does_not_resume_after_backpressure_clears_while_held() -> None:
    source, _ = memory_source(per_partition=0)
    source.assign([P0])
    source.poll(100, 0)
    flow = make_flow(max_records=10)
    flow.add(0, 10, 100)
    assert flow.regulate(source) is Signal.PAUSED
    flow.held = True
    flow.remove(0, 10, 100)
    assert flow.regulate(source) is Signal.NONE
    assert flow.paused is True
    flow.held = False
    assert flow.regulate(source) is Signal.RESUMED


def test_regulate_without_held_or_backpressure_does_nothing() -> None:
    source, _ = memory_source(per_partition=1)
    source.assign([P0])
    flow = make_flow()
    assert flow.regulate(source) is Signal.NONE
    assert len(source.poll(100, 0)) == 1


def test_the_held_pause_counts_as_paused_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = {"s": 100.0}
    monkeypatch.setattr(flow_module.time, "monotonic", lambda: now["s"])
    source, _ = memory_source(per_partition=0)
    source.assign([P0])
    source.poll(100, 0)
    stats = PipelineStats()
    flow = Flow("p", 1, 1000, 1 << 20, stats=stats, metrics=Metrics().pipeline("p"))
    flow.held = True
    flow.regulate(source)
    now["s"] += 7.5
    flow.regulate(source)
    flow.held = False
    flow.regulate(source)
    assert stats.paused_s == pytest.approx(7.5)


def test_a_hold_drives_the_flow_pause_end_to_end() -> None:
    """DecodeHold sets Flow.held; Flow.regulate then keeps the source paused until the hold releases."""
    source, _ = memory_source(partitions=2, per_partition=2)
    source.assign([P0, P1])
    prepare = Prepare(1)
    flow = make_flow()
    hold, _, rng = make_hold(prepare, flow=flow)
    polled = source.poll(100, 0)
    assert len(polled) == 4
    assert flow.regulate(source) is Signal.NONE
    assert hold.admit(polled, 0) == []
    assert flow.regulate(source) is Signal.PAUSED
    source.log.append(P0, b"k", b"new")
    assert source.poll(100, 0) == []
    released = hold.admit([], rng.last_backoff_ms)
    assert released == polled
    assert flow.regulate(source) is Signal.RESUMED
    assert [r.value for r in source.poll(100, 0)] == [b"new"]
