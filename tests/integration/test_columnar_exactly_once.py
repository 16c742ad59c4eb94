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
from pipeline_helpers import columnar_stream, run_pipeline_on_off

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
    row: isolated inside the batch transaction; 2503 is its key's last record, so even a keyed table
    sends it); with ``unkeyed`` every third record and the last 60 have no Kafka key (exactly-once
    routes them by their offset: with each partition's last records unkeyed, the lane offsets at the
    end tell where they went)."""
    def doc_of(i: int) -> dict:
        return {"id": i % 700, "n": i, "kind": "toolong" if i % 1000 == 503 else f"k{i % 7}",
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
