"""The ClickHouse sink against real engines.

Two halves, because no modern ClickHouse server can be installed on the
development machines (see ../shared/INFRA.md):

- **Semantics** against modern ClickHouse (26.x) in-process through
  clickhouse-connect's chDB backend (fixture ``chdb``): migrate, columnar
  inserts, the insert token on a retried batch, ReplacingMergeTree + FINAL,
  poison isolation into a PostgreSQL DLQ, every supported type round-tripping,
  and ``ingest run`` end to end as a subprocess that owns its chDB path.
- **The HTTP path** against a real server (fixture ``clickhouse_url``:
  ``INGEST_TEST_CLICKHOUSE_URL``, testcontainers, else Debian's 18.16 started by
  the harness): the too-old-server error from ``ingest check`` / ``ingest run`` /
  the sink, and -- through the test-only 18.16 shim (harness/clickhouse.py) where
  needed -- connection refused and a server restart mid-run: transient,
  retried, nothing lost.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from harness import run_ingest, start_ingest, write_config
from harness.clickhouse import (
    create_table_sql_for,
    http_client,
    needs_shim,
    server_version,
    sink_conn,
    split_url,
)
from harness.kafka import (
    TEST_CONSUMER_SETTINGS,
    committed_offsets,
    log_end_offsets,
    produce,
)
from harness.services import LocalClickHouse, free_port

from ingest.config import PipelineSettings, RetrySettings
from ingest.core.mapping import Mapper
from ingest.dlq.postgres import PostgresDlq
from ingest.errors import (
    IngestError,
    InvalidRecord,
    PermanentError,
    ServiceUnreachable,
    TransientError,
)
from ingest.migrate import migrate_pipeline
from ingest.sinks.clickhouse.errors import PERMANENT_CODES, TRANSIENT_CODES
from ingest.sinks.clickhouse.schema import create_table_sql, migrate_clickhouse
from ingest.sinks.clickhouse.sink import ClickHouseSink
from ingest.types import Failure, Item, Record
from ingest.runner.writer import BatchWriter, Completion

pytestmark = pytest.mark.timeout(180)

UTC = timezone.utc
TOPIC = "events"
FAST_RETRY = RetrySettings(max_attempts=0, initial_backoff_ms=20, max_backoff_ms=300)


# --------------------------------------------------------------------------- helpers


def pipeline(url: str, *, name: str = "ev", table: str = "events", columns: dict[str, Any] | None = None,
             dlq_dsn: str = "postgresql://nobody@127.0.0.1:1/none", **sink: Any) -> PipelineSettings:
    cols = columns or {
        "id": {"type": "UInt64", "required": True},
        "seq": {"type": "UInt64"},
        "small": {"type": "Nullable(UInt8)"},
        "note": {"type": "String", "default": ""},
    }
    return PipelineSettings.model_validate({
        "name": name, "topics": [TOPIC],
        "sink": {"kind": "clickhouse", "url": url, "database": "ingest_test", "table": table,
                 "order_by": ["id"], "columns": cols, **sink},
        "dlq": {"kind": "postgres", "dsn": dlq_dsn},
    })


def record(i: int, value: Any, *, partition: int | None = None, offset: int | None = None) -> Record:
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    return Record(TOPIC, i % 3 if partition is None else partition, i if offset is None else offset,
                  b"k", raw, 1_700_000_000_000 + i)


def items_of(mapper: Mapper, records: Iterable[Record]) -> list[Item]:
    out = []
    for rec in records:
        try:
            row, _ = mapper.map(rec)
            out.append(Item(rec, row, None, 0, len(rec.value or b"")))
        except InvalidRecord as exc:
            out.append(Item(rec, None, Failure(exc.stage, exc.error_class, exc.message), 0,
                            len(rec.value or b"")))
    return out


class ListDlq:
    def __init__(self) -> None:
        self.entries: list[Any] = []

    def put(self, entries: Sequence[Any]) -> None:
        self.entries.extend(entries)

    def close(self) -> None:
        pass


def writer_for(p: PipelineSettings, write: Callable[..., None], dlq: Any = None,
               retry: RetrySettings = FAST_RETRY) -> BatchWriter:
    from ingest.sinks import registry

    return BatchWriter(pipeline=p.name, write=write, dlq=dlq or ListDlq(), retry=retry,
                       collapse_rule=p.sink.collapse_rule(), abort=threading.Event(),
                       insert_tokens=registry.backend(p.sink.kind).capabilities.insert_tokens)


def ok(c: Completion) -> Completion:
    assert c.error is None, repr(c.error)
    return c


def final_rows(client: Any, table: str = "ingest_test.events") -> dict[int, tuple]:
    return {r[0]: tuple(r[1:]) for r in client.query(f"SELECT id, seq, _version FROM {table} FINAL").result_rows}


# --------------------------------------------------------------------------- chDB: migrate


def test_migrate_creates_replacing_merge_tree_idempotently(chdb) -> None:
    p = pipeline(chdb.url)
    lines = migrate_clickhouse(p)
    assert lines == migrate_clickhouse(p)  # idempotent
    assert "ReplacingMergeTree(_version)" in lines[0]
    client = chdb.client()
    engine_full, sorting_key = client.query(
        "SELECT engine_full, sorting_key FROM system.tables WHERE database = 'ingest_test' AND name = 'events'"
    ).result_rows[0]
    assert engine_full.startswith("ReplacingMergeTree(_version)"), engine_full
    assert "non_replicated_deduplication_window = 1000" in engine_full
    assert sorting_key == "id"
    types = dict(client.query("SELECT name, type FROM system.columns WHERE database = 'ingest_test' "
                              "AND table = 'events'").result_rows)
    assert types == {"id": "UInt64", "seq": "UInt64", "small": "Nullable(UInt8)", "note": "String",
                     "_version": "UInt64"}

    # An existing table in another shape is refused, not silently used.
    client.command("CREATE TABLE ingest_test.plain (id UInt64, seq UInt64) ENGINE = MergeTree ORDER BY seq")
    chdb.close()
    with pytest.raises(Exception, match="needs ReplacingMergeTree ORDER BY \\(id\\)"):
        migrate_clickhouse(pipeline(chdb.url, table="plain"))


def test_replicated_ddl_on_cluster() -> None:
    p = pipeline("chdb://memory", cluster="main", order_by=["id", "seq"])
    db, table = create_table_sql(p.sink)
    assert db == "CREATE DATABASE IF NOT EXISTS `ingest_test` ON CLUSTER `main`"
    assert "`ingest_test`.`events` ON CLUSTER `main`" in table
    assert ("ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/ingest_test/events', "
            "'{replica}', `_version`)") in table
    assert "ORDER BY (`id`, `seq`)" in table and "replicated_deduplication_window = 1000" in table


# --------------------------------------------------------------------------- chDB: insert token


def test_retried_batch_with_the_same_token_is_inserted_once(chdb) -> None:
    p = pipeline(chdb.url)
    migrate_clickhouse(p)
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    try:
        rows = [(i, i, None, "x", 100 + i) for i in range(50)]
        sink.write(rows, token="ev-batch-1")
        sink.write(rows, token="ev-batch-1")  # the retry of a batch whose answer was lost
        client = sink.client()
        assert client.command("SELECT count() FROM ingest_test.events") == 50  # no second part at all
        sink.write(rows, token="ev-batch-2")  # the same rows in another batch: stored again...
        assert client.command("SELECT count() FROM ingest_test.events") == 100
        assert client.command("SELECT count() FROM ingest_test.events FINAL") == 50  # ...and collapsed
    finally:
        sink.close()


def test_writer_passes_a_deterministic_token_and_a_lost_answer_is_not_a_duplicate(chdb) -> None:
    """The insert lands but its answer is lost (TransientError after the insert): the writer
    retries with the same token and ClickHouse drops the second insert."""
    p = pipeline(chdb.url)
    migrate_clickhouse(p)
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    tokens: list[str] = []
    lost = {"left": 1}

    def write(rows: Sequence[tuple], *, token: str | None = None) -> None:
        tokens.append(token or "")
        sink.write(rows, token=token)
        if lost["left"]:
            lost["left"] -= 1
            raise TransientError("connection reset after the insert", error_class="connection")

    mapper = Mapper(p.sink.columns)
    items = items_of(mapper, [record(i, {"id": i % 40, "seq": i}) for i in range(200)])
    try:
        c = ok(writer_for(p, write).handle(0, items, "size"))
        assert c.retries == 1 and len(tokens) == 2 and tokens[0] == tokens[1]
        assert tokens[0].startswith("ev-")
        client = sink.client()
        assert client.command("SELECT count() FROM ingest_test.events") == 40  # collapsed in the batch, once
        # The same records again (a replay after a crash, same batch): same token, nothing new.
        ok(writer_for(p, write).handle(0, list(reversed(items)), "size"))
        assert tokens[-1] == tokens[0]
        assert client.command("SELECT count() FROM ingest_test.events") == 40
    finally:
        sink.close()


# --------------------------------------------------------------------------- chDB: FINAL


def test_final_gives_one_row_per_key_with_the_last_value(chdb) -> None:
    p = pipeline(chdb.url)
    migrate_clickhouse(p)
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    mapper = Mapper(p.sink.columns)
    writer = writer_for(p, sink.write)
    rng = random.Random(6)
    # One partition: offsets order the records, so the default version (the offset) is "last wins".
    recs = [record(i, {"id": rng.randrange(300), "seq": i}, partition=0) for i in range(3000)]
    expected = {}
    for r in recs:
        expected[orjson.loads(r.value)["id"]] = (orjson.loads(r.value)["seq"], r.offset)
    try:
        for start in range(0, len(recs), 500):
            ok(writer.handle(0, items_of(mapper, recs[start:start + 500]), "size"))
        # A stale replay of early records, batched differently (so another token: stored again),
        # must not win over the later values: their versions (offsets) are older.
        ok(writer.handle(0, items_of(mapper, recs[:250]), "size"))
        client = sink.client()
        assert final_rows(client) == expected
        client.command("OPTIMIZE TABLE ingest_test.events FINAL")
        assert client.command("SELECT count() FROM ingest_test.events") == len(expected)
    finally:
        sink.close()


# --------------------------------------------------------------------------- chDB: poison isolation


def test_poison_rows_go_to_the_postgres_dlq_and_the_rest_lands(chdb, pg_dsn) -> None:
    p = pipeline(chdb.url, dlq_dsn=pg_dsn)
    migrate_pipeline(p)  # ClickHouse table + PostgreSQL DLQ table
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    client = sink.client()
    # A rule only the server knows: rows it rejects are found by splitting the batch.
    client.command("ALTER TABLE ingest_test.events ADD CONSTRAINT seq_small CHECK seq < 1000000")
    dlq = PostgresDlq(pg_dsn, "public", "ingest_dlq")
    mapper = Mapper(p.sink.columns)
    values: list[Any] = [{"id": i, "seq": i, "small": i % 200} for i in range(100)]
    values[10] = {"id": 10, "seq": 10, "small": 300}            # out of range for Nullable(UInt8)
    values[20] = {"id": 20, "seq": "twenty"}                    # wrong type for UInt64
    values[30] = {"id": 30, "seq": 30, "note": {"not": "text"}}  # wrong type for String
    values[40] = {"seq": 40}                                    # missing non-Nullable key
    values[50] = b"{not json"                                   # not JSON
    values[60] = {"id": 60, "seq": 5_000_000}                   # rejected by the server (constraint)
    values[70] = {"id": 70, "seq": 7_000_000}                   # rejected by the server (constraint)
    try:
        c = ok(writer_for(p, sink.write, dlq).handle(0, items_of(mapper, [record(i, v) for i, v in
                                                                          enumerate(values)]), "size"))
        assert c.rows_written == 100 - 7
        assert sorted(i for i, _ in client.query("SELECT id, seq FROM ingest_test.events FINAL").result_rows) == \
            sorted(set(range(100)) - {10, 20, 30, 40, 50, 60, 70})
        with psycopg.connect(pg_dsn) as conn:
            dead = {r[0]: r[1:] for r in conn.execute(
                'SELECT "offset", stage, error_class, error_message FROM ingest_dlq ORDER BY "offset"')}
        assert sorted(dead) == [10, 20, 30, 40, 50, 60, 70]
        assert dead[10][:2] == ("map", "out_of_range") and "300 is out of range for UInt8" in dead[10][2]
        assert dead[20][:2] == ("map", "invalid_value")
        assert dead[30][:2] == ("map", "wrong_type")
        assert dead[40][:2] == ("map", "missing_field")
        assert dead[50][:2] == ("decode", "invalid_json")
        for off in (60, 70):
            assert dead[off][:2] == ("write", "violated_constraint"), dead[off]
            assert "seq_small" in dead[off][2]
        # Isolation cost: 1 + 2*ceil(log2 n) calls per poison row at most, not one per row.
        assert c.write_calls <= 1 + 2 * 2 * 7
    finally:
        sink.close()
        dlq.close()


# --------------------------------------------------------------------------- chDB: every type


ALL_TYPES: dict[str, Any] = {
    "id": {"type": "UInt64"},
    "u8": {"type": "UInt8"}, "u16": {"type": "UInt16"}, "u32": {"type": "UInt32"}, "u64": {"type": "UInt64"},
    "i8": {"type": "Int8"}, "i16": {"type": "Int16"}, "i32": {"type": "Int32"}, "i64": {"type": "Int64"},
    "f32": {"type": "Float32"}, "f64": {"type": "Float64"},
    "dec": {"type": "Decimal(18, 4)"}, "wide": {"type": "Decimal(40, 10)"},
    "s": {"type": "String"}, "lc": {"type": "LowCardinality(String)"}, "b": {"type": "Bool"},
    "d": {"type": "Date"}, "ts": {"type": "DateTime64(3)"}, "uid": {"type": "UUID"},
    "n": {"type": "Nullable(Int32)"}, "ns": {"type": "Nullable(String)"},
    "arr": {"type": "Array(Int64)"}, "arrn": {"type": "Array(Nullable(String))"},
    "nested": {"type": "Array(Array(UInt8))"}, "j": {"type": "JSON"}, "nj": {"type": "Nullable(JSON)"},
}


def _round_trip_docs_and_expected(u: uuid.UUID) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two records covering every type (extremes, NULLs, empties) and the rows ClickHouse gives back."""
    docs = [
        {"id": 1, "u8": 255, "u16": 65535, "u32": 4294967295, "u64": "18446744073709551615",
         "i8": -128, "i16": -32768, "i32": -2147483648, "i64": "-9223372036854775808",
         "f32": 1.5, "f64": -2.25e300, "dec": "12345678901234.5678", "wide": "-123456789012345678901234567890.0123456789",
         "s": "héllo\u0000wörld", "lc": "eu-west", "b": True, "d": "2149-06-06", "ts": "2024-02-29T23:59:59.999+01:00",
         "uid": str(u), "n": -7, "ns": "x", "arr": [1, -2, "3"], "arrn": ["a", None], "nested": [[1, 2], []],
         "j": {"k": [1, "two", None]}, "nj": [True]},
        {"id": 2, "u8": 0, "u16": 0, "u32": 0, "u64": 0, "i8": 127, "i16": 32767, "i32": 2147483647,
         "i64": 9223372036854775807, "f32": 0, "f64": 0.1, "dec": -0.00005, "wide": 0, "s": "", "lc": "",
         "b": "false", "d": "1970-01-01", "ts": 0, "uid": "00000000-0000-0000-0000-000000000000",
         "arr": [], "j": "just a string"},
    ]
    expected = [
        {"id": 1, "u8": 255, "u16": 65535, "u32": 4294967295, "u64": 2**64 - 1, "i8": -128, "i16": -32768,
         "i32": -(2**31), "i64": -(2**63), "f32": 1.5, "f64": -2.25e300, "dec": Decimal("12345678901234.5678"),
         "wide": Decimal("-123456789012345678901234567890.0123456789"), "s": "héllo\x00wörld", "lc": "eu-west",
         "b": True, "d": date(2149, 6, 6), "uid": u, "n": -7, "ns": "x", "arr": [1, -2, 3], "arrn": ["a", None],
         "nested": [[1, 2], []], "j": '{"k":[1,"two",null]}', "nj": "[true]",
         "ts_ms": int(datetime(2024, 2, 29, 22, 59, 59, 999000, tzinfo=UTC).timestamp() * 1000)},
        {"id": 2, "u8": 0, "u16": 0, "u32": 0, "u64": 0, "i8": 127, "i16": 32767, "i32": 2**31 - 1,
         "i64": 2**63 - 1, "f32": 0.0, "f64": 0.1, "dec": Decimal("-0.0001"), "wide": Decimal(0), "s": "", "lc": "",
         "b": False, "d": date(1970, 1, 1), "uid": uuid.UUID(int=0), "n": None, "ns": None, "arr": [],
         "arrn": [], "nested": [], "j": '"just a string"', "nj": None, "ts_ms": 0},
    ]
    return docs, expected


@pytest.mark.parametrize(("table", "with_uuid", "arrow_inserts"), [
    ("typed", True, 0),          # a UUID column keeps the sink on Native
    ("typed_arrow", False, 1),   # every other type goes FORMAT Arrow
])
def test_every_supported_type_round_trips(chdb, table: str, with_uuid: bool, arrow_inserts: int) -> None:
    columns = {k: v for k, v in ALL_TYPES.items() if with_uuid or k != "uid"}
    p = pipeline(chdb.url, table=table, columns=columns)
    migrate_clickhouse(p)
    docs, expected = _round_trip_docs_and_expected(uuid.uuid4())
    if not with_uuid:
        for row in docs + expected:
            row.pop("uid", None)
    mapper = Mapper(p.sink.columns)
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    try:
        ok(writer_for(p, sink.write).handle(0, items_of(mapper, [record(i, d) for i, d in enumerate(docs)]), "size"))
        assert (sink.inserts, sink.arrow_inserts) == (1, arrow_inserts)
        names = [c for c in columns if c != "ts"]
        rows = sink.client().query(
            f"SELECT {', '.join(names)}, toUnixTimestamp64Milli(ts) FROM ingest_test.{table} FINAL ORDER BY id"
        ).result_rows
    finally:
        sink.close()
    assert [dict(zip(names + ["ts_ms"], r)) for r in rows] == expected


def test_uuid_column_keeps_the_sink_on_native_and_native_can_be_forced(chdb) -> None:
    with_uuid = pipeline(chdb.url, table="with_uuid", columns={"id": {"type": "UInt64"}, "uid": {"type": "UUID"}})
    forced = pipeline(chdb.url, table="forced_native", columns={"id": {"type": "UInt64"}, "s": {"type": "String"}},
                      insert_format="native")
    for p, row in ((with_uuid, (7, uuid.UUID(int=7))), (forced, (7, "x"))):
        migrate_clickhouse(p)
        sink = ClickHouseSink(p.sink, pipeline=p.name)
        try:
            sink.write([row + (1,)])  # + the hidden _version column
            assert (sink.inserts, sink.arrow_inserts) == (1, 0)
            assert sink.client().query(f"SELECT id FROM ingest_test.{p.sink.table}").result_rows == [(7,)]
        finally:
            sink.close()


def test_a_batch_arrow_refuses_goes_native_and_fails_the_same_way(chdb) -> None:
    """Arrow never changes what is accepted: a refused value takes the Native path and its error."""
    outcomes = []
    for fmt in ("auto", "native"):
        p = pipeline(chdb.url, table=f"refused_{fmt}", columns={"id": {"type": "UInt64"}, "u8": {"type": "UInt8"}},
                     insert_format=fmt)
        migrate_clickhouse(p)
        sink = ClickHouseSink(p.sink, pipeline=p.name)
        try:
            sink.write([(1, 5, 1)])  # fine either way
            with pytest.raises(IngestError) as info:
                sink.write([(2, 300, 2)])  # no UInt8 can hold it (the mapper would have said so)
            outcomes.append((type(info.value), getattr(info.value, "error_class", None), sink.arrow_inserts))
        finally:
            sink.close()
    assert outcomes[0][:2] == outcomes[1][:2]
    assert [arrow for *_, arrow in outcomes] == [1, 0]  # the good batch went Arrow, the refused one Native


def test_error_tables_match_the_engine(chdb) -> None:
    """Our code -> name tables agree with ClickHouse's own errorCodeToName."""
    codes = sorted({**TRANSIENT_CODES, **PERMANENT_CODES})
    client = chdb.client()
    names = client.query("SELECT " + ", ".join(f"errorCodeToName({c})" for c in codes)).result_rows[0]
    mine = {**TRANSIENT_CODES, **PERMANENT_CODES}
    assert {c: n for c, n in zip(codes, names)} == {c: mine[c] for c in codes}


def test_server_errors_are_classified(chdb) -> None:
    """Real errors from the engine: an unknown column is permanent, a missing table is not the data's fault."""
    p = pipeline(chdb.url)
    migrate_clickhouse(p)
    client = chdb.client()
    client.command("ALTER TABLE ingest_test.events DROP COLUMN note")
    sink = ClickHouseSink(p.sink, pipeline=p.name)
    try:
        with pytest.raises(PermanentError) as info:
            sink.write([(1, 1, None, "", 1)])
        assert info.value.error_class == "no_such_column_in_table", info.value
        client.command("DROP TABLE ingest_test.events")
        with pytest.raises(TransientError) as tinfo:
            sink.write([(1, 1, None, "", 1)])
        assert tinfo.value.error_class == "unknown_table", tinfo.value
    finally:
        sink.close()


# --------------------------------------------------------------------------- end to end: ingest run into chDB


def _e2e_config(tmp_path: Path, bootstrap: str, topic: str, group: str, chdb_path: Path, pg_dsn: str) -> Path:
    return write_config(tmp_path, {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "ev", "topics": [topic], "group_id": group, "lanes": 2, "commit_interval_ms": 200,
            "batch": {"max_rows": 2000, "max_latency_ms": 100},
            "retry": {"max_attempts": 5, "initial_backoff_ms": 50, "max_backoff_ms": 500},
            "sink": {"kind": "clickhouse", "url": f"chdb://{chdb_path}", "database": "ingest_test",
                     "table": "events", "order_by": ["id"],
                     "columns": {"id": {"type": "UInt64", "required": True}, "seq": {"type": "UInt64"},
                                 "small": {"type": "Nullable(UInt8)"}, "note": {"type": "String", "default": ""}}},
            "dlq": {"kind": "postgres", "dsn": pg_dsn},
        }],
    })


def _event_records(n: int, keys: int, seed: int, poison: int = 0
                   ) -> tuple[list[tuple[bytes, bytes]], dict[int, int], set[int]]:
    """``n`` records keyed by str(id) (a key stays in one partition), ids < ``keys``; ``poison``
    of them with ids >= 1e6 that fail mapping. Returns (records, {id: last seq}, poison ids)."""
    rng = random.Random(seed)
    records, last = [], {}
    poison_at = set(rng.sample(range(n), poison))
    poison_ids = set()
    for seq in range(n):
        if seq in poison_at:
            pid = 1_000_000 + seq
            poison_ids.add(pid)
            records.append((str(pid).encode(), orjson.dumps({"id": pid, "seq": seq, "small": 999})))
            continue
        k = rng.randrange(keys)
        last[k] = seq
        records.append((str(k).encode(), orjson.dumps({"id": k, "seq": seq, "small": seq % 200})))
    return records, last, poison_ids


def _produce_events(bootstrap: str, topic: str, n: int, keys: int, seed: int, poison: int = 0
                    ) -> tuple[dict[int, int], set[int]]:
    """Produce :func:`_event_records`; returns ({id: last seq}, poison ids)."""
    records, last, poison_ids = _event_records(n, keys, seed, poison)
    for start in range(0, n, 5000):
        produce(bootstrap, topic, records[start:start + 5000])
    return last, poison_ids




def _assert_end_state(chdb, last: dict[int, int], bootstrap: str, group: str, topic: str) -> None:
    client = chdb.client()
    assert client.command("SELECT count() FROM ingest_test.events FINAL") == len(last)
    got = dict(client.query("SELECT id, seq FROM ingest_test.events FINAL").result_rows)
    assert got == last
    ends = log_end_offsets(bootstrap, topic)
    assert committed_offsets(bootstrap, group, topic) == ends
    chdb.close()


def _ok(res: Any) -> None:
    assert res.returncode == 0, (f"ingest exited {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n"
                                 f"--- stderr ---\n{res.stderr[-6000:]}")


def test_ingest_run_into_chdb_end_to_end(kafka_bootstrap, new_topic, group_id, pg_dsn, chdb, tmp_path) -> None:
    topic = new_topic(6)
    last, poison_ids = _produce_events(kafka_bootstrap, topic, 20_000, 2_500, seed=20_000, poison=25)
    config = _e2e_config(tmp_path, kafka_bootstrap, topic, group_id, chdb.path, pg_dsn)
    _ok(run_ingest(["migrate", "-c", config], timeout_s=60, log_dir=tmp_path))
    summary = tmp_path / "summary.json"
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2", "--summary-json", summary], timeout_s=120,
                   log_dir=tmp_path))
    stats = orjson.loads(summary.read_bytes())["pipelines"]["ev"]
    assert stats["records_consumed"] == 20_000
    _assert_end_state(chdb, last, kafka_bootstrap, group_id, topic)
    with psycopg.connect(pg_dsn) as conn:
        dead = conn.execute("SELECT value, stage, error_class FROM ingest_dlq").fetchall()
    assert {orjson.loads(v)["id"] for v, _, _ in dead} == poison_ids
    assert {(s, e) for _, s, e in dead} == {("map", "out_of_range")}


def test_kill_9_and_restart_mid_run_leaves_the_same_end_state(kafka_bootstrap, new_topic, group_id, pg_dsn, chdb,
                                                              tmp_path) -> None:
    topic = new_topic(6)
    n = 40_000
    records, last, _ = _event_records(n, 4_000, seed=40_000)
    head, chunk = 4_000, 2_000
    produce(kafka_bootstrap, topic, records[:head])

    def rest() -> None:  # the rest of the stream, paced: the run cannot finish before it is all there
        for start in range(head, n, chunk):
            produce(kafka_bootstrap, topic, records[start:start + chunk])
            time.sleep(0.1)

    producer = threading.Thread(target=rest, name="paced-producer", daemon=True)
    config = _e2e_config(tmp_path, kafka_bootstrap, topic, group_id, chdb.path, pg_dsn)
    _ok(run_ingest(["migrate", "-c", config], timeout_s=60, log_dir=tmp_path))
    proc = start_ingest(["run", "-c", config], log_dir=tmp_path)
    deadline = time.monotonic() + 60
    try:
        while True:
            done = sum(committed_offsets(kafka_bootstrap, group_id, topic).values())
            if done > 0 and producer.ident is None:
                producer.start()  # once the run commits: the stream is still growing when it is killed
            if done >= 2_000 and producer.ident is not None:
                break
            assert proc.poll() is None, proc.describe()
            assert time.monotonic() < deadline, proc.describe()
            time.sleep(0.05)
        proc.kill9()
        assert sum(committed_offsets(kafka_bootstrap, group_id, topic).values()) < n, "killed too late"
    finally:
        if producer.ident is None:
            producer.start()
        producer.join(120)
    _ok(run_ingest(["run", "-c", config, "--until-idle", "2"], timeout_s=120, log_dir=tmp_path))
    _assert_end_state(chdb, last, kafka_bootstrap, group_id, topic)


# --------------------------------------------------------------------------- HTTP: a real server


def _http_pipeline(url: str, **kw: Any) -> PipelineSettings:
    conn = sink_conn(url)
    return pipeline(conn.pop("url"), compression="gzip", **conn, **kw)


def test_too_old_server_is_refused_clearly(clickhouse_server, kafka_bootstrap, tmp_path) -> None:
    url = clickhouse_server.endpoint
    p = _http_pipeline(url)
    config = write_config(tmp_path, {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": "ev", "topics": [TOPIC],
            "sink": {"kind": "clickhouse", **sink_conn(url), "compression": "gzip", "table": "events",
                     "order_by": ["id"], "columns": {"id": {"type": "UInt64"}, "seq": {"type": "UInt64"}}},
            "dlq": {"kind": "postgres", "dsn": "postgresql://nobody@127.0.0.1:1/none"},
        }],
    })
    check = run_ingest(["check", "-c", config], timeout_s=60, log_dir=tmp_path)
    if not needs_shim(url):  # a modern server (INGEST_TEST_CLICKHOUSE_URL / Docker): it just works
        assert check.returncode == 0, check.stderr
        ClickHouseSink(p.sink, pipeline=p.name).check()
        return
    version = ".".join(map(str, server_version(url)))
    assert check.returncode == 3, check
    assert f"ClickHouse server version {version}" in check.stderr, check.stderr
    assert "minimum supported 22.8" in check.stderr and "Traceback" not in check.stderr
    run = run_ingest(["run", "-c", config, "--until-idle", "1"], timeout_s=60, log_dir=tmp_path)
    assert run.returncode == 1 and f"ClickHouse server version {version}" in run.stderr, run
    assert "Traceback" not in run.stderr
    migrate = run_ingest(["migrate", "-c", config], timeout_s=60, log_dir=tmp_path)
    assert migrate.returncode == 3 and "minimum supported 22.8" in migrate.stderr, migrate

    # From the sink itself: at construction, from check(), and from the write path when the
    # server was down at construction and comes back too old.
    with pytest.raises(ServiceUnreachable, match=f"version {version} is older than the minimum supported 22.8"):
        ClickHouseSink(p.sink, pipeline=p.name)
    server = clickhouse_server.handle
    if isinstance(server, LocalClickHouse):
        server.stop()
        try:
            sink = ClickHouseSink(p.sink, pipeline=p.name)  # unreachable: tolerated, writes will retry
            with pytest.raises(ServiceUnreachable, match="Connection refused"):
                sink.check()
        finally:
            server.start()
        with pytest.raises(ServiceUnreachable, match=f"version {version}"):
            sink.check()
        with pytest.raises(TransientError, match=f"version {version} is older") as info:
            sink.write([(1, 1, None, "", 1)])
        assert info.value.error_class == "server_too_old"


class TcpProxy:
    """A TCP forwarder whose ``down()`` closes the listener and every connection (refused,
    reset) and ``up()`` listens again on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        for s in [listener, *conns]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _http_outage_run(server_url: str, sink_url: str, outage: Callable[[], None], recover: Callable[[], None]) -> None:
    """Write batches through BatchWriter + ClickHouseSink over HTTP (18.16 shim where needed):
    first while the server is down (connection refused), then with an outage mid-run.
    Every batch completes; the table ends with one row per key and its last value."""
    table = f"outage_{uuid.uuid4().hex[:8]}"
    p = _http_pipeline(sink_url, table=table)
    admin = http_client(server_url)
    for stmt in create_table_sql_for(server_url, create_table_sql(p.sink)):
        admin.command(stmt)
    admin.close()
    sink = ClickHouseSink(p.sink, pipeline=p.name, client_factory=lambda: http_client(sink_url))
    mapper = Mapper(p.sink.columns)
    writer = writer_for(p, sink.write)
    rng = random.Random(7)
    recs = [record(i, {"id": rng.randrange(500), "seq": i}, partition=0) for i in range(12_000)]
    expected = {orjson.loads(r.value)["id"]: orjson.loads(r.value)["seq"] for r in recs}
    batches = [items_of(mapper, recs[s:s + 300]) for s in range(0, len(recs), 300)]
    done: list[Completion] = []
    progress = threading.Event()

    def work(which: Sequence[list[Item]]) -> None:
        for batch in which:
            done.append(writer.handle(0, batch, "size"))
            if len(done) >= 5:
                progress.set()

    try:
        # 1. Connection refused from the very first write (no client yet), then the server returns.
        outage()
        t = threading.Thread(target=work, args=(batches[:1],), daemon=True)
        t.start()
        time.sleep(1.0)
        assert not done, "a write succeeded while the server was down"
        recover()
        t.join(60)
        assert not t.is_alive() and ok(done[0]).retries > 0
        # 2. Outage mid-run: writes in flight fail, are retried, and land once it is back.
        t = threading.Thread(target=work, args=(batches[1:],), daemon=True)
        t.start()
        assert progress.wait(60)
        outage()
        time.sleep(0.5)
        recover()
        t.join(120)
        assert not t.is_alive()
        assert len(done) == len(batches) and all(c.error is None for c in done)
        assert sum(c.retries for c in done[1:]) > 0, "the outage did not hit a write"
        check = http_client(server_url)
        got = dict(check.query(f"SELECT id, seq FROM ingest_test.{table} FINAL").result_rows)
        check.close()
        assert got == expected
    finally:
        sink.close()


def test_http_server_restart_mid_run_loses_nothing(clickhouse_server) -> None:
    url = clickhouse_server.endpoint
    server = clickhouse_server.handle
    if isinstance(server, LocalClickHouse):  # our own server: really stop and restart it
        _http_outage_run(url, url, outage=server.kill, recover=server.start)
    else:  # a server we do not control: cut the network to it instead
        test_http_connection_cut_mid_run_loses_nothing(clickhouse_server)


def test_http_connection_cut_mid_run_loses_nothing(clickhouse_server) -> None:
    url = clickhouse_server.endpoint
    plain, user, password = split_url(url)
    host, port = plain.split("//")[1].rsplit(":", 1)
    proxy = TcpProxy((host, int(port)))
    sink_url = f"http://{user}:{password}@127.0.0.1:{proxy.port}"
    try:
        _http_outage_run(url, sink_url, outage=proxy.down, recover=proxy.up)
    finally:
        proxy.down()
