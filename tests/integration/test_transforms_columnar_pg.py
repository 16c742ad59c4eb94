"""Transforms on the columnar tier against the row path, on the real broker and PostgreSQL (issue #37 item 8).

One topic (clean records with updates, records a filter drops, poison of every stage: not JSON, a
value the mapper refuses, a value a ``set`` expression fails on, an ISO timestamp only the row
mapper takes) run by ``ingest run`` through a pipeline with ``filter``, ``set``, ``rename`` and
``drop`` steps, with the tier on (the default) and off (``columnar: false``): the run with the tier
states ``write tier: columnar`` and actually writes batches by columns; both runs leave identical
tables and DLQ entries (offset, stage, class, message), the same filtered counts per step, and
offsets committed at the log end.
"""

from __future__ import annotations

import orjson
import psycopg
from harness.kafka import produce
from pipeline_helpers import columnar_stream, run_pipeline_on_off

COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "n": {"type": "integer", "source": "$.n"},
    "kind": {"type": "text", "source": "$.kind"},
    "price": {"type": "numeric(14,4)", "source": "$.price"},
    "cents": {"type": "bigint", "source": "$.cents", "required": True},
    "label": {"type": "text", "source": "$.label"},
    "big": {"type": "text", "source": "$.big"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
}

TRANSFORMS = [
    {"filter": "value.kind != 'skip'", "name": "no-skip"},
    {"set": {"cents": "int(value.amount * 100.0)", "label": "value.kind + '#' + string(value.n % 10)",
             "big": "value.n > 2500 ? 'big' : 'small'"}},
    {"rename": {"amount": "price"}},
    {"drop": ["debug"]},
    {"filter": "value.cents % 7 != 3 || has(value.keep)", "name": "thin"},
]


def _doc(i: int) -> dict:
    doc = {"id": i % 700, "n": i, "kind": "skip" if i % 11 == 0 else f"k{i % 5}", "amount": round(i / 7, 3),
           "ts": 1_764_460_800_000 + i, "debug": "x" * (i % 3)}
    if i % 13 == 0:
        doc["keep"] = True
    return doc


def _special(i: int, doc: dict) -> bytes | None:
    if i % 89 == 4:
        return orjson.dumps({**doc, "amount": 5})  # an int times a double: the set step's transform_error
    return None


def _stored(dsn: str, table: str) -> list[tuple]:
    cols = ", ".join(f"{c}::text" for c in COLUMNS)
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT {cols}, _ingest_offset FROM "{table}" ORDER BY id').fetchall()


def _run(tmp_path, name, bootstrap, topic, dsn, columnar):
    stats, dlq = run_pipeline_on_off(tmp_path, bootstrap, topic, dsn, {
        "name": name, "transforms": TRANSFORMS,
        "sink": {"kind": "postgres", "dsn": dsn, "table": name, "conflict_key": ["id"], "columns": COLUMNS},
        "dlq": {"kind": "postgres", "table": f"{name}_dlq"},
    }, columnar)
    return stats, _stored(dsn, name), dlq


def test_a_transforms_pipeline_on_the_columnar_tier_writes_filters_and_dead_letters_as_the_row_path(
        kafka_bootstrap, pg_dsn, new_topic, tmp_path):
    topic = new_topic(3)
    records = columnar_stream(_doc, _special)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    rows_stats, rows, rows_dlq = _run(tmp_path, "trows", kafka_bootstrap, topic, pg_dsn, False)
    col_stats, cols, col_dlq = _run(tmp_path, "tcols", kafka_bootstrap, topic, pg_dsn, None)  # the default: on
    assert rows_stats["write_tier"] == "rows (columnar: false)" and col_stats["write_tier"] == "columnar"
    assert len(rows) > 500
    assert cols == rows
    assert col_dlq == rows_dlq
    classes = {(stage, error_class) for _, _, stage, error_class, _ in rows_dlq}
    assert ("transform", "transform_error") in classes and ("decode", "invalid_json") in classes, classes
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq)
    assert col_stats["filtered_by_step"] == rows_stats["filtered_by_step"]
    assert rows_stats["filtered_by_step"]["no-skip"] > 200 and rows_stats["filtered_by_step"]["thin"] > 200
    assert col_stats["records_mapped"] == rows_stats["records_mapped"]
    assert rows_stats["columnar_records"] == 0
    # Batches by columns (since the tier takes ISO timestamps, all of them here; a batch with a record the
    # evaluation hands back but the row mapper takes after all would go by rows).
    assert 0 < col_stats["columnar_records"] <= col_stats["records_consumed"] == len(records)
    # a row with computed values, as the row path's CEL computed them: the last record of key 699, i = 2799
    # (none of the stream's specials; kind k4, amount 399.857, cents 39985: 39985 % 7 == 1, kept)
    assert {r[0]: r for r in cols}["699"][:7] == ("699", "2799", "k4", "399.8570", "39985", "k4#9", "big")
