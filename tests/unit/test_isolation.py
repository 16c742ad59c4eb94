"""Poison-row isolation (ingest/core/isolation.py) and the batch writer around it (ingest/runner/writer.py).

The fake sink is "transactional": a piece containing a poison row raises
PermanentError and writes nothing; otherwise the whole piece is written.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.config import RetrySettings
from ingest.core.collapse import CollapseRule
from ingest.core.isolation import write_isolating
from ingest.dlq.base import DlqEntry
from ingest.errors import FatalPipelineError, PermanentError, TransientError
from ingest.types import Failure, Item, Partition, Record
from ingest.runner.writer import BatchWriter


class FakeSink:
    """Counts write calls; fails a piece with PermanentError if it holds a poison row."""

    def __init__(self, poison: set[int] | frozenset[int] = frozenset(), *, fail_together: Sequence[set[int]] = ()) -> None:
        self.poison = set(poison)
        self.fail_together = [set(s) for s in fail_together]
        self.calls = 0
        self.pieces: list[list[int]] = []  # written pieces, in write order
        self.failed_pieces: list[list[int]] = []

    def __call__(self, piece: Sequence[int]) -> None:
        self.calls += 1
        rows = list(piece)
        bad = [r for r in rows if r in self.poison]
        combo = any(group <= set(rows) for group in self.fail_together)
        if bad or combo:
            self.failed_pieces.append(rows)
            raise PermanentError(f"row {bad[0] if bad else rows} rejected", sqlstate="23514",
                                 error_class="integrity_constraint_violation")
        self.pieces.append(rows)

    @property
    def written(self) -> list[int]:
        return [r for piece in self.pieces for r in piece]


def bound(n: int, k: int = 1) -> int:
    """Write calls allowed for k poison rows in a batch of n: 1 + 2*k*ceil(log2 n)."""
    return 1 + 2 * k * math.ceil(math.log2(n)) if n > 1 else 1


# --------------------------------------------------------------------------- cost


@pytest.mark.parametrize("position", [0, 1, 511, 512, 700, 1023])
def test_one_poison_in_1024_costs_exactly_1_plus_2_log2_n(position: int) -> None:
    n = 1024
    sink = FakeSink({position})
    poison = write_isolating(list(range(n)), sink)
    assert [row for row, _ in poison] == [position]
    assert isinstance(poison[0][1], PermanentError)
    assert poison[0][1].sqlstate == "23514"
    # 1 (whole batch) + 2 per level (both halves) for log2(1024) = 10 levels = 21, not 1024.
    assert sink.calls == 1 + 2 * math.ceil(math.log2(n)) == 21
    assert sorted(sink.written) == [r for r in range(n) if r != position]
    # Good pieces are written in their own transactions: one per level, halving in size.
    assert len(sink.pieces) == 10
    assert sorted(len(p) for p in sink.pieces) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@pytest.mark.parametrize("n", [2, 3, 5, 7, 100, 333, 1000, 1025, 4999, 5000])
def test_one_poison_any_batch_size_within_bound(n: int) -> None:
    for position in {0, n // 3, n // 2, n - 1}:
        sink = FakeSink({position})
        poison = write_isolating(list(range(n)), sink)
        assert [row for row, _ in poison] == [position]
        assert sink.calls <= bound(n), (n, position, sink.calls)
        if n >= 16:
            assert sink.calls < n / 2


def test_clean_batch_is_one_call() -> None:
    sink = FakeSink()
    assert write_isolating(list(range(5000)), sink) == []
    assert sink.calls == 1
    assert sink.pieces == [list(range(5000))]


def test_empty_batch_makes_no_call() -> None:
    sink = FakeSink()
    assert write_isolating([], sink) == []
    assert sink.calls == 0


def test_single_poison_row_alone() -> None:
    sink = FakeSink({0})
    poison = write_isolating([0], sink)
    assert [r for r, _ in poison] == [0]
    assert sink.calls == 1
    assert sink.written == []


@pytest.mark.parametrize("k", [2, 5, 17, 64])
def test_k_poisons_all_found_nothing_written_twice(k: int) -> None:
    n = 1024
    poison_rows = set(list(range(3, n, n // k))[:k])
    assert len(poison_rows) == k
    sink = FakeSink(poison_rows)
    poison = write_isolating(list(range(n)), sink)
    assert {r for r, _ in poison} == poison_rows
    assert len(poison) == k  # each poison row reported once
    written = sink.written
    assert len(written) == len(set(written)), "a row was written twice"
    assert set(written) == set(range(n)) - poison_rows
    assert sink.calls <= bound(n, k)


def test_all_rows_poison_costs_2n_minus_1() -> None:
    n = 256
    sink = FakeSink(set(range(n)))
    poison = write_isolating(list(range(n)), sink)
    assert [r for r, _ in poison] == list(range(n))  # reported left to right
    assert sink.calls == 2 * n - 1  # the full binary tree: the worst case
    assert sink.written == []


def test_pieces_are_written_left_to_right() -> None:
    n = 1000
    poison_rows = {10, 250, 251, 600, 999}
    sink = FakeSink(poison_rows)
    poison = write_isolating(list(range(n)), sink)
    assert [r for r, _ in poison] == sorted(poison_rows)  # poison in row order too
    # The concatenation of written pieces is the good rows in their original order.
    assert sink.written == [r for r in range(n) if r not in poison_rows]
    firsts = [p[0] for p in sink.pieces]
    assert firsts == sorted(firsts)
    for piece in sink.pieces:  # each piece is a contiguous run of the batch
        assert piece == list(range(piece[0], piece[0] + len(piece)))


def test_rows_failing_only_together_are_not_poison() -> None:
    """Two rows that fail in one statement but succeed alone are both written; nothing is poison."""
    sink = FakeSink(fail_together=[{5, 6}])
    poison = write_isolating(list(range(16)), sink)
    assert poison == []
    assert sorted(sink.written) == list(range(16))
    assert len(sink.written) == 16


def test_works_with_any_sequence_type() -> None:
    sink = FakeSink({7})
    poison = write_isolating(range(20), sink)  # a range, as the writer passes
    assert [r for r, _ in poison] == [7]
    assert sorted(sink.written) == [r for r in range(20) if r != 7]


# --------------------------------------------------------------------------- non-permanent errors


@pytest.mark.parametrize("exc", [TransientError("connection lost", error_class="connection"),
                                 RuntimeError("bug"), KeyboardInterrupt()],
                         ids=lambda e: type(e).__name__)
def test_non_permanent_errors_propagate(exc: BaseException) -> None:
    calls = []

    def write(piece: Sequence[int]) -> None:
        calls.append(list(piece))
        raise exc

    with pytest.raises(type(exc)):
        write_isolating(list(range(100)), write)
    assert len(calls) == 1  # no splitting on a non-permanent error


def test_transient_error_while_splitting_propagates_without_classifying() -> None:
    """A transient error met during the split stops isolation: nothing is reported poison."""
    state = {"calls": 0}

    def write(piece: Sequence[int]) -> None:
        state["calls"] += 1
        if 3 in piece:
            raise PermanentError("bad")
        if state["calls"] == 3:
            raise TransientError("server went away")

    with pytest.raises(TransientError):
        write_isolating(list(range(8)), write)


# --------------------------------------------------------------------------- property


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=600).flatmap(
    lambda n: st.tuples(st.just(n), st.sets(st.integers(min_value=0, max_value=max(0, n - 1)), max_size=n)
                        if n else st.just(set()))))
def test_property_poison_is_exactly_the_poison_rows(case: tuple[int, set[int]]) -> None:
    n, poison_rows = case
    sink = FakeSink(poison_rows)
    poison = write_isolating(list(range(n)), sink)
    found = [r for r, _ in poison]
    assert set(found) == poison_rows
    assert len(found) == len(poison_rows)
    assert found == sorted(found)
    counts = Counter(sink.written)
    assert set(counts) == set(range(n)) - poison_rows
    assert all(c == 1 for c in counts.values()), "a good row was written more than once"
    assert sink.written == [r for r in range(n) if r not in poison_rows]
    if n:
        assert sink.calls <= min(2 * n - 1, bound(n, max(1, len(poison_rows))))


# --------------------------------------------------------------------------- the batch writer

FAST_RETRY = RetrySettings(max_attempts=5, initial_backoff_ms=1, max_backoff_ms=2)
TP = Partition("orders", 3)


def item(offset: int, key: int, *, bad: bool = False, failure: Failure | None = None) -> Item:
    rec = Record("orders", 3, offset, str(key).encode(), f'{{"id":{key}}}'.encode(), 1_700_000_000_000 + offset)
    if failure is not None:
        return Item(rec, None, failure, 1, 10)
    return Item(rec, (key, "bad" if bad else "ok", offset), None, 1, 10)


class FakeDlq:
    def __init__(self, fail_times: int = 0, forever: bool = False) -> None:
        self.fail_times = fail_times
        self.forever = forever
        self.calls = 0
        self.entries: list[DlqEntry] = []

    def put(self, entries: Sequence[DlqEntry]) -> None:
        self.calls += 1
        if self.forever or self.calls <= self.fail_times:
            raise TransientError("DLQ down", error_class="dlq_unavailable")
        self.entries.extend(entries)

    def close(self) -> None:
        pass


class RowSink:
    """A sink write over rows: rows whose second field is 'bad' are poison; counts calls."""

    def __init__(self, transient_every: int = 0) -> None:
        self.calls = 0
        self.written: list[tuple] = []
        self.transient_every = transient_every
        self.transients = 0

    def __call__(self, rows: Sequence[tuple]) -> None:
        self.calls += 1
        if self.transient_every and self.calls % self.transient_every == 0:
            self.transients += 1
            raise TransientError("connection reset", error_class="connection")
        if any(r[1] == "bad" for r in rows):
            raise PermanentError("check violated", sqlstate="23514", error_class="integrity_constraint_violation")
        self.written.extend(rows)


def make_writer(sink: RowSink, dlq: FakeDlq, *, key_index=(0,), retry: RetrySettings = FAST_RETRY) -> BatchWriter:
    return BatchWriter(pipeline="p", write=sink, dlq=dlq, retry=retry,
                       collapse_rule=CollapseRule(tuple(key_index) if key_index else None), abort=threading.Event())


def test_writer_isolates_and_dead_letters_write_failures_with_provenance() -> None:
    items = [item(o, o, bad=o in (100, 700)) for o in range(1024)]
    decode_fail = Failure("decode", "invalid_json", "not json")
    items[5] = item(5, 5, failure=decode_fail)
    sink, dlq = RowSink(), FakeDlq()
    c = make_writer(sink, dlq).handle(0, items, "size")
    assert c.error is None
    assert c.rows_written == 1024 - 3
    assert c.write_calls == sink.calls <= bound(1023, 2)
    assert sorted(r[0] for r in sink.written) == sorted(set(range(1024)) - {5, 100, 700})
    got = {e.record.offset: e.failure for e in dlq.entries}
    assert set(got) == {5, 100, 700}
    assert got[5] == decode_fail
    for off in (100, 700):
        assert got[off].stage == "write"
        assert got[off].sqlstate == "23514"
        assert got[off].error_class == "integrity_constraint_violation"
    assert all(e.pipeline == "p" for e in dlq.entries)
    assert c.dead_lettered == Counter({("write", "integrity_constraint_violation"): 2, ("decode", "invalid_json"): 1})
    assert sorted(c.done[(TP, 1)]) == list(range(1024))  # every offset handled


def test_a_prepared_batch_is_written_like_its_items_and_stays_as_it_was_made() -> None:
    """What the lane pool hands a lane (BatchWriter.prepare, on the pipeline thread) writes, dead-letters
    and settles exactly what the items themselves do; the prepared batch is not changed by its write."""
    items = [item(o, o % 300, bad=o in (890, 899)) for o in range(900)]  # the latest of their keys: written
    items[3] = item(3, 3, failure=Failure("decode", "invalid_json", "not json"))
    outcomes = []
    for prepare in (False, True):
        sink, dlq = RowSink(), FakeDlq()
        writer = make_writer(sink, dlq)
        batch = writer.prepare(items) if prepare else items
        failures_before = list(batch.failures) if prepare else None
        c = writer.handle(0, batch, "size")
        assert c.error is None
        if prepare:
            assert batch.failures == failures_before and len(batch.failures) == 1  # poison found by the write not added
            assert c.done is batch.done and c.size_bytes == batch.size_bytes
        outcomes.append((sorted(sink.written), sorted((e.record.offset, e.failure) for e in dlq.entries),
                         c.rows_written, c.dead_lettered, {k: sorted(v) for k, v in c.done.items()},
                         c.size_bytes, c.min_timestamp_ms, c.records))
    assert outcomes[0] == outcomes[1]
    assert [offset for offset, _ in outcomes[0][1]] == [3, 890, 899] and outcomes[0][4] == {(TP, 1): list(range(900))}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["orders", "refunds"]), st.integers(0, 2), st.integers(1, 2)),
                min_size=1, max_size=40))
def test_a_prepared_batch_settles_every_offset_under_its_partition_and_epoch(positions) -> None:
    """``done`` of a prepared batch: each item's offset under (its partition, its epoch), in batch order,
    however the batch interleaves topics, partitions and assignment epochs."""
    items = [Item(Record(topic, partition, offset, b"k", b"{}", None), (offset,), None, epoch, 10)
             for offset, (topic, partition, epoch) in enumerate(positions)]
    expected: dict[tuple[Partition, int], list[int]] = {}
    for it in items:
        expected.setdefault((it.record.tp, it.epoch), []).append(it.record.offset)
    assert make_writer(RowSink(), FakeDlq()).prepare(items).done == expected


def test_writer_retries_transient_errors_during_isolation_and_dead_letters_only_poison() -> None:
    items = [item(o, o, bad=o == 33) for o in range(256)]
    sink, dlq = RowSink(transient_every=3), FakeDlq()
    c = make_writer(sink, dlq).handle(0, items, "size")
    assert c.error is None, c.error
    assert sink.transients > 0
    assert c.retries >= sink.transients
    assert [e.record.offset for e in dlq.entries] == [33]
    assert sorted(r[0] for r in sink.written) == [o for o in range(256) if o != 33]
    assert len(sink.written) == 255  # a transient failure wrote nothing, no row twice


def test_writer_dedupes_by_key_and_falls_back_to_the_previous_record_when_the_winner_is_poison() -> None:
    items = [item(0, 1), item(1, 2), item(2, 1, bad=True), item(3, 3)]
    sink, dlq = RowSink(), FakeDlq()
    c = make_writer(sink, dlq).handle(0, items, "size")
    assert c.error is None
    # key 1's latest record is poison: it goes to the DLQ and key 1's previous (good) record is written
    assert sorted(sink.written) == [(1, "ok", 0), (2, "ok", 1), (3, "ok", 3)]
    assert [e.record.offset for e in dlq.entries] == [2]
    assert sorted(c.done[(TP, 1)]) == [0, 1, 2, 3]


def test_writer_counts_nothing_done_until_the_dlq_write_succeeded() -> None:
    items = [item(o, o, bad=o == 3) for o in range(10)]
    sink, dlq = RowSink(), FakeDlq(fail_times=2)
    c = make_writer(sink, dlq).handle(0, items, "size")
    assert c.error is None
    assert dlq.calls == 3
    assert [e.record.offset for e in dlq.entries] == [3]
    assert sorted(c.done[(TP, 1)]) == list(range(10))


def test_writer_dlq_unreachable_gives_up_with_no_offsets_done() -> None:
    items = [item(o, o, bad=o == 3) for o in range(10)]
    sink, dlq = RowSink(), FakeDlq(forever=True)
    c = make_writer(sink, dlq, retry=RetrySettings(max_attempts=3, initial_backoff_ms=1, max_backoff_ms=1)).handle(
        0, items, "size")
    assert isinstance(c.error, FatalPipelineError)
    assert c.done == {}  # nothing may be committed: the poison record is not durable anywhere
    assert dlq.calls == 3
    assert dlq.entries == []


def test_writer_sink_down_never_dead_letters() -> None:
    def down(rows: Sequence[tuple]) -> None:
        raise TransientError("connection refused", error_class="connection")

    dlq = FakeDlq()
    w = BatchWriter(pipeline="p", write=down, dlq=dlq,
                    retry=RetrySettings(max_attempts=4, initial_backoff_ms=1, max_backoff_ms=1),
                    collapse_rule=CollapseRule((0,)), abort=threading.Event())
    c = w.handle(0, [item(o, o) for o in range(50)], "size")
    assert isinstance(c.error, FatalPipelineError)
    assert c.done == {}
    assert dlq.calls == 0 and dlq.entries == []
    assert c.retries == 3


def test_writer_abort_cuts_retry_forever_short() -> None:
    abort = threading.Event()
    attempts = []

    def down(rows: Sequence[tuple]) -> None:
        attempts.append(1)
        if len(attempts) == 3:
            abort.set()
        raise TransientError("connection refused", error_class="connection")

    w = BatchWriter(pipeline="p", write=down, dlq=FakeDlq(),
                    retry=RetrySettings(max_attempts=0, initial_backoff_ms=1, max_backoff_ms=1),
                    collapse_rule=CollapseRule((0,)), abort=abort)
    c = w.handle(0, [item(0, 0)], "size")
    assert isinstance(c.error, FatalPipelineError)
    assert "aborted" in str(c.error)
    assert c.done == {}
    assert len(attempts) == 3


# --------------------------------------------------------------------------- fallback within a key
def test_groups_fall_back_to_the_next_candidate_when_the_first_is_poison() -> None:
    from ingest.core.isolation import write_groups_isolating

    bad = {"k1-new", "k3-new", "k3-mid"}
    written_rows: list[str] = []

    def write(piece):
        if any(c in bad for c in piece):
            raise PermanentError("check violation", sqlstate="23514")
        written_rows.extend(piece)

    groups = [["k1-new", "k1-old"], ["k2-new"], ["k3-new", "k3-mid", "k3-old"], ["k4-new", "k4-old"]]
    written, poison = write_groups_isolating(groups, write)
    assert sorted(written) == ["k1-old", "k2-new", "k3-old", "k4-new"]
    assert sorted(p for p, _ in poison) == ["k1-new", "k3-mid", "k3-new"]
    assert sorted(written_rows) == sorted(written)  # each written exactly once, superseded ones never


def test_groups_all_poison_leaves_the_group_unwritten() -> None:
    from ingest.core.isolation import write_groups_isolating

    def write(piece):
        if any(c.startswith("x") for c in piece):
            raise PermanentError("bad")

    written, poison = write_groups_isolating([["x2", "x1"], ["ok"]], write)
    assert written == ["ok"] and [p for p, _ in poison] == ["x2", "x1"]


def test_writer_on_conflict_nothing_writes_the_first_record_of_a_key() -> None:
    items = [item(0, 1), item(1, 1), item(2, 1)]
    sink, dlq = RowSink(), FakeDlq()
    w = BatchWriter(pipeline="p", write=sink, dlq=dlq, retry=RetrySettings(max_attempts=2),
                    collapse_rule=CollapseRule((0,), "first"), abort=threading.Event())
    c = w.handle(0, items, "size")
    assert c.error is None and sink.written == [(1, "ok", 0)]
