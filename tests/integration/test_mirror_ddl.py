"""Mirrored tables' DDL (ingest.mirror.ddl) against the real databases.

PostgreSQL: the harness's server, a fresh database per test (``pg_dsn``). ClickHouse: the real server
the harness starts (``clickhouse_url``: Debian's 18.16 here, so these tests use its types and no
deduplication-window setting; a modern server from ``INGEST_TEST_CLICKHOUSE_URL`` takes the same
tests) and, for the types and engine only a modern ClickHouse has (``Bool``, ``DateTime64``,
``ReplacingMergeTree(version, is_deleted)``), chDB in-process (``chdb``).

Covered: create from a shape and read it back, re-create as a no-op, dry runs, added columns, the
widening list, incompatible tables left untouched, hostile names (quotes, backquotes, SQL, unicode; a
200-character name refused by the sanitiser; a second spelling refused by the guard seeded from the
catalog), a CREATE losing a race to a creator that takes no lock, and two processes racing to create
and alter the same tables (both succeed, the final shapes are right).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from harness.clickhouse import http_client, needs_shim

from ingest.mirror.ddl import (
    ClickHouseTable,
    DdlResult,
    clickhouse_tables,
    ensure_clickhouse,
    ensure_postgres,
    read_clickhouse_shape,
    postgres_tables,
    read_postgres_shape,
)
from ingest.mirror.errors import Unroutable
from ingest.mirror.names import CLICKHOUSE, POSTGRES, NameGuard, sanitize_table
from ingest.mirror.shape import Column, Shape, shape_from_avro, shape_from_connect
from ingest.mirror.types import normalize_type

HOSTILE = 'We"ird; DROP TABLE x;-- `tick` é 表'


def shape(dialect: str, key: tuple[str, ...] = ("id",), **cols: tuple[str, bool]) -> Shape:
    return Shape(dialect, tuple(Column(n, t, nl) for n, (t, nl) in cols.items()), key)


def layout(s: Shape | None) -> tuple[tuple[tuple[str, str, bool], ...], tuple[str, ...]]:
    """Columns as (name, normalised type, nullable), and the key: what a catalog read can be compared by."""
    assert s is not None
    return tuple((c.name, normalize_type(c.type, s.dialect), c.nullable) for c in s.columns), s.key


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Poll until ``condition`` holds (a precondition of the next step, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


# =========================================================================== PostgreSQL

DEBEZIUM_VALUE = {"type": "struct", "name": "db.Envelope", "fields": [
    {"type": "struct", "optional": True, "field": "after", "name": "db.Value", "fields": [
        {"type": "int64", "optional": False, "field": "id"},
        {"type": "string", "optional": True, "field": "name"},
        {"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
         "parameters": {"scale": "2", "connect.decimal.precision": "12"}, "field": "price"},
        {"type": "struct", "optional": True, "name": "io.debezium.data.VariableScaleDecimal", "fields": [],
         "field": "amount"},
        {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "field": "created"},
        {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "field": "changed"},
        {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "field": "day"},
        {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTime", "field": "clock"},
        {"type": "string", "optional": True, "name": "io.debezium.data.Uuid", "field": "uid"},
        {"type": "boolean", "optional": False, "field": "ok"},
        {"type": "int16", "optional": True, "field": "small"},
        {"type": "float32", "optional": True, "field": "ratio"},
        {"type": "bytes", "optional": True, "field": "blob"},
        {"type": "array", "optional": True, "items": {"type": "int32", "optional": True}, "field": "tags"},
        {"type": "map", "optional": True, "keys": {"type": "string"}, "values": {"type": "string"}, "field": "attrs"},
    ]}]}
DEBEZIUM_KEY = {"type": "struct", "name": "db.Key", "fields": [{"type": "int64", "optional": False, "field": "id"}]}


@pytest.fixture
def pg(pg_dsn: str):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def test_postgres_create_from_a_debezium_schema_read_back_and_recreate_as_a_no_op(pg) -> None:
    wanted = shape_from_connect(DEBEZIUM_VALUE, POSTGRES, key_schema=DEBEZIUM_KEY)
    dry = ensure_postgres(pg, "mirror", "items", wanted, dry_run=True)
    assert dry.action == "created" and dry.dry_run and any("CREATE TABLE" in s for s in dry.statements)
    assert read_postgres_shape(pg, "mirror", "items") is None  # a dry run runs nothing

    made = ensure_postgres(pg, "mirror", "items", wanted)
    assert made.action == "created" and made.statements == dry.statements
    assert layout(read_postgres_shape(pg, "mirror", "items")) == layout(wanted)
    assert layout(made.shape) == layout(wanted)
    again = ensure_postgres(pg, "mirror", "items", wanted)
    assert again.action == "unchanged" and again.statements == ()
    pg.execute("INSERT INTO mirror.items (id, ok, price, created, tags) VALUES (1, true, 12.34, now(), '[1, null]')")


def test_postgres_adds_the_columns_a_new_schema_has_and_keeps_the_rows(pg) -> None:
    v1 = shape(POSTGRES, id=("bigint", False), name=("text", True))
    v2 = shape(POSTGRES, id=("bigint", False), name=("text", True), qty=("integer", False), doc=("jsonb", True))
    ensure_postgres(pg, "public", "t", v1)
    pg.execute("INSERT INTO t VALUES (1, 'a')")
    assert ensure_postgres(pg, "public", "t", v2, "off").action == "incompatible"
    dry = ensure_postgres(pg, "public", "t", v2, dry_run=True)
    assert dry.action == "altered" and len(dry.statements) == 1 and dry.statements[0].startswith("ALTER TABLE")
    done = ensure_postgres(pg, "public", "t", v2)
    assert done.action == "altered" and done.statements == dry.statements
    assert layout(done.shape) == ((("id", "bigint", False), ("name", "text", True), ("qty", "integer", True),
                                   ("doc", "jsonb", True)), ("id",))
    assert pg.execute("SELECT id, name, qty, doc FROM t").fetchall() == [(1, "a", None, None)]
    # the field that disappears leaves its column, written as NULL
    assert ensure_postgres(pg, "public", "t", v1).action == "unchanged"


def test_postgres_widens_along_the_list_only_when_asked(pg) -> None:
    pg.execute("CREATE TABLE w (id integer PRIMARY KEY, code varchar(5), amount numeric(6,2), r real, "
               "gone text NOT NULL)")
    pg.execute("INSERT INTO w VALUES (1, 'abc', 1.5, 0.5, 'x')")
    wanted = shape(POSTGRES, id=("bigint", False), code=("text", True), amount=("numeric(12,2)", True),
                   r=("double precision", True))
    refused = ensure_postgres(pg, "public", "w", wanted, "add_columns")
    assert refused.action == "incompatible" and refused.incompatible is not None
    assert len(refused.incompatible.differences) == 5  # four widenings and the NOT NULL column that is gone
    assert layout(refused.shape) == layout(read_postgres_shape(pg, "public", "w"))  # nothing ran
    done = ensure_postgres(pg, "public", "w", wanted, "add_and_widen")
    assert done.action == "altered"
    assert layout(read_postgres_shape(pg, "public", "w")) == (
        (("id", "bigint", False), ("code", "text", True), ("amount", "numeric(12,2)", True),
         ("r", "double precision", True), ("gone", "text", True)), ("id",))
    pg.execute("INSERT INTO w (id, code, amount) VALUES (5000000000, 'a much longer code', 1234567890.12)")
    assert ensure_postgres(pg, "public", "w", wanted, "add_and_widen").action == "unchanged"


def test_postgres_incompatible_tables_are_left_as_they_are(pg) -> None:
    ensure_postgres(pg, "public", "inc", shape(POSTGRES, id=("bigint", False), v=("bigint", True)))
    before = read_postgres_shape(pg, "public", "inc")
    for wanted in (shape(POSTGRES, id=("bigint", False), v=("text", True)),  # a type change
                   shape(POSTGRES, key=("id", "v"), id=("bigint", False), v=("bigint", False)),  # a key change
                   shape(POSTGRES, key=(), id=("bigint", True), v=("bigint", True))):  # keyless records
        result = ensure_postgres(pg, "public", "inc", wanted, "add_and_widen")
        assert result.action == "incompatible" and result.statements == ()
        assert str(result.incompatible)
        assert result.incompatible.error("inc").error_class == "schema_incompatible"
    assert read_postgres_shape(pg, "public", "inc") == before


def test_postgres_hostile_names(pg) -> None:
    table = sanitize_table(HOSTILE + ".x", POSTGRES)
    assert table == HOSTILE + "_x"
    wanted = shape(POSTGRES, key=('i"d',), **{'i"d': ("bigint", False), "na;me --": ("text", True),
                                             "ü ` '": ("jsonb", True)})
    ensure_postgres(pg, 'sch"ema', table, wanted)
    assert layout(read_postgres_shape(pg, 'sch"ema', table)) == layout(wanted)
    pg.execute('INSERT INTO "sch""ema"."We""ird; DROP TABLE x;-- `tick` é 表_x" ("i""d") VALUES (1)')
    grown = wanted.with_columns([Column("new \"col\"", "integer", True)])
    assert ensure_postgres(pg, 'sch"ema', table, grown).action == "altered"
    assert read_postgres_shape(pg, 'sch"ema', table).column('new "col"') is not None
    with pytest.raises(Unroutable) as err:
        sanitize_table("t" * 200, POSTGRES)
    assert err.value.reason == "too_long"
    # a second spelling of a name the catalog already has is refused
    pg.execute('CREATE TABLE "Orders" (id bigint)')
    assert postgres_tables(pg, "public") == ["Orders"]
    guard = NameGuard(POSTGRES, postgres_tables(pg, "public"))
    with pytest.raises(Unroutable) as err:
        guard.claim(sanitize_table("orders", POSTGRES))
    assert err.value.reason == "case_collision"


def test_postgres_a_create_that_loses_a_race_to_a_creator_without_the_lock_is_a_success(pg, pg_dsn) -> None:
    """Another session creates the table (taking no advisory lock) and commits while our CREATE waits on
    its uncommitted catalog row: ours fails with a duplicate, and the next attempt adds the column."""
    wanted = shape(POSTGRES, id=("bigint", False), v=("text", True))
    other = psycopg.connect(pg_dsn)
    try:
        other.execute("CREATE TABLE raced (id bigint PRIMARY KEY)")
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    result["r"] = ensure_postgres(conn, "public", "raced", wanted)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: pg.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                    "AND wait_event_type = 'Lock'").fetchone()[0] > 0, "the CREATE to wait")
        other.commit()
        thread.join(60)
    finally:
        other.close()
    assert "error" not in result, result.get("error")
    r: DdlResult = result["r"]
    assert r.action == "altered" and "ADD COLUMN" in r.statements[-1]
    assert layout(read_postgres_shape(pg, "public", "raced")) == layout(wanted)


# --------------------------------------------------------------------------- two processes racing

RACE_TABLES = ("race_a", "race_b", 'race "c"')


def race_steps(dialect: str) -> list[Shape]:
    """v1; v2 adds two columns; v3 widens one (Int32/integer → 64 bits)."""
    t32, t64, text = ("integer", "bigint", "text") if dialect == POSTGRES else ("Int32", "Int64", "String")
    id_type = "bigint" if dialect == POSTGRES else "Int64"
    v1 = shape(dialect, id=(id_type, False), n=(t32, True), s=(text, True))
    v2 = shape(dialect, id=(id_type, False), n=(t32, True), s=(text, True), extra=(text, True), m=(t32, True))
    v3 = shape(dialect, id=(id_type, False), n=(t64, True), s=(text, True), extra=(text, True), m=(t32, True))
    return [v1, v2, v3]


def _race_worker(kind: str, target: str, order: list[int], barrier: Any, out: Any) -> None:
    try:
        steps = race_steps(POSTGRES if kind == "pg" else CLICKHOUSE)
        if kind == "pg":
            conn = psycopg.connect(target, autocommit=True)
            run = lambda table, s: ensure_postgres(conn, "public", table, s, "add_and_widen")  # noqa: E731
        else:
            client = http_client(target)
            dedup = None if needs_shim(target) else 100
            run = lambda table, s: ensure_clickhouse(  # noqa: E731
                client, ClickHouseTable(table, deduplication_window=dedup), s, "add_and_widen")
        actions = []
        barrier.wait(60)
        for table in RACE_TABLES:
            for i in order:
                r = run(table, steps[i])
                assert r.action != "incompatible", r.incompatible
                actions.append(r.action)
        out.put(("ok", actions))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("error", traceback.format_exc()))


def race(kind: str, target: str) -> list[list[str]]:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    orders = [[0, 1, 2], [1, 0, 2]]  # the second starts from v2, and then asks for v1 (already held)
    procs = [ctx.Process(target=_race_worker, args=(kind, target, o, barrier, out)) for o in orders]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, "\n".join(errors)
    return [r[1] for r in results]


def test_postgres_two_processes_racing_to_create_and_alter_the_same_tables(pg, pg_dsn) -> None:
    actions = race("pg", pg_dsn)
    flat = [a for each in actions for a in each]
    assert flat.count("created") == len(RACE_TABLES)  # the advisory lock: exactly one creator per table
    final = race_steps(POSTGRES)[2]
    for table in RACE_TABLES:
        assert layout(read_postgres_shape(pg, "public", table)) == layout(final)


# =========================================================================== ClickHouse (the server)


@pytest.fixture
def ch(clickhouse_url: str):
    client = http_client(clickhouse_url)
    database = f"mirror_{int(time.time() * 1000) % 10**9}_{threading.get_ident() % 1000}"
    client.command(f"CREATE DATABASE `{database}`")
    try:
        yield client, database, (None if needs_shim(clickhouse_url) else 100)
    finally:
        client.command(f"DROP DATABASE IF EXISTS `{database}`")
        client.close()


def test_clickhouse_create_read_back_recreate_add_and_widen(ch) -> None:
    client, db, dedup = ch
    where = ClickHouseTable("items", database=db, deduplication_window=dedup)
    v1 = shape(CLICKHOUSE, id=("Int64", False), n=("Int32", True), price=("Decimal(12, 2)", True),
               uid=("UUID", True), day=("Date", True), tags=("Array(Nullable(Int32))", False), doc=("JSON", True))
    dry = ensure_clickhouse(client, where, v1, dry_run=True)
    assert dry.action == "created" and read_clickhouse_shape(client, db, "items") is None
    made = ensure_clickhouse(client, where, v1)
    assert made.action == "created"
    read = read_clickhouse_shape(client, db, "items")
    expected = layout(v1.with_columns([Column("_version", "UInt64", False)]))
    assert layout(read) == expected and read.key == ("id",)
    assert ensure_clickhouse(client, where, v1).action == "unchanged"
    client.command(f"INSERT INTO `{db}`.items (id, n, _version) VALUES (1, 2, 3)")

    v2 = v1.with_columns([Column("added", "String", True), Column("more", "Array(String)", False, "[]")])
    assert ensure_clickhouse(client, where, v2, "off").action == "incompatible"
    grown = ensure_clickhouse(client, where, v2)
    assert grown.action == "altered" and all("ADD COLUMN" in s for s in grown.statements)
    assert client.query(f"SELECT id, added, more FROM `{db}`.items").result_rows == [(1, None, [])]

    v3 = Shape(CLICKHOUSE, tuple(Column(c.name, "Int64", c.nullable) if c.name == "n" else c for c in v2.columns),
               ("id",))
    assert ensure_clickhouse(client, where, v3, "add_columns").action == "incompatible"
    widened = ensure_clickhouse(client, where, v3, "add_and_widen")
    assert widened.action == "altered" and "MODIFY COLUMN" in widened.statements[0]
    assert read_clickhouse_shape(client, db, "items").column("n") == Column("n", "Int64", True)
    assert client.query(f"SELECT n FROM `{db}`.items").result_rows == [(2,)]


def test_clickhouse_incompatible_and_keyless_tables(ch) -> None:
    client, db, dedup = ch
    where = ClickHouseTable("inc", database=db, deduplication_window=dedup)
    ensure_clickhouse(client, where, shape(CLICKHOUSE, id=("Int32", False), v=("Int64", True)))
    for wanted in (shape(CLICKHOUSE, id=("Int32", False), v=("String", True)),
                   shape(CLICKHOUSE, id=("Int64", False), v=("Int64", True)),  # a sorting-key column cannot widen
                   shape(CLICKHOUSE, key=("id", "v"), id=("Int32", False), v=("Int64", False))):
        r = ensure_clickhouse(client, where, wanted, "add_and_widen")
        assert r.action == "incompatible" and r.statements == ()
    log = ClickHouseTable("log", database=db, deduplication_window=dedup)
    keyless = shape(CLICKHOUSE, key=(), at=("Date", True), line=("String", True))
    made = ensure_clickhouse(client, log, keyless)
    assert "MergeTree\nORDER BY tuple()" in made.statements[-1]
    assert layout(read_clickhouse_shape(client, db, "log")) == layout(keyless)  # no version column


def test_clickhouse_hostile_names(ch) -> None:
    client, db, dedup = ch
    table = sanitize_table(HOSTILE, CLICKHOUSE, database=db)
    wanted = shape(CLICKHOUSE, key=("i`d",), **{"i`d": ("Int64", False), "na;me, --": ("String", True),
                                               "ü ' \\": ("Int32", True)})
    where = ClickHouseTable(table, database=db, deduplication_window=dedup)
    assert ensure_clickhouse(client, where, wanted).action == "created"
    read = read_clickhouse_shape(client, db, table)
    assert read.key == ("i`d",)
    assert layout(read) == layout(wanted.with_columns([Column("_version", "UInt64", False)]))
    assert ensure_clickhouse(client, where, wanted).action == "unchanged"
    assert clickhouse_tables(client, db) == [table]
    with pytest.raises(Unroutable) as err:
        sanitize_table("t" * 200, CLICKHOUSE, database=db)
    assert err.value.reason == "too_long"


def test_clickhouse_two_processes_racing_to_create_and_alter_the_same_tables(clickhouse_url) -> None:
    client = http_client(clickhouse_url)
    try:
        for table in RACE_TABLES:
            client.command(f"DROP TABLE IF EXISTS `default`.`{table.replace('`', '')}`")
        race("ch", clickhouse_url)
        final = race_steps(CLICKHOUSE)[2].with_columns([Column("_version", "UInt64", False)])
        for table in RACE_TABLES:
            # the column order depends on who created the table (v1 or v2, then _version)
            columns, key = layout(read_clickhouse_shape(client, "default", table))
            assert (sorted(columns), key) == (sorted(layout(final)[0]), final.key)
    finally:
        for table in RACE_TABLES:
            client.command(f"DROP TABLE IF EXISTS `default`.`{table.replace('`', '')}`")
        client.close()


# =========================================================================== ClickHouse (chDB: every type)

AVRO_ALL = {"type": "record", "name": "Row", "fields": [
    {"name": "id", "type": "long"}, {"name": "flag", "type": "boolean"}, {"name": "n", "type": ["null", "int"]},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
    {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "clock", "type": {"type": "long", "logicalType": "time-micros"}},
    {"name": "ts", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}]},
    {"name": "local", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
    {"name": "state", "type": {"type": "enum", "name": "S", "symbols": ["A", "B"]}},
    {"name": "tags", "type": {"type": "array", "items": ["null", "string"]}},
    {"name": "attrs", "type": {"type": "map", "values": "double"}},
    {"name": "sub", "type": ["null", {"type": "record", "name": "Sub", "fields": [{"name": "x", "type": "int"}]}]},
]}


def test_clickhouse_every_type_and_the_deletes_engine_on_a_modern_server(chdb) -> None:
    client = chdb.client()
    where = ClickHouseTable("every", database="mirror", deletes=True)
    key = {"type": "record", "name": "K", "fields": [{"name": "id", "type": "long"}]}
    wanted = shape_from_avro(AVRO_ALL, CLICKHOUSE, key_schema=key)
    made = ensure_clickhouse(client, where, wanted)
    assert made.action == "created"
    assert "ReplacingMergeTree(`_version`, `_ingest_deleted`)" in made.statements[-1]
    assert "non_replicated_deduplication_window = 1000" in made.statements[-1]
    read = read_clickhouse_shape(client, "mirror", "every")
    managed = [Column("_version", "UInt64", False), Column("_ingest_deleted", "UInt8", False)]
    assert layout(read) == layout(wanted.with_columns(managed))
    assert ensure_clickhouse(client, where, wanted).action == "unchanged"
    debezium = shape_from_connect(DEBEZIUM_VALUE, CLICKHOUSE, key_schema=DEBEZIUM_KEY)
    cdc = ensure_clickhouse(client, ClickHouseTable("cdc", database="mirror"), debezium)
    assert cdc.action == "created"
    assert layout(read_clickhouse_shape(client, "mirror", "cdc")) == layout(
        debezium.with_columns([Column("_version", "UInt64", False)]))


# =========================================================================== errors at the boundary


def test_a_lost_postgres_connection_is_transient_and_a_refused_clickhouse_statement_is_a_migration_error(
        pg, pg_dsn, ch) -> None:
    from ingest.errors import MigrationError, TransientError

    victim = psycopg.connect(pg_dsn, autocommit=True)
    try:
        pid = victim.info.backend_pid
        pg.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(TransientError):
            ensure_postgres(victim, "public", "t", shape(POSTGRES, id=("bigint", False)))
    finally:
        victim.close()
    client, db, dedup = ch
    refused = shape(CLICKHOUSE, id=("Int64", False), at=("DateTime64(3, 'No/Such_Zone')", True))
    with pytest.raises(MigrationError, match=r"table mirror_.*\.bad: ClickHouse refused the DDL"):
        ensure_clickhouse(client, ClickHouseTable("bad", database=db, deduplication_window=dedup), refused)
