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
    "price": {"type": "numeric(12,2)"},  # decimal text (decimal.handling.mode=string), or precise (schema part)
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
        event = orjson.loads(encode_event("c", None, {"id": 1}, fields=fields_for("precise"), lsn=1, ts_ms=1,
                                          schemas=True))
        return orjson.dumps({"schema": event["schema"], "payload": payload})
    return orjson.dumps(payload)


def _stream(schemas: bool) -> list[tuple]:
    """About 2400 records over 250 keys: the source table's stream with hostile records spliced in (each
    in its key's partition, so its place in the key's order is what the row path sees too)."""
    # with the schema part, the connector's defaults: precise decimals (base64) and MicroTimestamp, which the
    # schema part decodes to Decimal and datetime
    source = SourceTable(38, keys=250, partitions=PARTITIONS, delete_frac=0.2, schemas=schemas,
                         encoding="precise" if schemas else "string",
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


def read_changes(conn: Any, table: str, select: str, mode: str) -> tuple[list[tuple], list[tuple]]:
    """A change run's table -- ``select`` (the key ``id`` first, the version ``lsn`` last) and, with soft
    deletes, whether the row is live -- and its tombstone table, both by id."""
    soft = ", deleted_at IS NULL" if mode == "soft" else ""
    rows = conn.execute(f'SELECT {select}{soft} FROM "{table}" ORDER BY id').fetchall()
    tombs = conn.execute(f'SELECT id, lsn, _ingest_offset FROM "{table}_ingest_deleted" ORDER BY id').fetchall()
    return rows, tombs


def assert_same_changes(by_rows: tuple, by_cols: tuple, mode: str, produced: int) -> None:
    """Two runs of one change stream, by rows and on the tier, each ``(summary stats, rows, tombstones, DLQ
    rows)`` (rows and tombstones as :func:`read_changes` reads them), wrote the same: the same table, the
    same tombstones (see below), the same DLQ entries and counters; the tier stated and taking at least
    half of the ``produced`` records."""
    (rows_stats, rows, rows_tombs, rows_dlq), (col_stats, cols, col_tombs, col_dlq) = by_rows, by_cols
    assert len(rows) > 100 and cols == rows
    # A deleted key's tombstone is the same; a key deleted and upserted again keeps a tombstone only when
    # its delete and its upsert were in different batches, which the runs' batch boundaries decide
    # (timing, not the tier), so such tombstones are held to what they guard: older than the row.
    lsn = -2 if mode == "soft" else -1
    present = {row[0]: row[lsn] for row in rows if mode == "hard" or row[-1]}  # live rows: their lsn
    assert len(rows_tombs) > 100
    assert [t for t in col_tombs if t[0] not in present] == [t for t in rows_tombs if t[0] not in present]
    assert all(t[1] is None or t[1] < present[t[0]] for t in col_tombs + rows_tombs if t[0] in present)
    assert col_dlq == rows_dlq and len(rows_dlq) > 50
    for counter in ("dead_lettered", "skipped", "records_consumed"):  # rows_written/_deleted: after collapse, by batch
        assert col_stats[counter] == rows_stats[counter], (counter, col_stats, rows_stats)
    assert col_stats["rows_deleted"] > 100 and rows_stats["rows_deleted"] > 100
    assert rows_stats["columnar_records"] == 0
    assert col_stats["write_tier"] == "columnar", col_stats["write_tier"]
    assert col_stats["columnar_records"] >= produced // 2, col_stats


def _run(tmp_path, name, bootstrap, topic, dsn, columnar, lanes, mode,
         delivery: str = "at_least_once") -> tuple[dict, list, list, list]:
    stats, dlq = run_pipeline_on_off(tmp_path, bootstrap, topic, dsn, {
        "name": name, "envelope": "debezium", "deletes": {"mode": mode}, "lanes": lanes,
        "sink": {"kind": "postgres", "dsn": dsn, "table": name, "conflict_key": ["id"], "version_column": "lsn",
                 "columns": COLUMNS, "delivery": delivery},
        "dlq": {"kind": "postgres", "table": f"{name}_dlq"},
    }, columnar)
    with psycopg.connect(dsn) as conn:
        rows, tombs = read_changes(conn, name, "id, name, price::text, qty, updated_at::text, lsn", mode)
    return stats, rows, tombs, dlq


@pytest.mark.parametrize(("schemas", "lanes", "mode", "delivery"), [
    (False, 1, "hard", "at_least_once"), (True, 2, "hard", "at_least_once"), (False, 2, "soft", "at_least_once"),
    (False, 1, "hard", "exactly_once"), (True, 1, "soft", "exactly_once")])
def test_a_cdc_run_on_the_columnar_tier_writes_what_the_row_path_does(kafka_bootstrap, pg_dsn, new_topic, tmp_path,
                                                                      schemas, lanes, mode, delivery):
    """With two lanes too: the accept loop routes each event by its row's key (ChangePlan.lane_keys); and
    exactly once, the changes, tombstones, DLQ rows and offsets of a batch in one transaction."""
    topic = new_topic(PARTITIONS)
    records = _stream(schemas)
    assert produce_stream(kafka_bootstrap, topic, records) == len(records)
    tag = ("s" if schemas else "p") + mode + ("eo" if delivery == "exactly_once" else "")
    by_rows = _run(tmp_path, f"cdcrows{tag}", kafka_bootstrap, topic, pg_dsn, False, lanes, mode, delivery)
    by_cols = _run(tmp_path, f"cdccols{tag}", kafka_bootstrap, topic, pg_dsn, None, lanes, mode, delivery)
    assert_same_changes(by_rows, by_cols, mode, len(records))


# --------------------------------------------------------------------------- batch by batch, exactly

DIFF_COLUMNS = {
    "id": {"type": "bigint"},
    "name": {"type": "text"},
    "price": {"type": "numeric(12,2)"},  # decimal text (decimal.handling.mode=string), or precise (schema part)
    "qty": {"type": "integer"},
    "price": {"type": "numeric(12,2)"},
    "updated_at": {"type": "timestamptz"},
    "doc": {"type": "jsonb"},
    "lsn": {"type": "bigint", "source": "@source.lsn"},
}


def _diff_pipeline(dsn: str, table: str, mode: str = "hard") -> Any:
    from ingest.config import PipelineSettings

    return PipelineSettings.model_validate({
        "name": table, "topics": ["t"], "envelope": "debezium", "deletes": {"mode": mode},
        "sink": {"kind": "postgres", "dsn": dsn, "table": table, "conflict_key": ["id"], "version_column": "lsn",
                 "columns": DIFF_COLUMNS}})


def _event_strategy() -> Any:
    from hypothesis import strategies as st

    key = st.integers(0, 3)
    lsn = st.integers(1, 6)
    image = st.fixed_dictionaries({"id": key}, optional={
        "name": st.one_of(st.none(), st.text(max_size=4), st.just("nul\x00")),
        "qty": st.one_of(st.none(), st.integers(-3, 3), st.just(2**31), st.just("7"), st.just(1.5)),
        "price": st.one_of(st.none(), st.floats(-1e6, 1e6, allow_nan=False), st.integers(-10**9, 10**9),
                           st.sampled_from(["12.345", "007.50", "-0.00", "0.005", "-99999.995", "1e3", " 1", "abc",
                                            "+1", ".5", "1."])),
        "updated_at": st.one_of(st.none(), st.integers(0, 2**41), st.just("2025-11-30T10:11:12.5+05:30"),
                                st.just("not a time")),
        "doc": st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=2), st.just({"a": [1, None]})),
    })
    upsert = st.tuples(st.sampled_from("cur"), image, lsn)
    delete = st.tuples(st.just("d"), st.one_of(st.builds(lambda k: {"id": k}, key), st.builds(lambda k: {"id": k}, key),
                                               st.none(), st.just({"name": "no key"})), lsn)
    other = st.sampled_from([("tombstone", None, 0), ("t", None, 0), ("x", None, 0), ("garbage", None, 0),
                             ("d", {"id": 1}, None)])
    plain = st.tuples(st.sampled_from("cur"), st.builds(lambda k, n: {"id": k, "name": n}, key, st.text(max_size=3)), lsn)
    cut = st.integers(0, 3).map(lambda c: c == 0)
    single = st.tuples(st.one_of(plain, plain, upsert, delete, delete, other), key, cut).map(lambda e: [e])
    # an upsert then a delete of its key (a soft delete then carries the upsert's values, when it wins)
    pair = st.tuples(key, st.integers(1, 6), st.integers(-1, 2), st.text(max_size=3)).map(lambda t: [
        (("u", {"id": t[0], "name": t[3]}, t[1]), t[0], False), (("d", {"id": t[0]}, max(1, t[1] + t[2])), t[0], False)])
    return st.lists(st.one_of(single, single, pair), min_size=1, max_size=30).map(
        lambda chunks: [event for chunk in chunks for event in chunk])


def _encode(op: str, image: Any, lsn: Any) -> bytes | None:
    if op == "tombstone":
        return None
    if op == "garbage":
        return b'{"op": "c", "after": {'
    if op == "d":
        return _envelope("d", image, None, lsn, False)
    return _envelope(op, None, image, lsn, False)


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_batch_by_batch_the_change_plan_writes_what_the_row_path_writes(pg_dsn, mode):
    """Hypothesis: any sequence of change events (upserts, deletes with and without a before image, a
    key's versions going up, down and tied, tombstones, truncates, unknown ops, undecodable values,
    values only the row mapper takes or refuses), cut into batches anywhere, written batch by batch by
    the row path into one table and by the change plan into another: after every batch the same poison
    records and records handled without a row, the same rows and deletes counted; at the end the same
    table and the same tombstone table, value for value (soft deletes: the mark set or not, the values
    a deleted row keeps -- an upsert's before its delete in one batch)."""
    from hypothesis import HealthCheck, given, settings

    from ingest.cdc.mapper import mapper_for
    from ingest.core.collapse import collapse
    from ingest.errors import InvalidRecord, NoChange
    from ingest.sinks.postgres.schema import migrate_postgres
    from ingest.sinks.postgres.sink import PostgresSink
    from ingest.types import DeleteRow, ImageDeleteRow, Item, Record

    p_rows, p_cols = _diff_pipeline(pg_dsn, "cdc_diff_rows", mode), _diff_pipeline(pg_dsn, "cdc_diff_cols", mode)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for t in ("cdc_diff_rows", "cdc_diff_cols"):
            conn.execute(f'DROP TABLE IF EXISTS "{t}", "{t}_ingest_deleted"')
    migrate_postgres(p_rows)
    migrate_postgres(p_cols)
    by_rows = PostgresSink(p_rows.sink, pool_size=1, deletes=p_rows.deletes)
    by_cols = PostgresSink(p_cols.sink, pool_size=1, deletes=p_cols.deletes)
    rule = p_rows.collapse_rule()  # soft deletes merge (ImageDeleteRow)
    row_mapper, plan_mapper = mapper_for(p_rows), mapper_for(p_cols)
    plan = plan_mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None
    by_cols.use_columnar(plan.columns)
    taken = {"batches": 0, "deletes": 0, "images": 0}

    def outcome(mapper: Any, record: Record) -> tuple[str, Any]:
        try:
            return "row", mapper.map(record)[0]
        except InvalidRecord as exc:
            return "poison", (exc.stage, exc.error_class, exc.message)
        except NoChange:
            return "unchanged", None

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_event_strategy())
    def check(events: list[tuple[tuple[str, Any, Any], int, bool]]) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for t in ("cdc_diff_rows", "cdc_diff_cols"):
                conn.execute(f'TRUNCATE "{t}", "{t}_ingest_deleted"')
        batches: list[list[Record]] = [[]]
        for offset, ((op, image, lsn), key_id, cut) in enumerate(events):
            key = orjson.dumps({"id": key_id})
            batches[-1].append(Record("t", 0, offset, key, _encode(op, image, lsn), None))
            if cut:
                batches.append([])
        for records in batches:
            if not records:
                continue
            outcomes = [outcome(row_mapper, r) for r in records]
            items = [Item(r, row, None, 0, 1) for r, (what, row) in zip(records, outcomes) if what == "row"]
            _, groups = collapse(items, rule)
            winners = [g[0].row for g in groups]
            by_rows.write(winners)
            built = plan.build(records)
            if built is None:
                by_cols.write(winners)  # declined: the tier writes it by rows
                continue
            by_plan = {i: outcome(plan_mapper, records[i]) for i in built.rejected}
            if any(what == "row" for what, _ in by_plan.values()):
                by_cols.write(winners)  # a rejected record maps after all: by rows
                continue
            # every record the plan took maps to a row; the others are the row path's poison and no-ops
            assert {i: o for i, o in enumerate(outcomes) if o[0] != "row"} == by_plan
            rows = built.table.num_rows if built.table is not None else 0
            deletes = sum(isinstance(w, DeleteRow) for w in winners)  # image deletes too (the writer counts so)
            assert rows == len(winners)
            if built.table is not None:
                assert sum(built.table.column("_ingest_deleted").to_pylist()) == deletes
                images = sum(type(w) is ImageDeleteRow for w in winners)
                assert sum(built.table.column("_ingest_image").to_pylist()) == images
                taken["images"] += images
            by_cols.write_encoded(by_cols.encode_columns(built.table))
            taken["batches"] += 1
            taken["deletes"] += deletes
        with psycopg.connect(pg_dsn) as conn:
            soft = ", deleted_at IS NULL" if mode == "soft" else ""
            for query in ('SELECT id, name, qty, price::text, updated_at::text, doc::text, lsn, _ingest_offset'
                          + soft + ' FROM "{t}" ORDER BY id', 'SELECT id, lsn, _ingest_offset FROM "{t}_ingest_deleted" ORDER BY id'):
                assert (conn.execute(query.format(t="cdc_diff_cols")).fetchall()
                        == conn.execute(query.format(t="cdc_diff_rows")).fetchall())

    try:
        check()
    finally:
        by_rows.close()
        by_cols.close()
    assert taken["batches"] > 20 and taken["deletes"] > 10, taken  # the plan wrote batches, deletes among them
    assert mode == "hard" or taken["images"] > 3, taken


def test_lane_keys_route_each_event_as_the_row_path_routes_it():
    """Every event the change plan routes that maps to a row goes to the lane of its row's key (the accept
    loop's ``key_bytes(row key)``); the others are left to the row mapper (UNROUTED), or are poison."""
    from ingest.cdc.mapper import mapper_for
    from ingest.core.mapping.columnar import UNROUTED
    from ingest.core.routing import key_bytes
    from ingest.errors import IngestError
    from ingest.types import Record

    p = _diff_pipeline("postgresql://x@127.0.0.1/x", "routing")
    rule = p.sink.collapse_rule()
    mapper = mapper_for(p)
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None and plan.route_refusal is None
    records = [Record("t", part, offset, key, value, None)
               for offset, (key, value, part, _) in enumerate(_stream(False)[:1500])]
    keys = plan.lane_keys(records)
    routed = 0
    for record, key in zip(records, keys, strict=True):
        if key is UNROUTED:
            continue
        try:
            row, _ = mapper.map(record)
        except IngestError:  # poison touches no row: its lane does not matter
            continue
        routed += 1
        assert key == key_bytes(row[0]), record
    assert routed > len(records) // 2


def test_the_row_path_soft_deletes_into_a_table_with_a_jsonb_column(pg_dsn):
    """Found by the differential above: the soft delete that carries its row's values (an upsert before it
    in the batch) inserted the stage's JSON text into the jsonb column uncast -- PostgreSQL refused the
    statement (42804, taken as transient) for every batch holding a delete, so such a pipeline stopped."""
    from ingest.sinks.postgres.schema import migrate_postgres
    from ingest.sinks.postgres.sink import PostgresSink
    from ingest.types import DeleteRow, ImageDeleteRow

    p = _diff_pipeline(pg_dsn, "cdc_soft_json", "soft")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('DROP TABLE IF EXISTS "cdc_soft_json", "cdc_soft_json_ingest_deleted"')
    migrate_postgres(p)
    sink = PostgresSink(p.sink, pool_size=1, deletes=p.deletes)
    try:
        # id, name, qty, price, updated_at, doc, lsn, _ingest_stream, _ingest_offset
        sink.write([(1, "a", 1, None, None, '{"k": [1]}', 5, 9, 1)])
        sink.write([DeleteRow((1, None, None, None, None, None, 6, 9, 2)),
                    ImageDeleteRow((2, "b", 2, None, None, '{"k": 2}', 7, 9, 4))])
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute('SELECT id, doc::text, lsn, deleted_at IS NOT NULL FROM "cdc_soft_json" '
                                "ORDER BY id").fetchall()
        assert rows == [(1, '{"k": [1]}', 6, True), (2, '{"k": 2}', 7, True)]
    finally:
        sink.close()
