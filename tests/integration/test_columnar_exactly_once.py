"""The columnar tier under ``sink.delivery: exactly_once`` (issue #38 item 1), on the real broker and
PostgreSQL.

1. A plain JSON stream into an exactly-once pipeline is written on the columnar tier
   (``write_tier: columnar``, every record counted in ``columnar_records``), each record once, and
   the offsets stored in the database (``ingest_offsets``) reach the log end.
2. Differentials, the tier on and off (``columnar: false``), over the same topic with hostile input
   mixed in (decode, map and range poison, values only the row mapper takes, and values the
   database refuses, which the exactly-once transaction isolates with SAVEPOINTs): identical
   tables, identical DLQ entries (offset, stage, error class, message), identical stored offsets
   -- the watermark per partition and every lane's offset (which, once the topic is drained, is one
   past the highest offset routed to that lane: the two tiers routed every record alike).

The SIGKILL test of the tier is in ``test_exactly_once.py`` beside the row path's.
"""

from __future__ import annotations

import orjson
import psycopg
import pytest
from harness.kafka import log_end_offsets, produce
from hypothesis import strategies as st
from pipeline_helpers import columnar_stream, run_pipeline_on_off

from ingest.sinks.postgres.sink import PostgresSink

COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "n": {"type": "integer", "source": "$.n"},
    "kind": {"type": "varchar(6)", "source": "$.kind"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
    "part": {"type": "bigint", "source": "@partition"},
    "off": {"type": "bigint", "source": "@offset"},
}


def _pipeline(name: str, dsn: str, *, keyed: bool, lanes: int) -> dict:
    sink = {"kind": "postgres", "dsn": dsn, "table": name, "delivery": "exactly_once", "columns": COLUMNS}
    sink.update({"conflict_key": ["id"]} if keyed else {"on_conflict": "none"})
    return {"name": name, "lanes": lanes, "sink": sink, "dlq": {"kind": "postgres", "table": f"{name}_dlq"}}


def _rows(dsn: str, table: str) -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT id, n, kind, ts::text, part, off FROM "{table}" ORDER BY part, off').fetchall()


def _stored_offsets(dsn: str, pipeline: str) -> tuple[dict, dict]:
    """``ingest_offsets`` (partition -> watermark) and ``ingest_lane_offsets`` ((partition, lane) ->
    next offset) of ``pipeline``."""
    with psycopg.connect(dsn) as conn:
        marks = dict(conn.execute('SELECT "partition", next_offset FROM ingest_offsets WHERE pipeline = %s',
                                  [pipeline]).fetchall())
        lanes = {(p, lane): off for p, lane, off in conn.execute(
            'SELECT "partition", lane, next_offset FROM ingest_lane_offsets WHERE pipeline = %s', [pipeline])}
    return marks, lanes


def test_an_exactly_once_pipeline_writes_on_the_columnar_tier(kafka_bootstrap, pg_dsn, new_topic, tmp_path):
    """Failing before issue #38 item 1: exactly-once pipelines wrote by rows."""
    topic = new_topic(3)
    records = [(str(i % 50).encode(), orjson.dumps({"id": i, "n": i, "kind": f"k{i % 7}", "ts": 1_764_460_800_000 + i}))
               for i in range(2000)]
    assert produce(kafka_bootstrap, topic, records) == len(records)
    stats, dlq = run_pipeline_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn,
                                     _pipeline("eocol", pg_dsn, keyed=False, lanes=1), None)
    assert stats["write_tier"] == "columnar", stats["write_tier"]
    assert stats["columnar_records"] == stats["records_consumed"] == len(records), stats
    assert dlq == []
    rows = _rows(pg_dsn, "eocol")
    assert sorted(r[0] for r in rows) == list(range(len(records)))  # each record once
    marks, lanes = _stored_offsets(pg_dsn, "eocol")
    ends = {p: e for p, e in log_end_offsets(kafka_bootstrap, topic).items() if e > 0}
    assert marks == ends
    assert {p: off for (p, _lane), off in lanes.items()} == ends


def _hostile_stream(*, unkeyed: bool) -> list[tuple[bytes | None, bytes]]:
    """:func:`columnar_stream`'s records (poison of three kinds, ISO timestamps only the row mapper
    takes) plus a ``kind`` too long for ``varchar(6)`` at i = 503, 1503, 2503 (the database refuses the
    row: isolated inside the batch transaction), each the only record of its id (so whatever the batch
    boundaries of a run, both tiers try to write it -- with a later record of its id in the same batch
    the collapse would drop it, and the two runs' DLQs would differ by timing); with ``unkeyed`` every third record and the last 60 have no Kafka key (exactly-once
    routes them by their offset: with each partition's last records unkeyed, the lane offsets at the
    end tell where they went)."""
    def doc_of(i: int) -> dict:
        toolong = i % 1000 == 503  # a row of its own: no later record of its id can collapse it away
        return {"id": 10_000 + i if toolong else i % 700, "n": i, "kind": "toolong" if toolong else f"k{i % 7}",
                "ts": 1_764_460_800_000 + i, **({"note": {"x": [i]}} if i % 4 == 0 else {})}

    out = columnar_stream(doc_of)
    return [(None if unkeyed and (i % 3 == 0 or i >= len(out) - 60) else key, value)
            for i, (key, value) in enumerate(out)]


@pytest.mark.parametrize(("keyed", "lanes"), [(True, 1), (False, 2)])
def test_exactly_once_columnar_run_matches_the_row_path(kafka_bootstrap, pg_dsn, new_topic, tmp_path, keyed, lanes):
    """The same topic into an exactly-once pipeline by rows and on the columnar tier: same rows, same
    DLQ, same stored offsets (watermarks and lane offsets). Append-only with two lanes: records with
    and without a Kafka key (the lanes' offsets show that both tiers routed them alike)."""
    topic = new_topic(3)
    records = _hostile_stream(unkeyed=not keyed)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    out = {}
    for name, columnar in (("eorows", False), ("eocols", None)):
        stats, dlq = run_pipeline_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn,
                                         _pipeline(name, pg_dsn, keyed=keyed, lanes=lanes), columnar)
        out[name] = (stats, _rows(pg_dsn, name), dlq, _stored_offsets(pg_dsn, name))
    (rows_stats, rows, rows_dlq, rows_offsets), (col_stats, cols, col_dlq, col_offsets) = out["eorows"], out["eocols"]
    assert len(rows) == (700 if keyed else len(records) - len(rows_dlq))
    assert cols == rows
    stages = {(stage, error_class) for _, _, stage, error_class, _ in rows_dlq}
    assert ("write", "data_exception") in stages and ("decode", "invalid_json") in stages, stages
    assert col_dlq == rows_dlq
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq)
    ends = {p: e for p, e in log_end_offsets(kafka_bootstrap, topic).items() if e > 0}
    assert rows_offsets[0] == col_offsets[0] == ends
    assert col_offsets[1] == rows_offsets[1] and len(rows_offsets[1]) == 3 * lanes
    assert rows_stats["write_tier"] == "rows (columnar: false)" and rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar", col_stats["write_tier"]
    # batches with an ISO timestamp, or a row the database refuses, go by rows; the rest columnar
    assert 0 < col_stats["columnar_records"] < col_stats["records_consumed"] == len(records)
    assert col_stats["columnar_records"] >= len(records) // 3, col_stats


# --------------------------------------------------------------------------- the transaction, batch by batch

#: hostile documents (``{id}`` is filled in): clean, refused by the database (too long for varchar(6)),
#: poison of each stage, values only the row mapper takes (the batch goes by rows), fields no column reads
TX_VALUES = [
    b'{"id": {id}, "n": 5, "kind": "a", "ts": 1764460800000}',
    b'{"id": {id}, "n": -3, "kind": "b", "ts": "2025-11-30T10:11:12.5+02:00", "x": {"y": [1, null]}}',
    b'{"id": {id}, "n": 1, "kind": "toolong!"}',  # the database refuses it (22001)
    b'not json',
    b'[1, 2]',
    b'{"id": {id}, "n": 2147483648}',  # out of range for integer
    b'{"kind": "no id"}',  # a required column missing
    b'{"id": {id}, "ts": "2025-02-30T00:00:00Z"}',  # no such day
    b'{"id": {id}, "kind": "nul \\u0000"}',
    b'{"id": {id}, "n": "7"}',  # text for an integer: the row mapper coerces it, the batch goes by rows
    b'{"id": {id}, "zz": 1e400}',  # beyond a double in a key no column reads
    b'{"id": {id}, "n": 2, "kind": "\xc3\xa9t\xc3\xa9"}',
]

tx_records = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(range(len(TX_VALUES))), st.integers(0, 4),
                                st.sampled_from([b"k1", b"k2", None])),
                      min_size=1, max_size=40)


def _tx_pipeline(name: str, dsn: str, keyed: bool):
    from ingest.config import PipelineSettings

    sink = {"kind": "postgres", "dsn": dsn, "table": name, "delivery": "exactly_once", "columns": COLUMNS}
    sink.update({"conflict_key": ["id"]} if keyed else {"on_conflict": "none"})
    return PipelineSettings.model_validate({"name": name, "topics": ["t"], "sink": sink,
                                            "dlq": {"kind": "postgres", "table": f"{name}_dlq"}})


@pytest.mark.parametrize("keyed", [True, False])
def test_the_exactly_once_transaction_of_a_columnar_batch_matches_the_row_paths(pg_dsn, keyed):
    """Hypothesis differential of one lane's exactly-once transactions (``BatchWriter.handle`` with the
    real :class:`ExactlyOnceWriter`), the columnar tier's unmapped batches against the row path's
    mapped ones, into twin tables: a batch of hostile records, then an overlapping one (records
    ``j..`` again: what a restart re-reads above the stored watermark) -- same rows, same DLQ
    entries, same lane offsets, same counts of records already written. Across the examples some
    batches must have gone columnar and some overlapping ones by rows (the payload stands for every
    record: a batch with records already written is mapped and written by rows)."""
    import threading

    from hypothesis import HealthCheck, given, settings

    from ingest.config import RetrySettings
    from ingest.core.mapping import Mapper
    from ingest.dlq.postgres import PostgresDlq, migrate_dlq_table
    from ingest.runner.columnar import columnar_tier
    from ingest.runner.writer import BatchWriter
    from ingest.sinks.postgres.exactly_once import ExactlyOnceWriter
    from ingest.sinks.postgres.schema import migrate_postgres
    from ingest.types import Item, Record

    suffix = "k" if keyed else "a"
    names = (f"txrows_{suffix}", f"txcols_{suffix}")
    sides = {}
    closing = []
    for name in names:
        p = _tx_pipeline(name, pg_dsn, keyed)
        migrate_postgres(p)
        migrate_dlq_table(pg_dsn, "public", f"{name}_dlq", "dlq")
        sink = PostgresSink(p.sink, pool_size=1)
        dlq = PostgresDlq(pg_dsn, "public", f"{name}_dlq", pool_size=1)
        closing += [sink, dlq]
        tier = None
        if name.startswith("txcols"):
            tier = columnar_tier(p, sink, columnar_capable=True, exactly_once=True,
                                 mapper=lambda p=p: Mapper(p.sink.columns, p.key))
            assert tier is not None
        writer = BatchWriter(pipeline=name, write=sink.write, dlq=dlq, retry=RetrySettings(max_attempts=1),
                             collapse_rule=p.collapse_rule(), abort=threading.Event(),
                             exactly_once=ExactlyOnceWriter(sink, p, dlq), columnar=tier)
        sides[name] = (writer, tier)
    row_mapper = Mapper(_tx_pipeline("m", pg_dsn, keyed).sink.columns)
    seen = {"columnar": 0, "overlap_by_rows": 0, "dead_lettered": 0}

    def state(name: str) -> tuple:
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(f'SELECT id, n, kind, ts::text, part, off FROM "{name}" ORDER BY part, off, id').fetchall()
            dlq = conn.execute(f'SELECT "partition", "offset", stage, error_class, error_message, attempts '
                               f'FROM "{name}_dlq" ORDER BY 1, 2').fetchall()
            lanes = conn.execute('SELECT topic, "partition", lane, next_offset FROM ingest_lane_offsets '
                                 "WHERE pipeline = %s ORDER BY 1, 2, 3", [name]).fetchall()
        return rows, dlq, lanes

    def by_rows(items: list) -> list:
        out = []
        for it in items:
            try:
                out.append(Item(it.record, row_mapper.map(it.record)[0], None, it.epoch, it.size_bytes))
            except Exception as exc:  # noqa: BLE001 - InvalidRecord: the row path's failure
                from ingest.types import Failure

                out.append(Item(it.record, None, Failure(exc.stage, exc.error_class, exc.message), it.epoch,
                                it.size_bytes))
        return out

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(specs=tx_records, data=st.data())
    def check(specs, data):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(f'TRUNCATE "{name}", "{name}_dlq"')
                conn.execute("DELETE FROM ingest_lane_offsets WHERE pipeline = %s", [name])
        next_offset = [0, 0]
        records = []
        for part, which, id_, key in specs:
            value = TX_VALUES[which].replace(b"{id}", str(id_).encode())
            records.append(Record("t", part, next_offset[part], key, value, 1_700_000_000_000))
            next_offset[part] += 1
        k = data.draw(st.integers(0, len(records)), label="first batch ends at")
        j = data.draw(st.integers(0, k), label="second batch starts at")
        items = [Item(r, None, None, 0, 100) for r in records]
        for batch in (items[:k], items[j:]):
            if not batch:
                continue
            done = {}
            for name in names:
                writer, tier = sides[name]
                if tier is not None:
                    tier.on = True  # the tier's self-review is not under test
                done[name] = writer.handle(0, batch if tier is not None else by_rows(batch), "test")
            rows_done, cols_done = done[names[0]], done[names[1]]
            assert rows_done.error is None and cols_done.error is None, (rows_done.error, cols_done.error)
            assert cols_done.done == rows_done.done
            assert (cols_done.skipped, cols_done.dead_lettered, cols_done.rows_written, cols_done.records) == \
                (rows_done.skipped, rows_done.dead_lettered, rows_done.rows_written, rows_done.records)
            if cols_done.columnar_records:
                seen["columnar"] += 1
                assert cols_done.skipped == 0
            elif cols_done.skipped:
                seen["overlap_by_rows"] += 1
            seen["dead_lettered"] += sum(cols_done.dead_lettered.values())
        rows_state, cols_state = state(names[0]), state(names[1])
        assert cols_state[0] == rows_state[0]
        assert cols_state[1] == rows_state[1]
        assert cols_state[2] == rows_state[2]

    try:
        check()
    finally:
        for c in closing:
            c.close()
    assert seen["columnar"] > 0 and seen["overlap_by_rows"] > 0 and seen["dead_lettered"] > 0, seen
