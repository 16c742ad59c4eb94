"""The columnar tier's plan (ingest.core.mapping.columnar) against the row mapper, which decides.

Differential: for batches of hostile JSON records, every record the plan takes must be one the
row mapper maps (no poison slips through), every record it rejects is handed back, and the rows
it keeps -- after the conversions the database applies (a float's shortest digits as numeric,
epoch milliseconds added to the epoch) -- are exactly the rows the row path writes once
:func:`ingest.core.collapse.collapse` picked the last record of each key.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ingest.config import RetrySettings
from ingest.core.collapse import collapse
from ingest.core.mapping import Mapper
from ingest.core.mapping.columnar import DECODE_PIECE, UNROUTED, _framed, _skippable
from ingest.core.routing import key_bytes
from ingest.errors import InvalidRecord, PermanentError, TransientError
from ingest.config import PipelineSettings
from ingest.runner.columnar import ColumnarTier, columnar_tier
from ingest.sinks.base import dedup_token
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.types import Item, Record
from ingest.runner.writer import BatchWriter

COLUMNS = {
    "event_id": {"type": "bigint", "source": "$.id", "required": True},
    "small": {"type": "smallint", "source": "$.s"},
    "kind": {"type": "text", "source": "$.kind"},
    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
    "local": {"type": "timestamp", "source": "$.local"},
    "part": {"type": "integer", "source": "@partition"},
    "plain": {"type": "numeric", "source": "$.plain"},
    "ratio": {"type": "double precision", "source": "$.ratio"},
    "flag": {"type": "boolean", "source": "$.flag"},
    "dflt": {"type": "integer", "source": "$.dflt", "default": 7},
    "since": {"type": "timestamptz", "source": "$.since", "default": "2020-01-01T00:00:00+02:00"},
    "blob": {"type": "jsonb", "source": "$.blob"},
}


def _settings() -> PostgresSinkSettings:
    return PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", conflict_key=["event_id"], columns=COLUMNS)


CFG = _settings()
MAPPER = Mapper(CFG.columns)
RULE = CFG.collapse_rule()
PLAN = MAPPER.columnar_plan(RULE.key_index)
EPOCH_AWARE = datetime(1970, 1, 1, tzinfo=timezone.utc)
EPOCH_NAIVE = datetime(1970, 1, 1)

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 32767, 32768, -32769, 2**42 - 1, 2**42, 2**63 - 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.1, 0.285, 1e21, 1e-7, -0.0, 5e-324]),
    st.text(max_size=8), st.sampled_from(["", "a\x00b", "quote\"d", "comma,", "line\nbreak", "\\.", "ünï"]),
    st.lists(st.integers(), max_size=2),
)
#: ISO 8601 / RFC 3339 text and near misses: zones, fractions of every length, the forms Python reads
#: that PostgreSQL would read otherwise (or not at all), out-of-range and invalid dates
iso_texts = st.one_of(
    st.datetimes(min_value=datetime(1600, 1, 1), max_value=datetime(2300, 1, 1),
                 timezones=st.one_of(st.none(), st.just(timezone.utc),
                                     st.timedeltas(min_value=timedelta(hours=-23, minutes=-59),
                                                   max_value=timedelta(hours=23, minutes=59)).map(timezone)))
    .flatmap(lambda d: st.sampled_from([d.isoformat(), d.isoformat(sep=" "), d.isoformat(timespec="milliseconds"),
                                        d.isoformat().replace("+00:00", "Z")])),
    st.sampled_from(["2025-11-30T00:00:00Z", "2025-11-30T00:00:00", "2025-11-30 00:00:00.1234567+05:30",
                     "2025-11-30", "20251130T101112", "2025-W48-7", "2025-11-30T24:00:00", "2025-02-30T00:00:00",
                     "2025-11-30T00:00:00.5+05:30:15.5", "0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00",
                     "1684-01-01T00:00:00Z", "2256-01-01T00:00:00Z", "2025-11-30T00:00:00" + "0" * 60, "yesterday",
                     "2025-11-30X01:02:03", "2025-11-30T01:02:03,5Z"]),
)
words = st.sampled_from(["true", "FALSE", "t", "F", "1", "0", "yes", "tru", "1.0"])
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=2), inner, max_size=3), max_leaves=8)
documents = st.fixed_dictionaries(
    {"id": st.one_of(st.integers(min_value=0, max_value=5), scalars)},
    optional={"s": scalars, "kind": scalars, "amount": scalars, "ts": scalars | iso_texts,
              "local": scalars | iso_texts, "extra": scalars | st.dictionaries(st.text(max_size=3), scalars, max_size=2),
              "plain": scalars, "ratio": scalars,
              "flag": scalars | words, "dflt": scalars, "since": scalars | iso_texts, "blob": json_values},
)


@st.composite
def values(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["doc"] * 8 + ["raw", "spaced"]))
    if kind == "raw":
        return draw(st.sampled_from([b"", b"   ", b"{", b"[1]", b"null", b'{"id":1}{"id":2}',
                                     b'{"id": 1e400}', b'{"id": 1, "id": 2}', b'\xef\xbb\xbf{"id":1}',
                                     b'{"id":1,"kind":"\xff"}', b'{"id":01}', b'{"id":1,}',
                                     # keys no column reads, holding what orjson refuses and msgspec skips
                                     b'{"id":1,"zz":1e400}', b'{"id":1,"zz":"\xff"}', b'{"id":1,"\xed\xa0\x80":0}',
                                     b'{"id":1,"zz":[' + b"9" * 400 + b']}', b'{"id":1,"zz":1' + b"0" * 300 + b'e10}',
                                     b'{"id":1,"zz":1e300}', b'{"id":1,"zz":{"a":[1,{"b":null}],"c":"\\u00e9"}}',
                                     b'{"id":1,"zz":"\\ud800"}', b'{"id":1,"zz":[1,]}', b'{"id":1,"zz":' + b"[" * 1030
                                     + b"]" * 1030 + b"}", b'{"id":1,"zz":"\xc3\xa9","s":2}']))
    text = json.dumps(draw(documents)).encode()  # stdlib: integers beyond 64 bits too
    return text.replace(b":", b" : ") if kind == "spaced" else text


def _records(raw: list[bytes | None], mixed: bool = False) -> list[Record]:
    """Records of topic ``t``, or with ``mixed`` of ``t`` and ``u``: the plan reads the ``@stream``
    column per partition of a one-topic batch and per record otherwise."""
    return [Record("u" if mixed and i % 4 == 1 else "t", i % 3, i, b"k", value, 1_700_000_000_000 + i)
            for i, value in enumerate(raw)]


def _row_path(records: list[Record]) -> tuple[dict, set[int]]:
    """The row path: each record mapped, then the last record of each key wins. Returns the rows by
    key and the offsets of the poison records."""
    items, poison = [], set()
    for rec in records:
        try:
            row, _ = MAPPER.map(rec)
            items.append(Item(rec, row, None, 0, 1))
        except InvalidRecord:
            poison.add(rec.offset)
    _, groups = collapse(items, RULE)
    return {group[0].row[0]: group[0].row for group in groups}, poison


def _as_database_would(row: dict) -> tuple:
    """A staged columnar row converted as the upsert converts it."""
    converted = dict(row)
    for name in ("amount", "plain"):
        value = row[name]
        if value is not None:
            converted[name] = Decimal(value if type(value) is str else orjson.dumps(value).decode())
    for name, epoch in (("ts", EPOCH_AWARE), ("local", EPOCH_NAIVE), ("since", EPOCH_AWARE)):
        if row[name] is not None:
            converted[name] = epoch + timedelta(microseconds=row[name])
    return tuple(converted.values())


#: how many batches of the differential test were compared whole, or left to the row path
COMPARED = {"columnar": 0, "by rows": 0}
#: how many records the plan routed (not left to the row mapper) in the differential test
ROUTED = [0]


def test_the_bench_shape_has_a_plan_and_other_shapes_do_not():
    assert PLAN is not None
    assert [c.kind for c in PLAN.columns] == ["int", "int", "text", "numeric", "timestamp", "timestamp", "int",
                                               "numeric", "float", "bool", "int", "timestamp", "json",
                                               "int", "int"]  # the sink's hidden source columns
    assert [c.as_text for c in PLAN.columns if c.kind == "numeric"] == [False, True]  # plain numeric: its scale
    assert [c.default for c in PLAN.columns][-5:-3] == [7, (datetime(2019, 12, 31, 22) - EPOCH_NAIVE) // timedelta(
        microseconds=1)]
    for column in ({"type": "bigint", "source": "$.x[0]"}, {"type": "date", "source": "$.x"},
                   {"type": "uuid", "source": "$.x"}, {"type": "real", "source": "$.x"},
                   {"type": "timestamptz", "source": "$.x", "default": "1500-01-01T00:00:00Z"}):
        columns = PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", on_conflict="none",
                                       columns={"a": column}).columns
        assert Mapper(columns).columnar_plan(None) is None, column


@pytest.mark.xdist_group("columnar-differential")  # with the check below, on one worker (pytest-xdist --dist loadgroup)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(values(), min_size=1, max_size=25))
# lines that are not documents: an empty one beside two documents on one line, a document split
# over two lines beside two on one, a blank line
@example([b"", b'{"id":1}{"id":2}'])
@example([b'{"id":', b'1}{"id":2}'])
@example([b'{"id":1}', b"   ", b'{"id":3} {"id":4}'])
def test_the_plan_writes_what_the_row_path_writes(raw):
    records = _records(raw, mixed=len(raw) % 2 == 0)
    expected, poison = _row_path(records)
    # lanes > 1: every record the plan routes goes by the key the row path routes it by (but for
    # poison, which touches no row: the row path routes it by its Kafka key)
    for record, key in zip(records, PLAN.lane_keys(records), strict=True):
        if key is not UNROUTED and record.offset not in poison:
            assert key == key_bytes(MAPPER.map(record)[0][0]), record
            ROUTED[0] += 1
    built = PLAN.build(records)
    assert built is not None  # no tombstone, no newline: the plan never declines the whole batch
    rejected = set(built.rejected)
    taken = [r for r in records if r.offset not in rejected]
    assert poison <= rejected, "a poison record was taken by the columnar plan"
    if not rejected <= poison:  # a rejected record maps after all: the tier writes this batch by rows
        COMPARED["by rows"] += 1
        return
    COMPARED["columnar"] += 1
    got = {row["event_id"]: _as_database_would(row) for row in built.table.to_pylist()}
    assert got == expected
    assert built.table.num_rows == len(expected) <= len(taken)


@pytest.mark.xdist_group("columnar-differential")
def test_the_differential_test_compared_columnar_batches():
    """Runs after it (file order, the same worker): the comparison must not have been skipped every time."""
    assert COMPARED["columnar"] >= 20, COMPARED
    assert ROUTED[0] >= 40, ROUTED


def test_a_batch_of_clean_records_is_taken_whole_and_collapsed_to_the_last_of_each_key():
    docs = [{"id": i % 3, "s": i, "kind": f"k{i}", "amount": i / 10, "ts": i, "local": i} for i in range(9)]
    built = PLAN.build(_records([orjson.dumps(d) for d in docs]))
    assert built is not None and built.rejected == []
    rows = built.table.to_pylist()
    assert [(r["event_id"], r["small"], r["_ingest_offset"]) for r in rows] == [(0, 6, 6), (1, 7, 7), (2, 8, 8)]


def test_poison_is_rejected_and_good_records_around_it_are_kept():
    raw = [b'{"id": 1, "s": 1}', b'{"id": 2, "s": 99999}', b"not json", b'{"id": 3, "kind": "a\\u0000b"}',
           b'{"s": 4}', b'{"id": 4, "amount": 0.1}']
    built = PLAN.build(_records(raw))
    assert built is not None
    assert built.rejected == [1, 2, 3, 4]
    assert [r["event_id"] for r in built.table.to_pylist()] == [1, 4]


def test_a_dirty_batch_rejects_exactly_its_poison_and_keeps_every_record_around_it():
    """A long batch (several of the decoder's pieces, DECODE_PIECE values each) with poison at the
    first and last value and on both sides of piece boundaries, of every kind: not framed (truncated),
    framed but not JSON, two documents in one value, a value of the wrong type. Exactly those are
    rejected and every other record's row is the row path's."""
    n = 3 * DECODE_PIECE + 7
    bad = {0: b'{"id": 5, "s": ', 1: b"{nope}", DECODE_PIECE - 1: b'{"id":1}{"id":2}',
           DECODE_PIECE: b'{"id": "five"}', 2 * DECODE_PIECE + 1: b"[1]", n - 1: b'{"id": 1e400}'}
    raw = [bad.get(i, orjson.dumps({"id": i % 50, "s": i % 100, "kind": f"k{i}", "ts": i})) for i in range(n)]
    records = _records(raw)
    expected, poison = _row_path(records)
    assert poison == set(bad)
    built = PLAN.build(records)
    assert built is not None
    assert built.rejected == sorted(bad)
    assert {row["event_id"]: _as_database_would(row) for row in built.table.to_pylist()} == expected


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=4).map(lambda b: b.replace(b"\n", b"")) |
                st.lists(st.sampled_from([b"{", b"}", b" ", b"x", b"{}", b"}{"]), max_size=4).map(b"".join),
                min_size=1, max_size=6))
def test_a_batch_is_framed_exactly_when_every_value_starts_with_a_brace_and_ends_with_one(raw):
    """The decoder's framing rule (``_framed``, one scan of the joined batch) against its definition,
    value by value, on values without newlines (the plan declines a batch that has one)."""
    expected = all(v[:1] == b"{" and v[-1:] == b"}" for v in raw)
    assert _framed(b"\n".join(raw), len(raw)) is expected


def _as_is(table):
    """The tier's ``encode`` in these tests: the plan's table itself (the real sinks' encodings are
    tested against their databases)."""
    return table


def _tier(map_record=MAPPER.map) -> ColumnarTier:
    return ColumnarTier("p", PLAN, encode=_as_is, write=lambda table: None, map_record=map_record)


def test_the_tier_hands_back_poison_with_its_failure_and_declines_a_batch_whose_rejects_map():
    items = [Item(r, None, None, 0, 1) for r in _records([b'{"id": 1}', b'{"id": "x"}'])]
    built = _tier().build(items)
    assert built is not None
    assert [(item.record.offset, failure.stage) for item, failure in built.poison] == [(1, "map")]
    # "7" is text for a bigint column: the plan rejects it, the row mapper coerces it to 7
    items = [Item(r, None, None, 0, 1) for r in _records([b'{"id": 1}', b'{"id": "7"}'])]
    assert _tier().build(items) is None


def test_the_tier_turns_itself_off_when_most_records_go_by_rows():
    tier = _tier()
    extra = [Item(r, None, None, 0, 1) for r in _records([b'{"id": "1"}'] * 100)]  # text: the row mapper's
    for _ in range(41):
        assert tier.build(extra) is None
    assert not tier.on
    clean = [Item(r, None, None, 0, 1) for r in _records([b'{"id": 1}'])]
    assert tier.build(clean) is None


def test_a_batch_the_sink_cannot_encode_is_written_by_rows_where_the_row_path_decides():
    """``encode`` runs when the batch is planned (the pipeline thread); a value it refuses sends the
    whole batch to the row path, nothing is written by columns and the rows are the row path's."""
    def refuse(table):
        raise PermanentError("value out of the column's range", error_class="conversion")

    tier = ColumnarTier("p", PLAN, encode=refuse, write=lambda payload: pytest.fail("written by columns"),
                        map_record=MAPPER.map)
    rows: list = []
    writer = BatchWriter(pipeline="p", write=rows.extend, dlq=_Dlq(), retry=RetrySettings(max_attempts=2),
                         collapse_rule=RULE, abort=threading.Event(), columnar=tier)
    prepared = writer.prepare(_unmapped([b'{"id": 1, "s": 1}', b'{"id": 2, "s": 2}']))
    assert prepared.columnar is None
    done = writer.handle(0, prepared, "size")
    assert done.error is None and done.columnar_records == 0
    assert sorted(row[0] for row in rows) == [1, 2]


@pytest.mark.parametrize("raw", [[None], [b'{"id": 1}\n'], [b'{"id": 1}', b'{"id":\n2}']])
def test_tombstones_and_newlines_decline_the_batch(raw):
    assert PLAN.build(_records(raw)) is None


class _Dlq:
    def __init__(self) -> None:
        self.entries: list = []

    def put(self, entries) -> None:
        self.entries.extend(entries)


def _writer(columnar_write, rows: list, dlq: _Dlq) -> BatchWriter:
    tier = ColumnarTier("p", PLAN, encode=_as_is, write=columnar_write, map_record=MAPPER.map)
    return BatchWriter(pipeline="p", write=rows.extend, dlq=dlq, retry=RetrySettings(max_attempts=2),
                       collapse_rule=RULE, abort=threading.Event(), columnar=tier)


def _unmapped(raw: list[bytes]) -> list[Item]:
    return [Item(r, None, None, 0, 1) for r in _records(raw)]


RAW = [b'{"id": 1, "s": 1}', b"not json", b'{"id": 1, "s": 2}', b'{"id": 2}']


def test_the_writer_plans_a_columnar_batch_and_writes_it_whole_with_its_poison_dead_lettered():
    tables, rows, dlq = [], [], _Dlq()
    writer = _writer(tables.append, rows, dlq)
    assert writer.maps_in_lane
    prepared = writer.prepare(_unmapped(RAW))
    assert prepared.columnar is not None and prepared.groups is None
    done = writer.handle(0, prepared, "size")
    assert done.error is None and done.columnar_records == 4 and done.rows_written == 2
    assert [t.to_pylist()[0]["small"] for t in tables] == [2] and rows == []
    assert [(e.record.offset, e.failure.stage) for e in dlq.entries] == [(1, "decode")]
    assert sorted(done.done[(("t", 0), 0)] + done.done[(("t", 1), 0)] + done.done[(("t", 2), 0)]) == [0, 1, 2, 3]


def test_a_columnar_write_that_raises_is_written_by_rows_instead():
    def broken(table) -> None:
        raise TransientError("connection reset", error_class="connection")

    rows, dlq = [], _Dlq()
    done = _writer(broken, rows, dlq).handle(0, _unmapped(RAW), "size")
    assert done.error is None and done.columnar_records == 0
    assert sorted((r[0], r[1]) for r in rows) == [(1, 2), (2, None)]
    assert [(e.record.offset, e.failure.stage) for e in dlq.entries] == [(1, "decode")]


def test_poison_goes_to_the_dlq_while_the_rows_are_written():
    """The two commits overlap: each side waits (bounded) to see the other one started."""
    dlq_started, write_started = threading.Event(), threading.Event()
    seen = {}

    class _SlowDlq(_Dlq):
        def put(self, entries) -> None:
            dlq_started.set()
            seen["write while the dlq put"] = write_started.wait(5)
            super().put(entries)

    def columnar_write(table) -> None:
        write_started.set()
        seen["dlq put while the write"] = dlq_started.wait(5)

    dlq = _SlowDlq()
    done = _writer(columnar_write, [], dlq).handle(0, _unmapped(RAW), "size")
    assert done.error is None and done.columnar_records == 4
    assert seen == {"write while the dlq put": True, "dlq put while the write": True}
    assert [(e.record.offset, e.failure.stage) for e in dlq.entries] == [(1, "decode")]


def test_a_dlq_that_keeps_failing_fails_the_columnar_batch():
    class _DownDlq(_Dlq):
        def put(self, entries) -> None:
            raise TransientError("dlq down", error_class="connection")

    done = _writer(lambda table: None, [], _DownDlq()).handle(0, _unmapped(RAW), "size")
    assert done.error is not None and not done.done  # nothing of the batch may be committed


def test_a_batch_the_tier_declines_is_mapped_by_rows_when_it_is_prepared():
    rows, dlq = [], _Dlq()
    writer = _writer(lambda table: pytest.fail("a declined batch reached the columnar write"), rows, dlq)
    prepared = writer.prepare(_unmapped([b'{"id": 1}', b'{"id": "7"}']))  # "7": coerced by the row mapper
    assert prepared.columnar is None
    assert [item.row[0] for item in prepared.items] == [1, 7]
    done = writer.handle(0, prepared, "size")
    assert done.error is None and sorted(r[0] for r in rows) == [1, 7] and dlq.entries == []


class _ColumnarSink:
    """What columnar_tier asks of a sink: to stage the plan's columns."""

    def __init__(self) -> None:
        self.staged = None

    def use_columnar(self, columns) -> None:
        self.staged = columns

    def encode_columns(self, table):
        raise AssertionError("not encoded here")

    def write_encoded(self, payload, token=None) -> None:
        raise AssertionError("not written here")


def _pipeline(key_column: str = "event_id", **overrides) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "p", "topics": ["t"], **overrides,
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": [key_column],
                 "columns": COLUMNS},
    })


@pytest.mark.parametrize(("overrides", "on", "warned"), [
    ({}, True, False),  # unset: on wherever it fits
    ({"columnar": True}, True, False),
    ({"columnar": False}, False, False),
    ({"lanes": 2}, True, False),  # lanes route by the plan's lane keys (issue #38)
    ({"lanes": 2, "columnar": True}, True, False),
    ({"lanes": 2, "key_column": "ts"}, False, False),  # unset and cannot: by rows, quietly
    ({"lanes": 2, "key_column": "ts", "columnar": True}, False, True),  # asked for and cannot: says why
])
def test_a_pipeline_has_the_tier_by_default_wherever_it_fits(overrides, on, warned, caplog):
    sink = _ColumnarSink()
    with caplog.at_level(logging.DEBUG, logger="ingest.runner.columnar"):
        tier = columnar_tier(_pipeline(**overrides), sink, columnar_capable=True, exactly_once=False,
                             mapper=lambda: Mapper(CFG.columns))
    assert (tier is not None) is on and (sink.staged is not None) is on
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert bool(warnings) is warned
    why = "lanes: 2 route by the mapped row's key: the key column 'ts' is routed by its value"
    if warned:
        assert why in warnings[0].getMessage()
    elif not on and overrides.get("columnar") is None:
        assert any(f"write tier: rows ({why}" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    if on:
        assert any("write tier: columnar" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


@pytest.mark.parametrize(("column", "version", "key", "why"), [
    ({"type": "text"}, None, None, None),
    ({"type": "numeric(12,2)"}, None, None, None),
    ({"type": "timestamptz"}, None, None, None),
    ({"type": "numeric"}, None, None, None),
    ({"type": "boolean"}, None, None, None),
    ({"type": "double precision"}, None, None, None),
    ({"type": "timestamp"}, None, None, None),
    ({"type": "bigint", "default": 5}, None, None, None),
    ({"type": "timestamptz", "default": "2025-11-30T00:00:00Z"}, None, None, None),
    ({"type": "jsonb"}, None, None, None),
    ({"type": "json", "default": "[1]"}, None, None, None),
    ({"type": "uuid"}, None, None, "column 'a' is uuid"),
    ({"type": "real"}, None, None, "column 'a' is real: the tier stages integer, text, numeric, timestamp"),
    ({"type": "timestamptz", "default": "1500-01-01T00:00:00Z"}, None, None,
     "column 'a' has a default the tier cannot stage"),
    ({"type": "bigint", "source": "$.x.y"}, None, None, None),  # a path of keys (issue #38)
    ({"type": "bigint", "source": "$.x[0]"}, None, None, "column 'a' reads '$.x[0]' (the tier reads one top-level key"),
    ({"type": "text", "source": "@key"}, None, None, "column 'a' reads '@key', which the tier does not stage"),
    ({"type": "timestamptz"}, "a", None, None),
    ({"type": "numeric(12,2)"}, "a", None, "the version column 'a' is numeric(12,2), not an integer or timestamp"),
    ({"type": "text"}, None, "$.x.y", None),
    ({"type": "text"}, None, "$.x[1]", "the pipeline key '$.x[1]' is not one top-level key"),
])
def test_the_tier_names_the_first_column_it_cannot_take(column, version, key, why):
    sink = {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["id"],
            "columns": {"id": {"type": "bigint", "required": True}, "a": column}}
    if version:
        sink["version_column"] = version
    p = PipelineSettings.model_validate({"name": "p", "topics": ["t"], "sink": sink, **({"key": key} if key else {})})
    rule = p.collapse_rule()
    mapper = Mapper(p.sink.columns, p.key)
    refusal = mapper.columnar_refusal(rule.key_index, rule.version_index)
    assert (refusal is None) is (mapper.columnar_plan(rule.key_index, rule.version_index) is not None)
    if why is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.startswith(why), refusal


def test_a_sink_without_the_capability_writes_by_rows():
    assert columnar_tier(_pipeline(), _ColumnarSink(), columnar_capable=False, exactly_once=False,
                         mapper=lambda: Mapper(CFG.columns)) is None


@pytest.mark.parametrize(("lanes", "keyed", "on"), [(1, True, True), (1, False, True), (3, False, True),
                                                    (2, True, False)])
def test_exactly_once_has_the_tier_where_a_records_lane_does_not_depend_on_the_tier(lanes, keyed, on, caplog):
    """Issue #38 item 1: one lane, or a table without a conflict key (records route by their Kafka key,
    or their offset, on either tier); a keyed table with more lanes routes poison by its Kafka key on
    the row path and maybe by its key column on the tier, which a restart on the other tier's lane
    offsets would not survive: by rows, saying so."""
    sink = {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "columns": COLUMNS,
            "delivery": "exactly_once", "dlq": None}
    sink.pop("dlq")
    sink.update({"conflict_key": ["event_id"]} if keyed else {"on_conflict": "none"})
    p = PipelineSettings.model_validate({"name": "p", "topics": ["t"], "lanes": lanes, "sink": sink,
                                         "dlq": {"kind": "postgres"}})
    with caplog.at_level(logging.INFO, logger="ingest.runner.columnar"):
        tier = columnar_tier(p, _ColumnarSink(), columnar_capable=True, exactly_once=True,
                             mapper=lambda: Mapper(p.sink.columns))
    assert (tier is not None) is on
    if not on:
        assert any("write tier: rows (exactly-once delivery with lanes above 1 into a table with a conflict key"
                   in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("raw", [RAW, [b'{"id": 1, "s": 1}', b'{"id": 1, "s": 2}', b'{"id": 2}', b'{"id": 3}']])
def test_a_columnar_insert_carries_the_token_the_row_path_gives_the_same_rows(raw):
    """A columnar insert that fails after the server took it is retried by the row path: the same
    token lets a deduplicating sink (ClickHouse) drop the second insert."""
    tokens: dict[str, str] = {}

    def columnar_write(table, token=None) -> None:
        tokens["columnar"] = token
        raise TransientError("answer lost", error_class="connection")

    def row_write(rows, token=None) -> None:
        tokens.setdefault("rows", token)

    tier = ColumnarTier("p", PLAN, encode=_as_is, write=columnar_write, map_record=MAPPER.map)
    writer = BatchWriter(pipeline="p", write=row_write, dlq=_Dlq(), retry=RetrySettings(max_attempts=2),
                         collapse_rule=RULE, abort=threading.Event(), columnar=tier, insert_tokens=True)
    done = writer.handle(0, _unmapped(raw), "size")
    assert done.error is None and done.columnar_records == 0
    assert tokens["columnar"] is not None and tokens["columnar"] == tokens["rows"]
    good = [item for item in _unmapped(raw) if item.record.value != b"not json"]
    assert tokens["columnar"] == dedup_token("p", good)


@pytest.mark.parametrize(("sink", "extra", "reason"), [
    ({"kind": "clickhouse", "url": "chdb://memory", "table": "t", "order_by": ["event_id"],
      "insert_format": "native"}, {"dlq": {"kind": "postgres", "dsn": "postgresql://u@h/d"}}, "inserts Native"),
])
def test_a_sink_that_cannot_write_the_plan_by_columns_says_why(sink, extra, reason, caplog):
    """The real sinks (nothing connects: their pools and clients are lazy) refuse in use_columnar, and
    a pipeline that asked for the tier is told why."""
    from ingest.sinks import registry

    columns = {"event_id": {"type": "bigint" if sink["kind"] == "postgres" else "UInt64", "source": "$.id"},
               "small": {"type": "smallint" if sink["kind"] == "postgres" else "UInt16", "source": "$.s"}}
    p = PipelineSettings.model_validate({"name": "p", "topics": ["t"], "columnar": True, **extra,
                                         "sink": {**sink, "columns": columns}})
    backend = registry.backend(p.sink.kind)
    built = backend.build(p, lanes=1)
    with caplog.at_level(logging.DEBUG, logger="ingest.runner.columnar"):
        tier = columnar_tier(p, built, columnar_capable=backend.capabilities.columnar, exactly_once=False,
                             mapper=lambda: Mapper(p.sink.columns))
    assert tier is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0], warnings


#: The pipeline of issue #38 as a new user writes it: five columns, a timestamptz from ISO 8601 text,
#: an unconstrained numeric, required key columns, a pipeline key, one lane.
ORDERS = {
    "order_id": {"type": "bigint", "required": True},
    "customer": {"type": "text", "required": True},
    "amount": {"type": "numeric"},
    "status": {"type": "text"},
    "created_at": {"type": "timestamptz"},
}


def _orders_pipeline(columns=ORDERS, **overrides) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": "orders", "topics": ["orders"], "key": "$.order_id", **overrides,
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "orders", "conflict_key": ["order_id"],
                 "columns": columns}})


def _order(i: int) -> dict:
    stamps = ["2025-11-30T10:11:12Z", "2025-11-30T10:11:12.345+02:00", "2025-11-30 10:11:12.5",
              "2025-11-30T10:11:12.123456-05:30", 1_764_497_472_000]
    return {"order_id": i % 4, "customer": f"c{i}", "amount": [12, 12.5, 967.0, 0.1, -3][i % 5],
            "status": "paid", "created_at": stamps[i % 5]}


@pytest.mark.parametrize("amount", ["numeric", "numeric(12,2)", "double precision"])
def test_the_issue_38_orders_pipeline_has_the_tier_and_takes_iso_timestamps_whole(amount):
    """Issue #38: this pipeline wrote ``columnar_records: 0`` (an unconstrained numeric had no plan; an
    ISO timestamp, an integer amount sent every record of a batch to the row mapper, which took it,
    so every batch went by rows). Now it states the columnar tier and a batch of them is taken whole,
    its rows the row path's once the database converted them."""
    p = _orders_pipeline({**ORDERS, "amount": {"type": amount}})
    said: list[str] = []
    tier = columnar_tier(p, _ColumnarSink(), columnar_capable=True, exactly_once=False,
                         mapper=lambda: Mapper(p.sink.columns, p.key), said=said.append)
    assert said == ["columnar"] and tier is not None
    rule = p.collapse_rule()
    mapper = Mapper(p.sink.columns, p.key)
    records = [Record("orders", 0, i, b"k", orjson.dumps(_order(i)), 0) for i in range(10)]
    built = mapper.columnar_plan(rule.key_index, rule.version_index).build(records)
    assert built is not None and built.rejected == []
    items = [Item(r, mapper.map(r)[0], None, 0, 1) for r in records]
    _, groups = collapse(items, rule)
    expected = {g[0].row[0]: g[0].row for g in groups}
    got = {}
    for row in built.table.to_pylist():
        if amount.startswith("numeric"):
            row["amount"] = Decimal(row["amount"] if type(row["amount"]) is str else orjson.dumps(row["amount"]).decode())
        row["created_at"] = EPOCH_AWARE + timedelta(microseconds=row["created_at"])
        got[row["order_id"]] = tuple(row.values())
    assert got == expected
    if amount == "numeric":  # the text keeps the row mapper's scale: 967.0 stays "967.0", -3 "-3"
        assert sorted(built.table.column("amount").to_pylist()) == sorted(["12.5", "967.0", "0.1", "-3"])


@settings(max_examples=500, deadline=None)
@given(st.from_regex(r"\A-?(0|[1-9][0-9]{0,400})(\.[0-9]{1,30})?([eE][+-]?[0-9]{1,4})?\Z"),
       st.sampled_from([b":", b": ", b":[", b":[1,", b":\t"]))
def test_a_batch_with_a_number_orjson_refuses_is_never_decoded_skipping_unknown_keys(number, before):
    """The one number check msgspec skips in keys no column reads (a double's range) is the screen's."""
    value = (b'{"h": "9e123-1e456", "zz"' + before + number.encode() + (b"]" if b"[" in before else b"")
             + b', "t": "x 1e999"}')  # text shaped like numbers before and after it
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        assert not _skippable(value), value


def test_records_with_keys_no_column_reads_are_taken_whole():
    """Issue #38: a stream whose records carry more fields than the pipeline maps (a nested one too)."""
    raw = [orjson.dumps({"id": i, "s": i, "note": "x" * i, "meta": {"a": [i, None]}, "n": 1.5}) for i in range(6)]
    built = PLAN.build(_records(raw))
    assert built is not None and built.rejected == []
    assert [r["small"] for r in built.table.to_pylist()] == list(range(6))


def test_lane_keys_of_a_composite_key_of_metadata_and_text_are_the_row_paths():
    """A key of record metadata and a text value: routed as ``key_bytes`` of the row's key tuple; a
    record whose text the row mapper would coerce (a number) or reject (NUL, missing) is left to it."""
    columns = {"part": {"type": "integer", "source": "@partition"}, "off": {"type": "bigint", "source": "@offset"},
               "name": {"type": "text", "source": "$.name"}}
    cfg = PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", conflict_key=["part", "name"], columns=columns)
    mapper = Mapper(cfg.columns)
    plan = mapper.columnar_plan(cfg.collapse_rule().key_index)
    assert plan is not None and plan.route_refusal is None
    records = _records([b'{"name": "a"}', b'{"name": 5}', b'{"name": "a\\u0000"}', b"{}", b'{"name": "b", "x": 1}'])
    keys = plan.lane_keys(records)
    assert [k is UNROUTED for k in keys] == [False, True, True, True, False]
    for record, key in zip(records, keys, strict=True):
        if key is not UNROUTED:
            row, _ = mapper.map(record)
            assert key == key_bytes((row[0], row[2]))


VERSIONED = {
    "id": {"type": "bigint", "required": True},
    "v": {"type": "bigint"},
    "note": {"type": "text"},
}
version_values = st.one_of(st.none(), st.integers(min_value=0, max_value=3), st.sampled_from([-1, "2", 2.0, True]))
stamp_values = st.one_of(st.none(), st.integers(min_value=0, max_value=3),
                         st.sampled_from(["1970-01-01T00:00:00.001Z", "1970-01-01T01:00:00.002+01:00",
                                          "1970-01-01 00:00:00.003", "not a time", 2.0]))


def _versioned_plan(version_type: str):
    columns = {**VERSIONED, "v": {"type": version_type}}
    cfg = PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", conflict_key=["id"], version_column="v",
                               columns=columns)
    mapper = Mapper(cfg.columns)
    rule = cfg.collapse_rule()
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None and [c.kind for c in plan.columns][:3] == [
        "int", "timestamp" if version_type == "timestamptz" else "int", "text"]
    return mapper, rule, plan


VERSION_PLANS = {t: _versioned_plan(t) for t in ("bigint", "timestamptz")}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_type=st.sampled_from(["bigint", "timestamptz"]), data=st.data())
def test_with_a_version_column_the_highest_version_of_a_key_wins_as_on_the_row_path(version_type, data):
    """Issue #38 item 3: the plan collapses a key to its highest version, ties to the later record, as
    :func:`collapse` orders a group; a batch where a taken record has no version is declined (the row
    path decides), and a version the row mapper would coerce sends the batch to it."""
    mapper, rule, plan = VERSION_PLANS[version_type]
    docs = data.draw(st.lists(st.fixed_dictionaries(
        {"id": st.integers(min_value=0, max_value=3), "note": st.text(max_size=3)},
        optional={"v": version_values if version_type == "bigint" else stamp_values}), min_size=1, max_size=20))
    records = _records([orjson.dumps(d) for d in docs])
    items, poison = [], set()
    for rec in records:
        try:
            items.append(Item(rec, mapper.map(rec)[0], None, 0, 1))
        except InvalidRecord:
            poison.add(rec.offset)
    built = plan.build(records)
    if built is None:  # a taken record without a version
        assert any(item.row[1] is None for item in items)
        return
    if not set(built.rejected) <= poison:  # the tier writes this batch by rows
        return
    try:
        _, groups = collapse(items, rule)
    except TypeError:  # the row path cannot order a group with a missing version
        pytest.fail("the plan took a batch the row path cannot order")
    expected = {g[0].row[0]: g[0].row for g in groups}  # with the winner's hidden source columns
    got = {}
    for row in built.table.to_pylist():
        if version_type == "timestamptz" and row["v"] is not None:
            row["v"] = EPOCH_AWARE + timedelta(microseconds=row["v"])
        got[row["id"]] = tuple(row.values())
    assert got == expected


NESTED = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "uid": {"type": "bigint", "source": "$.user.id"},
    "name": {"type": "text", "source": "$.user.name"},
    "deep": {"type": "boolean", "source": "$.a.b.c"},
    "at": {"type": "timestamptz", "source": "$.a.b.at"},
}
NESTED_CFG = PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", conflict_key=["id"], columns=NESTED)
NESTED_MAPPER = Mapper(NESTED_CFG.columns, "$.meta.key")
NESTED_PLAN = NESTED_MAPPER.columnar_plan(NESTED_CFG.collapse_rule().key_index)
leaves = scalars | iso_texts | words
nodes = st.recursive(leaves, lambda inner: st.lists(inner, max_size=2) | st.dictionaries(
    st.sampled_from(["id", "name", "b", "c", "at", "x"]), inner, max_size=3), max_leaves=6)
nested_docs = st.fixed_dictionaries(
    {"id": st.integers(min_value=0, max_value=4)},
    optional={"user": st.none() | nodes | st.fixed_dictionaries({}, optional={"id": leaves, "name": leaves, "x": nodes}),
              "a": st.none() | nodes | st.fixed_dictionaries({}, optional={"b": st.none() | nodes | st.fixed_dictionaries(
                  {}, optional={"c": leaves, "at": leaves, "x": nodes})}),
              "meta": nodes, "other": nodes})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(nested_docs, min_size=1, max_size=15))
@example([{"id": 1, "user": {"id": 5, "id ": 1}}])
def test_nested_paths_take_what_the_row_path_takes(docs):
    """Issue #38: columns reading paths of keys ($.user.id, $.a.b.c): an intermediate that is null or
    missing gives a missing value, as the row mapper's path getter does; one that is not an object
    (a number, a list) is refused by the decoder and left to the row mapper."""
    assert NESTED_PLAN is not None
    raw = [json.dumps(d).encode() for d in docs]
    if len(raw) > 1:
        raw[0] = raw[0].replace(b'"id": ', b'"id": 9, "id": ', 1)  # a duplicate key: the last one counts
    records = _records(raw)
    items, poison = [], set()
    for rec in records:
        try:
            items.append(Item(rec, NESTED_MAPPER.map(rec)[0], None, 0, 1))
        except InvalidRecord:
            poison.add(rec.offset)
    built = NESTED_PLAN.build(records)
    assert built is not None
    assert poison <= set(built.rejected)
    if not set(built.rejected) <= poison:
        return  # by rows
    _, groups = collapse(items, NESTED_CFG.collapse_rule())
    expected = {g[0].row[0]: g[0].row for g in groups}
    got = {}
    for row in built.table.to_pylist():
        if row["at"] is not None:
            row["at"] = EPOCH_AWARE + timedelta(microseconds=row["at"])
        got[row["id"]] = tuple(row.values())
    assert got == expected


def test_a_clean_nested_batch_is_taken_whole():
    docs = [{"id": i % 3, "user": {"id": i, "name": f"u{i}", "x": [1]} if i % 4 else None,
             "a": {"b": {"c": i % 2 == 0, "at": "2025-11-30T10:11:12Z"}} if i % 3 else {"b": None},
             "meta": {"key": i}} for i in range(12)]
    records = _records([orjson.dumps(d) for d in docs])
    built = NESTED_PLAN.build(records)
    assert built is not None and built.rejected == []
    items = [Item(r, NESTED_MAPPER.map(r)[0], None, 0, 1) for r in records]
    _, groups = collapse(items, NESTED_CFG.collapse_rule())
    expected = {g[0].row[0]: g[0].row for g in groups}
    got = {}
    for row in built.table.to_pylist():
        row["at"] = None if row["at"] is None else EPOCH_AWARE + timedelta(microseconds=row["at"])
        got[row["id"]] = tuple(row.values())
    assert got == expected and len(got) == 3


def test_text_shaped_like_big_numbers_does_not_stop_skipping_keys():
    """Hex and words holding ``e`` and digits inside strings are not number tokens (a token follows
    ``[``, ``,``, ``:`` or whitespace): such a batch still skips keys no column reads."""
    assert _skippable(b'{"id": 1, "s": "4a1b-9e123-0e456", "u": "Chrome/131.0.0.0", "v": 1e99}\n{"id": 2, "w": "a1e300"}')
    assert not _skippable(b'{"id": 1, "s": "x"}\n{"id": 2, "w": [1, -1.5E+300]}')
    assert not _skippable(b'{"id": 1, "w": ' + b"1" * 70 + b'}')


CDC_COLUMNS = {"id": {"type": "bigint"}, "name": {"type": "text"}, "lsn": {"type": "bigint", "source": "@source.lsn"}}


@pytest.mark.parametrize(("overrides", "columns", "tier"), [
    ({"envelope": "debezium"}, CDC_COLUMNS, "columnar"),  # hard deletes (the default mode)
    ({"envelope": "debezium", "deletes": {"mode": "soft"}}, CDC_COLUMNS, "columnar"),
    ({"envelope": "debezium", "lanes": 3}, CDC_COLUMNS, "columnar"),  # routed by ChangePlan.lane_keys
    ({"tombstones": "delete"}, {"id": {"type": "bigint", "source": "@key"}, "name": {"type": "text"}},
     "rows (deletes by tombstones (envelope: none) are written by rows)"),
    ({"envelope": "debezium", "transforms": [{"set": {"n": "1"}}]}, CDC_COLUMNS,
     "rows (a change pipeline's transforms run on the row path)"),
    ({"envelope": "debezium"}, {**CDC_COLUMNS, "name": {"type": "text", "source": "$.a.b"}},
     "rows (a column reads a nested path of the row image (the tier reads its top-level keys))"),
    ({"envelope": "debezium"}, {**CDC_COLUMNS, "lsn": {"type": "bigint", "source": "@source.a.b"}},
     "rows (a column reads a nested path of the source block (the tier reads @source.KEY))"),
])
def test_a_change_pipeline_has_the_tier_where_it_is_exact(overrides, columns, tier):
    """Issue #38 item 1: Debezium JSON with hard or soft deletes into PostgreSQL takes the tier; what it
    cannot vouch for says why."""
    from ingest.cdc.mapper import mapper_for
    from ingest.runner.columnar import write_tier

    p = PipelineSettings.model_validate({
        "name": "p", "topics": ["t"], **overrides,
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["id"],
                 "columns": columns, **({"version_column": "lsn"} if "lsn" in columns else {})}})
    sink = _ColumnarSink()
    assert write_tier(p, sink, columnar_capable=True, exactly_once=False, mapper=lambda: mapper_for(p)) == tier
    assert (sink.staged is not None) is (tier == "columnar")
