"""The columnar tier for change data capture (``envelope: debezium``, hard deletes) against the row path,
on the real broker and PostgreSQL (issue #38 item 1).

A simulated source table's Debezium stream (``harness.cdc_source``: inserts, updates, deletes with and
without a ``before`` image, their tombstones, key changes, short-lived rows), with the JSON converter's
schema part and without, and hostile records mixed in (undecodable values, unknown and truncate ops,
values only the row mapper takes or refuses, deletes without a key), run by ``ingest run`` with the tier
on and off: the same table, the same tombstone table, the same DLQ entries (offset, stage, error class),
offsets committed at the log end -- and the tier took most records (``columnar_records``), which it did
not before (the test that fails first).
"""

from __future__ import annotations

from typing import Any

import orjson
import psycopg
import pytest
from harness.cdc_source import SourceTable, fields_for, partition_of, produce_stream
from harness.debezium import encode_event
from pipeline_helpers import run_pipeline_on_off

COLUMNS = {
    "id": {"type": "bigint"},
    "name": {"type": "text"},
    "qty": {"type": "integer"},
    "updated_at": {"type": "timestamptz"},
    "lsn": {"type": "bigint", "source": "@source.lsn"},
}
PARTITIONS = 3


def _envelope(op: str, before: Any, after: Any, lsn: int | None, schemas: bool) -> bytes:
    """A change event as the stream's, with the stream's schema part when ``schemas`` (its values taken as
    they are: hostile ones too)."""
    payload = {"before": before, "after": after, "op": op, "ts_ms": 1,
               "source": {"connector": "postgresql", "lsn": lsn, "ts_ms": 1}}
    if schemas:
        event = orjson.loads(encode_event("c", None, {"id": 1}, fields=fields_for("string"), lsn=1, ts_ms=1,
                                          schemas=True))
        return orjson.dumps({"schema": event["schema"], "payload": payload})
    return orjson.dumps(payload)


def _stream(schemas: bool) -> list[tuple]:
    """About 2400 records over 250 keys: the source table's stream with hostile records spliced in (each
    in its key's partition, so its place in the key's order is what the row path sees too)."""
    source = SourceTable(38, keys=250, partitions=PARTITIONS, delete_frac=0.2, schemas=schemas, encoding="string",
                         rekey_frac=0.02, null_before_frac=0.05, short_lived_frac=0.01)
    records = source.events(2000)
    out: list[tuple] = []
    for i, record in enumerate(records):
        out.append(record)
        key_id = 10_000 + i
        key = orjson.dumps({"id": key_id})
        part = partition_of(key_id, PARTITIONS)
        hostile = None
        if i % 97 == 3:
            hostile = b'{"before": null, "after": {"id": 1'  # undecodable
        elif i % 101 == 5:
            hostile = _envelope("x", None, {"id": key_id}, 5, schemas)  # an op Debezium never writes
        elif i % 211 == 7:
            hostile = _envelope("t", None, None, 5, schemas)  # a truncate (ignored by default)
        elif i % 89 == 11:
            hostile = _envelope("u", None, {"id": key_id, "qty": 2**40}, 5 + i, schemas)  # out of range: poison
        elif i == 1013:  # text for an integer: only the row mapper takes it (its batch goes by rows)
            hostile = _envelope("c", None, {"id": key_id, "qty": "12"}, 5 + i, schemas)
        elif i % 79 == 17:
            hostile = _envelope("d", {"name": "no id"}, None, 5 + i, schemas)  # a delete without its key: poison
        elif i % 73 == 19:
            hostile = _envelope("c", None, None, 5 + i, schemas)  # an insert without an after image: poison
        elif i % 71 == 23:
            hostile = _envelope("c", None, {"id": key_id, "name": "nul\x00"}, 5 + i, schemas)  # NUL: poison
        elif i % 67 == 29:
            hostile = _envelope("d", {"id": key_id}, None, None, schemas)  # a delete without its version
        if hostile is not None:
            out.append((key, hostile, part, None))
    return out


def _run(tmp_path, name, bootstrap, topic, dsn, columnar) -> tuple[dict, list, list, list]:
    stats, dlq = run_pipeline_on_off(tmp_path, bootstrap, topic, dsn, {
        "name": name, "envelope": "debezium", "deletes": {"mode": "hard"},
        "sink": {"kind": "postgres", "dsn": dsn, "table": name, "conflict_key": ["id"], "version_column": "lsn",
                 "columns": COLUMNS},
        "dlq": {"kind": "postgres", "table": f"{name}_dlq"},
    }, columnar)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT id, name, qty, updated_at::text, lsn FROM {name} ORDER BY id").fetchall()
        tombs = conn.execute(f"SELECT id, lsn, _ingest_offset FROM {name}_ingest_deleted ORDER BY id").fetchall()
    return stats, rows, tombs, dlq


@pytest.mark.parametrize("schemas", [False, True])
def test_a_cdc_run_on_the_columnar_tier_writes_what_the_row_path_does(kafka_bootstrap, pg_dsn, new_topic, tmp_path,
                                                                      schemas):
    topic = new_topic(PARTITIONS)
    records = _stream(schemas)
    assert produce_stream(kafka_bootstrap, topic, records) == len(records)
    tag = "s" if schemas else "p"
    rows_stats, rows, rows_tombs, rows_dlq = _run(tmp_path, f"cdcrows{tag}", kafka_bootstrap, topic, pg_dsn, False)
    col_stats, cols, col_tombs, col_dlq = _run(tmp_path, f"cdccols{tag}", kafka_bootstrap, topic, pg_dsn, None)
    assert len(rows) > 100 and cols == rows
    # A deleted key's tombstone is the same; a key deleted and upserted again keeps a tombstone only when
    # its delete and its upsert were in different batches, which the runs' batch boundaries decide
    # (timing, not the tier), so such tombstones are held to what they guard: older than the row.
    present = {row[0]: row[-1] for row in rows}
    assert len(rows_tombs) > 100
    assert [t for t in col_tombs if t[0] not in present] == [t for t in rows_tombs if t[0] not in present]
    assert all(t[1] is None or t[1] < present[t[0]] for t in col_tombs + rows_tombs if t[0] in present)
    assert col_dlq == rows_dlq and len(rows_dlq) > 50
    for counter in ("dead_lettered", "skipped", "records_consumed"):  # rows_written/_deleted: after collapse, by batch
        assert col_stats[counter] == rows_stats[counter], (counter, col_stats, rows_stats)
    assert col_stats["rows_deleted"] > 100 and rows_stats["rows_deleted"] > 100
    assert rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar", col_stats["write_tier"]
    assert col_stats["columnar_records"] >= len(records) // 2, col_stats
