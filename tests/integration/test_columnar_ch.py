"""The columnar tier into ClickHouse (chDB: modern ClickHouse in-process) against the row path.

1. Sink level: one batch of awkward values inserted by ``write_columns`` (the plan's staged Arrow
   columns, converted by the sink) and by ``write`` (the row path's Arrow insert) into twin tables
   must read back identically with FINAL; a columnar insert retried with its token is dropped by
   the server (no second part).
2. End to end: the same topic (clean records, updates, poison records of every stage, values the
   row mapper rounds or coerces) run by ``ingest run`` with the tier on (the default) and off:
   identical tables, identical DLQ entries (offset, stage, error class), offsets committed at the
   log end, and the tier actually took batches (``columnar_records``).
"""

from __future__ import annotations

import orjson
import pytest
from harness.kafka import produce
from pipeline_helpers import columnar_stream, run_pipeline_on_off

from ingest.config import PipelineSettings
from ingest.core.mapping import Mapper
from ingest.sinks.clickhouse.schema import create_table_sql
from ingest.sinks.clickhouse.sink import ClickHouseSink
from ingest.types import Record

pytestmark = pytest.mark.timeout(240)

DATABASE = "ingest_test"
COLUMNS = {
    "id": {"type": "UInt64", "source": "$.id"},
    "n": {"type": "Nullable(Int32)", "source": "$.n"},
    "kind": {"type": "LowCardinality(String)", "source": "$.kind"},
    "note": {"type": "Nullable(String)", "source": "$.note"},
    "amount": {"type": "Nullable(Decimal(14, 4))", "source": "$.amount"},
    "ts": {"type": "DateTime64(3)", "source": "$.ts"},
    "us": {"type": "Nullable(DateTime64(6))", "source": "$.us"},
    "part": {"type": "Int32", "source": "@partition"},
}
SELECT = ", ".join(f"toString({name})" for name in COLUMNS)
#: the same columns with defaults for a missing or null value (the tier stages them: issue #38)
DEFAULTED = {**COLUMNS, "n": {**COLUMNS["n"], "default": -1}, "note": {**COLUMNS["note"], "default": "none"},
             "amount": {**COLUMNS["amount"], "default": "2.5"},
             "us": {**COLUMNS["us"], "default": "2025-06-01T12:00:00.250Z"}}

AWKWARD = [
    {"id": 1, "n": 0, "kind": "", "note": None, "amount": 0.1, "ts": 0, "us": 0},
    {"id": 2, "n": -2147483648, "kind": 'quote " comma ,', "note": "nul \u0000 inside", "amount": -0.0,
     "ts": 10_413_791_999_999, "us": 10_413_791_999_999},
    {"id": 3, "n": 2147483647, "kind": "line\nbreak\ttab", "amount": 12345.6789, "ts": 1_764_460_800_123},
    {"id": 4, "kind": "\\.", "amount": 999999999.9999, "ts": 1},
    {"id": 5, "kind": "ünïcødé ✓ 😀", "amount": -5e-4, "ts": 2, "us": 1_764_460_800_001},
]


def _pipeline(url: str, table: str, dlq_dsn: str = "postgresql://nobody@127.0.0.1:1/none",
              columns: dict = COLUMNS) -> PipelineSettings:
    return PipelineSettings.model_validate({
        "name": table, "topics": ["t"],
        "sink": {"kind": "clickhouse", "url": url, "database": DATABASE, "table": table, "order_by": ["id"],
                 "columns": columns},
        "dlq": {"kind": "postgres", "dsn": dlq_dsn},
    })


def _stored(client, table: str) -> list[tuple]:
    return client.query(f"SELECT {SELECT}, _version FROM {DATABASE}.{table} FINAL ORDER BY id").result_rows


@pytest.mark.parametrize("columns", [COLUMNS, DEFAULTED], ids=["plain", "defaults"])
def test_columnar_insert_stores_what_the_row_path_stores(chdb, columns):
    by_rows, by_columns = (_pipeline(chdb.url, "by_rows", columns=columns),
                           _pipeline(chdb.url, "by_columns", columns=columns))
    sinks = [ClickHouseSink(p.sink, pipeline=p.name) for p in (by_rows, by_columns)]
    try:
        client = sinks[0].client()
        for p in (by_rows, by_columns):
            for statement in create_table_sql(p.sink):
                client.command(statement)
        mapper = Mapper(by_columns.sink.columns)
        records = [Record("t", 0, i, b"k", orjson.dumps(doc), 0) for i, doc in enumerate(AWKWARD)]
        rule = by_columns.collapse_rule()
        plan = mapper.columnar_plan(rule.key_index, rule.version_index)
        assert plan is not None
        built = plan.build(records)
        assert built is not None and built.rejected == []
        sinks[1].use_columnar(plan.columns)
        sinks[1].write_columns(built.table, token="columnar-batch-1")
        sinks[1].write_columns(built.table, token="columnar-batch-1")  # retried: the server drops it
        sinks[0].write([mapper.map(r)[0] for r in records])
        rows = _stored(client, "by_rows")
        assert len(rows) == len(AWKWARD)
        assert _stored(client, "by_columns") == rows
        assert client.command(f"SELECT count() FROM {DATABASE}.by_columns") == len(AWKWARD)  # one part, no FINAL
        assert sinks[1].arrow_inserts == 2
    finally:
        for sink in sinks:
            sink.close()
        chdb.close()


def test_a_native_sink_has_no_columnar_write(chdb):
    p = PipelineSettings.model_validate({
        "name": "native", "topics": ["t"],
        "sink": {"kind": "clickhouse", "url": chdb.url, "database": DATABASE, "table": "native",
                 "order_by": ["id"], "columns": COLUMNS, "insert_format": "native"},
        "dlq": {"kind": "postgres", "dsn": "postgresql://nobody@127.0.0.1:1/none"},
    })
    rule = p.collapse_rule()
    plan = Mapper(p.sink.columns).columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None
    with pytest.raises(ValueError, match="inserts Native"):
        ClickHouseSink(p.sink, pipeline=p.name).use_columnar(plan.columns)


def _stream() -> list[tuple[bytes, bytes]]:
    """Clean records with updates, poison of every kind, values only the row mapper takes."""
    def doc(i: int) -> dict:
        return {"id": i % 700, "n": i, "kind": f"k{i % 7}", "note": None if i % 5 else f"note {i}",
                "amount": round(i / 7, 3), "ts": 1_764_460_800_000 + i, "us": i * 1000}

    def special(i: int, d: dict) -> bytes | None:
        if i % 173 == 3:
            return orjson.dumps({k: v for k, v in d.items() if k != "ts"})  # a required column missing
        if i % 1000 == 13:
            return orjson.dumps({**d, "amount": 1.00005})  # rounds to 4 places: the row mapper's
        return None

    return columnar_stream(doc, special)


def _run(tmp_path, name, bootstrap, topic, chdb_url, pg_dsn, columnar):
    return run_pipeline_on_off(tmp_path, bootstrap, topic, pg_dsn, {
        "name": name,
        "sink": {"kind": "clickhouse", "url": chdb_url, "database": DATABASE, "table": name, "order_by": ["id"],
                 "columns": COLUMNS},
        "dlq": {"kind": "postgres", "dsn": pg_dsn, "table": f"{name}_dlq"},
    }, columnar)


def test_columnar_run_writes_and_dead_letters_what_the_row_path_does(kafka_bootstrap, pg_dsn, new_topic, chdb,
                                                                      tmp_path):
    topic = new_topic(3)
    records = _stream()
    assert produce(kafka_bootstrap, topic, records) == len(records)
    # each run owns the chDB path while it runs; this process opens it only afterwards
    rows_stats, rows_dlq = _run(tmp_path, "rows", kafka_bootstrap, topic, chdb.url, pg_dsn, False)
    col_stats, col_dlq = _run(tmp_path, "cols", kafka_bootstrap, topic, chdb.url, pg_dsn, None)  # default: on
    try:
        client = chdb.client()
        rows, cols = _stored(client, "rows"), _stored(client, "cols")
    finally:
        chdb.close()
    assert len(rows) == 700
    assert cols == rows
    assert col_dlq == rows_dlq and len(rows_dlq) > 50
    assert {(stage, error) for _, _, stage, error, _ in rows_dlq} == {
        ("decode", "invalid_json"), ("map", "invalid_value"), ("map", "out_of_range"), ("map", "missing_field")}
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq)
    assert rows_stats["columnar_records"] == 0
    # Batches holding an ISO timestamp or a value to round go by rows; the rest are written columnar.
    assert 0 < col_stats["columnar_records"] < col_stats["records_consumed"] == len(records)
