"""The columnar tier (``columnar: true``) against the row path, on the real broker and PostgreSQL.

1. Sink level: one batch of awkward values written by ``write_columns`` (CSV COPY, SQL-side
   conversions) and by ``write`` (the row path's binary COPY) into twin tables must read back
   identically, value by value as text.
2. End to end: the same topic (clean records, updates, poison records of every stage, values the
   row mapper coerces) run by ``ingest run`` with the tier on and off: identical tables, identical
   DLQ entries (offset, stage, error class), offsets committed at the log end, and the tier
   actually took batches (``columnar_records``).
"""

from __future__ import annotations

import orjson
import psycopg
import pytest
from harness.kafka import produce
from pipeline_helpers import columnar_stream, run_pipeline_on_off

from ingest.core.mapping import Mapper
from ingest.sinks.postgres.schema import sink_table_sql
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.sink import PostgresSink
from ingest.sinks.postgres.statements import stage_name
from ingest.types import Record

COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "n": {"type": "integer", "source": "$.n"},
    "kind": {"type": "text", "source": "$.kind"},
    "amount": {"type": "numeric(14,4)", "source": "$.amount"},
    "exact": {"type": "numeric(40,20)", "source": "$.exact"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
    "local": {"type": "timestamp", "source": "$.local"},
    "plain": {"type": "numeric", "source": "$.plain"},
    "ratio": {"type": "double precision", "source": "$.ratio"},
    "flag": {"type": "boolean", "source": "$.flag"},
    "dflt": {"type": "integer", "source": "$.dflt", "default": 7},
    "since": {"type": "timestamptz(3)", "source": "$.since", "default": "2020-01-01T00:00:00.123456+02:00"},
    "who": {"type": "text", "source": "$.by.name"},
    "doc": {"type": "jsonb", "source": "$.doc"},
}

AWKWARD = [
    {"id": 1, "n": 0, "kind": "", "amount": 0.1, "exact": 1e19, "ts": 0, "local": 0, "plain": 967.0,
     "ratio": 0.1, "flag": True, "by": {"name": "nested"}, "doc": {"b": [1, 2.50, None, "é"], "a": {"a": {}}}},
    {"id": 2, "n": -2147483648, "kind": 'quote " comma , semicolon ;', "amount": -0.0, "exact": 1e-7,
     "ts": 2**42 - 1, "local": 2**42 - 1, "plain": -0.0, "ratio": -0.0, "flag": "F", "dflt": 1, "doc": "text"},
    {"id": 3, "n": 2147483647, "kind": "line\nbreak\r\nand tab\t", "amount": 12345.6789, "exact": 5e-324,
     "ts": 1_764_460_800_123, "local": 1_764_460_800_123, "plain": 1e21, "ratio": 5e-324, "flag": 0},
    {"id": 4, "kind": "\\.", "exact": 0.30000000000000004, "plain": 12, "ratio": 2**53 + 1, "flag": "TRUE",
     "ts": "2025-11-30T10:11:12Z", "local": "2025-11-30T10:11:12.5+05:30", "since": "2025-11-30 10:11:12.123456"},
    {"id": 5, "kind": "ünïcødé ✓ 😀", "amount": 99999.99995, "exact": 123456789.125, "plain": 1.5e-7,
     "ratio": 1.7976931348623157e308, "ts": "1969-07-20T20:17:40.1234567-04:00", "local": "2025-11-30",
     "since": "2025-11-30T10:11:12.0005+00:00"},
    {"id": 6, "kind": " spaced ", "amount": 0.285, "exact": -1.5, "plain": -9223372036854775808,
     "ratio": -12345678901234567, "ts": "2025-11-30T00:00:00.5+05:30:15.5", "local": "1700-01-01T00:00:00-23:59",
     "since": 2**42},
    # decimal text (e.g. Debezium's decimal.handling.mode=string): staged as itself, rounded by the column
    {"id": 7, "amount": "12345.67895", "exact": "-0.000", "plain": "007.50"},
    {"id": 8, "amount": "-0.00005", "exact": "12345678901234567890.12345678901234567890", "plain": "-0"},
]


def _stored(dsn: str, table: str) -> list[tuple]:
    cols = ", ".join(f"{c}::text" for c in COLUMNS)
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT {cols}, _ingest_stream, _ingest_offset FROM "{table}" ORDER BY id').fetchall()


def _sink(dsn: str, table: str) -> tuple[PostgresSinkSettings, PostgresSink]:
    cfg = PostgresSinkSettings(dsn=dsn, table=table, conflict_key=["id"], columns=COLUMNS)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in sink_table_sql(cfg):
            conn.execute(statement)
    return cfg, PostgresSink(cfg, pool_size=1)


def test_columnar_write_stores_what_the_row_path_stores(pg_dsn):
    cfg, by_rows = _sink(pg_dsn, "by_rows")
    _, by_columns = _sink(pg_dsn, "by_columns")
    mapper = Mapper(cfg.columns)
    records = [Record("t", 0, i, b"k", orjson.dumps(doc), 0) for i, doc in enumerate(AWKWARD)]
    plan = mapper.columnar_plan(cfg.collapse_rule().key_index)
    assert plan is not None
    built = plan.build(records)
    assert built is not None and built.rejected == []
    by_columns.use_columnar(plan.columns)
    try:
        by_columns.write_columns(built.table)
        by_columns.write_columns(built.table)  # again: the upsert makes it a no-op
        by_rows.write([mapper.map(r)[0] for r in records])
        rows = _stored(pg_dsn, "by_rows")
        assert len(rows) == len(AWKWARD)
        assert _stored(pg_dsn, "by_columns") == rows
        # The stage is emptied by the commit's truncation (ON COMMIT DELETE ROWS), not by a DELETE that
        # would leave dead rows in a temporary table no autovacuum visits: after two batches it has no
        # pages at all (pool_size=1: the connection that wrote them).
        stage = stage_name(cfg.db_schema, "by_columns") + "_c"
        with by_columns.connection() as conn:
            assert conn.execute("SELECT pg_relation_size(oid) FROM pg_class WHERE relname = %s AND relpersistence = 't'",
                                [stage]).fetchall() == [(0,)]
            conn.rollback()
    finally:
        by_rows.close()
        by_columns.close()


@pytest.mark.parametrize("skip_unchanged", [True, False])
def test_a_replayed_columnar_batch_rewrites_no_row(pg_dsn, skip_unchanged):
    """``sink.skip_unchanged`` (the default) on the columnar tier's upsert: a replayed batch (the same
    records at the same offsets) leaves every row's ``xmin``; a changed record rewrites its row alone,
    and so does an identical one from another offset (its source columns move). Off: every row is
    rewritten. A ``json`` column (no equality operator) is compared as its text."""
    columns = {**COLUMNS, "raw": {"type": "json", "source": "$.raw"}}
    cfg = PostgresSinkSettings(dsn=pg_dsn, table="replayed", conflict_key=["id"], columns=columns,
                               skip_unchanged=skip_unchanged)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in sink_table_sql(cfg):
            conn.execute(statement)
    sink = PostgresSink(cfg, pool_size=1)
    mapper = Mapper(cfg.columns)
    plan = mapper.columnar_plan(cfg.collapse_rule().key_index)
    assert plan is not None
    sink.use_columnar(plan.columns)
    docs = [{**doc, "raw": {"z": [1, 2], "a": None}} for doc in AWKWARD]

    def write(records: list[Record]) -> dict[int, int]:
        built = plan.build(records)
        assert built is not None and built.rejected == []
        sink.write_columns(built.table)
        with psycopg.connect(pg_dsn) as conn:
            return dict(conn.execute("SELECT id, xmin::text::bigint FROM replayed").fetchall())

    records = [Record("t", 0, i, b"k", orjson.dumps(doc), 0) for i, doc in enumerate(docs)]
    try:
        first = write(records)
        assert len(first) == len(AWKWARD)
        again = write(records)
        if skip_unchanged:
            assert again == first
        else:
            assert all(again[k] != first[k] for k in first)
        changed = [*records[:2], Record("t", 0, 2, b"k", orjson.dumps({**docs[2], "raw": {"z": [1, 2]}}), 0),
                   Record("t", 0, 30, b"k", orjson.dumps(docs[3]), 0), *records[4:]]
        after = write(changed)
        rewritten = {k for k in after if after[k] != again[k]}
        assert rewritten == ({3, 4} if skip_unchanged else set(after))  # ids 3 (raw) and 4 (offset 30)
        with psycopg.connect(pg_dsn) as conn:
            assert conn.execute("SELECT raw::text, _ingest_offset FROM replayed WHERE id = 3").fetchone() == (
                '{"z":[1,2]}', 2)
            assert conn.execute("SELECT _ingest_offset FROM replayed WHERE id = 4").fetchone() == (30,)
    finally:
        sink.close()


def _stream() -> list[tuple[bytes, bytes]]:
    """Clean records with updates, poison of every kind, values only the row mapper takes."""
    stamps = ["2025-11-30T10:11:12Z", "2025-11-30T10:11:12.345+02:00", "2025-11-30 10:11:12.5"]

    def doc_of(i: int) -> dict:
        return {"id": i % 700, "n": i, "kind": f"k{i % 7}", "amount": round(i / 7, 3) if i % 5 else i,
                "exact": i / 3, "ts": 1_764_460_800_000 + i if i % 2 else stamps[i % 3], "local": i * 1000,
                "plain": i / 8 if i % 3 else i, "ratio": i / 9, "flag": i % 2 == 0, **({"dflt": i} if i % 4 else {}),
                **({"since": stamps[i % 3]} if i % 6 else {}),
                **({"note": {"by": f"u{i}", "tags": [i, None]}} if i % 4 == 0 else {}),  # no column reads it
                "by": {"name": f"u{i % 13}"} if i % 5 else None, "doc": [i, {"k": i / 4}] if i % 3 else None}

    def special(i: int, doc: dict) -> bytes | None:
        if i == 17:
            return orjson.dumps({**doc, "n": "12"})  # text for an integer column: only the row mapper takes it
        if i % 1000 == 19:
            return orjson.dumps({**doc, "ts": "2025-02-30T00:00:00Z"})  # no such day: poison
        if i == 1023:
            return orjson.dumps(doc)[:-1] + b', "zz": 1e400}'  # beyond a double, in a key no column reads: poison
        return None

    return columnar_stream(doc_of, special)


def _run(tmp_path, name, bootstrap, topic, dsn, columnar, lanes=1):
    stats, dlq = run_pipeline_on_off(tmp_path, bootstrap, topic, dsn, {
        "name": name, "lanes": lanes,
        "sink": {"kind": "postgres", "dsn": dsn, "table": name, "conflict_key": ["id"], "columns": COLUMNS},
        "dlq": {"kind": "postgres", "table": f"{name}_dlq"},
    }, columnar)
    return stats, _stored(dsn, name), dlq


@pytest.mark.parametrize("lanes", [1, 2])
def test_columnar_run_writes_and_dead_letters_what_the_row_path_does(kafka_bootstrap, pg_dsn, new_topic, tmp_path,
                                                                     lanes):
    """With two lanes too: the accept loop routes each record by the plan's lane keys (the row path's)."""
    topic = new_topic(3)
    records = _stream()
    assert produce(kafka_bootstrap, topic, records) == len(records)
    rows_stats, rows, rows_dlq = _run(tmp_path, "rows", kafka_bootstrap, topic, pg_dsn, False, lanes)
    col_stats, cols, col_dlq = _run(tmp_path, "cols", kafka_bootstrap, topic, pg_dsn, None, lanes)  # the default: on
    assert len(rows) == 700
    differ = [(a, b) for a, b in zip(cols, rows, strict=True) if a[:-2] != b[:-2]]
    assert not differ, differ[:3]  # the source columns name each run's own stream
    assert [r[-1] for r in cols] == [r[-1] for r in rows]
    assert col_dlq == rows_dlq and len(rows_dlq) > 50
    assert col_stats["dead_lettered"] == rows_stats["dead_lettered"] == len(rows_dlq)
    assert rows_stats["columnar_records"] == 0
    assert rows_stats["write_tier"] == "rows (columnar: false)" and col_stats["write_tier"] == "columnar"
    # Batches holding a value only the row mapper takes go by rows; the rest (ISO timestamps
    # included) are written columnar.
    assert 0 < col_stats["columnar_records"] < col_stats["records_consumed"] == len(records)
    assert col_stats["columnar_records"] >= len(records) // 2, col_stats


VERSIONED = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "n": {"type": "integer", "source": "$.n"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
    "ver": {"type": "bigint", "source": "$.ver"},
}


def _versioned_stream(version_type: str) -> list[tuple[bytes, bytes]]:
    """Updates whose versions go up and down (a key's later record is often older), ties included."""
    def version(i: int):
        v = (i * 7919) % 1009 // 3
        return v if version_type == "bigint" else f"2025-11-30T10:{v // 60 % 60:02d}:{v % 60:02d}.{i % 7}+01:00"

    return columnar_stream(lambda i: {"id": i % 700, "n": i, "ts": 1_764_460_800_000 + i, "ver": version(i)})


@pytest.mark.parametrize(("version_type", "lanes"), [("bigint", 2), ("timestamptz", 1)])
def test_with_a_version_column_the_columnar_run_writes_what_the_row_path_does(kafka_bootstrap, pg_dsn, new_topic,
                                                                              tmp_path, version_type, lanes):
    """Issue #38 item 3: the highest version of a key wins inside a batch and the upsert's version
    guard holds across batches (a later batch's older version does not overwrite), as by rows."""
    topic = new_topic(3)
    records = _versioned_stream(version_type)
    assert produce(kafka_bootstrap, topic, records) == len(records)
    columns = {**VERSIONED, "ver": {"type": version_type, "source": "$.ver"}}
    out = {}
    for name, columnar in (("vrows", False), ("vcols", None)):
        stats, dlq = run_pipeline_on_off(tmp_path, kafka_bootstrap, topic, pg_dsn, {
            "name": name, "lanes": lanes,
            "sink": {"kind": "postgres", "dsn": pg_dsn, "table": name, "conflict_key": ["id"],
                     "version_column": "ver", "columns": columns},
            "dlq": {"kind": "postgres", "table": f"{name}_dlq"},
        }, columnar)
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(f"SELECT id, n, ts::text, ver::text, _ingest_offset FROM {name} ORDER BY id").fetchall()
        out[name] = (stats, rows, dlq)
    (rows_stats, rows, rows_dlq), (col_stats, cols, col_dlq) = out["vrows"], out["vcols"]
    assert len(rows) == 700 and cols == rows
    assert col_dlq == rows_dlq and len(rows_dlq) > 50
    assert col_stats["write_tier"] == "columnar" and col_stats["columnar_records"] >= len(records) // 2, col_stats
    # the versions mattered: some key's row is not its last record's
    last = {}
    for i, (key, _) in enumerate(records):
        last[int(key)] = i
    assert any(n != last[key] for key, n, *_ in rows)
