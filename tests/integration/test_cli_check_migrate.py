"""``ingest --help``, ``ingest check`` and ``ingest migrate`` as subprocesses against real services."""

from __future__ import annotations

import copy
from typing import Any

import psycopg
import pytest
import yaml
from harness import REPO_ROOT, run_ingest, write_config
from harness.services import free_port

EXAMPLE = REPO_ROOT / "config" / "example.yaml"
TIMEOUT = 60
PASSWORD = "s3cr3tPW"

HOSTILE_TABLE = 'weird"; DROP TABLE x; --'
HOSTILE_COLUMN = 'qu"o\'te ünïcødé ✓'


# --------------------------------------------------------------------------- helpers


def example_config(kafka_bootstrap: str, pg_dsn: str) -> dict[str, Any]:
    """config/example.yaml pointed at the test services."""
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    data["kafka"]["bootstrap_servers"] = kafka_bootstrap
    for p in data["pipelines"]:
        p["sink"]["dsn"] = pg_dsn
    return data


def closed_port_dsn() -> str:
    return f"postgresql://postgres:{PASSWORD}@127.0.0.1:{free_port()}/x"


def ingest(*args: Any, env: dict[str, str | None] | None = None):
    return run_ingest([str(a) for a in args], timeout_s=TIMEOUT, env=env)


def assert_clean_failure(result, code: int) -> str:
    """Exit ``code``, an ``error:`` line, no traceback, no password. Returns stdout+stderr."""
    both = result.stdout + result.stderr
    assert result.returncode == code, f"exit {result.returncode}, expected {code}\n{both}"
    assert "error:" in result.stderr, both
    assert "Traceback" not in both, both
    assert PASSWORD not in both, both
    return both


def query(dsn: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []


def columns_of(dsn: str, table: str, schema: str = "public") -> dict[str, tuple]:
    rows = query(
        dsn,
        """SELECT column_name, data_type, is_nullable, numeric_precision, numeric_scale
           FROM information_schema.columns WHERE table_schema = %s AND table_name = %s
           ORDER BY ordinal_position""",
        (schema, table),
    )
    return {r[0]: r[1:] for r in rows}


def primary_key_of(dsn: str, table: str, schema: str = "public") -> list[str]:
    rows = query(
        dsn,
        """SELECT k.column_name FROM information_schema.table_constraints c
           JOIN information_schema.key_column_usage k
             ON k.constraint_schema = c.constraint_schema AND k.constraint_name = c.constraint_name
            AND k.table_name = c.table_name
           WHERE c.table_schema = %s AND c.table_name = %s AND c.constraint_type = 'PRIMARY KEY'
           ORDER BY k.ordinal_position""",
        (schema, table),
    )
    return [r[0] for r in rows]


def unique_constraints_of(dsn: str, table: str, schema: str = "public") -> dict[str, list[str]]:
    rows = query(
        dsn,
        """SELECT c.constraint_name, k.column_name FROM information_schema.table_constraints c
           JOIN information_schema.key_column_usage k
             ON k.constraint_schema = c.constraint_schema AND k.constraint_name = c.constraint_name
            AND k.table_name = c.table_name
           WHERE c.table_schema = %s AND c.table_name = %s AND c.constraint_type = 'UNIQUE'
           ORDER BY c.constraint_name, k.ordinal_position""",
        (schema, table),
    )
    out: dict[str, list[str]] = {}
    for name, col in rows:
        out.setdefault(name, []).append(col)
    return out


def indexes_of(dsn: str, table: str, schema: str = "public") -> dict[str, str]:
    rows = query(dsn, "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s",
                 (schema, table))
    return dict(rows)


def tables_in(dsn: str, schema: str = "public") -> list[str]:
    rows = query(
        dsn,
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s ORDER BY table_name",
        (schema,),
    )
    return [r[0] for r in rows]


def catalog_snapshot(dsn: str) -> list[tuple]:
    """Every relation, constraint and column in non-system schemas: detects anything duplicated."""
    rels = query(
        dsn,
        """SELECT n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%%'
           ORDER BY 1, 2""",
    )
    cons = query(
        dsn,
        """SELECT n.nspname, c.conname, c.contype FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
           WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2""",
    )
    cols = query(
        dsn,
        """SELECT table_schema, table_name, column_name, data_type FROM information_schema.columns
           WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2, 3""",
    )
    return [*rels, *cons, *cols]


# --------------------------------------------------------------------------- --help


def test_top_level_help():
    result = ingest("--help")
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
    for command in ("run", "check", "migrate", "replay-dlq", "lag"):
        assert command in result.stdout, result.stdout


@pytest.mark.parametrize("command", ["run", "check", "migrate", "replay-dlq", "lag"])
def test_subcommand_help(command):
    result = ingest(command, "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Usage:" in result.stdout
    assert command in result.stdout
    assert "--config" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


# --------------------------------------------------------------------------- check


def test_check_ok_against_running_services(tmp_path, kafka_bootstrap, pg_dsn):
    path = write_config(tmp_path, example_config(kafka_bootstrap, pg_dsn))
    result = ingest("check", "--config", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "config ok" in result.stdout
    assert f"kafka {kafka_bootstrap}" in result.stdout
    assert "pipeline orders" in result.stdout


def test_check_uses_ingest_config_env(tmp_path, kafka_bootstrap, pg_dsn):
    path = write_config(tmp_path, example_config(kafka_bootstrap, pg_dsn))
    result = ingest("check", env={"INGEST_CONFIG": str(path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "config ok" in result.stdout


def test_check_env_override_beats_yaml(tmp_path, kafka_bootstrap, pg_dsn):
    data = example_config(kafka_bootstrap, pg_dsn)
    data["kafka"]["bootstrap_servers"] = f"127.0.0.1:{free_port()}"  # nothing listens there
    path = write_config(tmp_path, data)
    result = ingest("check", "--config", path, env={"INGEST_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kafka {kafka_bootstrap}" in result.stdout


def _drop(d: dict, *keys: str) -> None:
    for k in keys:
        d.pop(k)


# (id, mutation, field path expected in the message, problem text)
CLI_INVALID = [
    ("unknown-sink-key", lambda d: d["pipelines"][0]["sink"].update(tabel="x"),
     "pipelines[0](orders).sink.tabel", "unknown key"),
    ("lanes-not-int", lambda d: d["pipelines"][0].update(lanes="abc"), "pipelines[0](orders).lanes", "integer"),
    ("missing-sink-table", lambda d: _drop(d["pipelines"][0]["sink"], "table"),
     "pipelines[0](orders).sink.table", "required field missing"),
    ("unsupported-type", lambda d: d["pipelines"][0]["sink"]["columns"]["status"].update(type="money"),
     "pipelines[0](orders).sink.columns", "unsupported column type 'money'"),
    ("conflict-key-not-column", lambda d: d["pipelines"][0]["sink"].update(conflict_key=["nope"]),
     "pipelines[0](orders).sink", "not among columns"),
    ("kafka-dlq-no-topic", lambda d: d["pipelines"][0].update(dlq={"kind": "kafka"}),
     "pipelines[0](orders).dlq", "dlq.topic is required"),
]


@pytest.mark.parametrize("command", ["check", "migrate"])
@pytest.mark.parametrize(("mutate", "field", "problem"), [c[1:] for c in CLI_INVALID], ids=[c[0] for c in CLI_INVALID])
def test_invalid_config_exits_2(tmp_path, command, mutate, field, problem):
    # Validation happens before any connection: no services needed.
    data = example_config("127.0.0.1:9", f"postgresql://postgres:{PASSWORD}@127.0.0.1:9/x")
    mutate(data)
    path = write_config(tmp_path, data)
    result = ingest(command, "--config", path)
    both = assert_clean_failure(result, 2)
    assert str(path) in result.stderr, both
    assert f"{field}:" in result.stderr, both
    assert problem in result.stderr, both


@pytest.mark.parametrize("command", ["check", "migrate"])
def test_missing_config_file_exits_2(tmp_path, command):
    path = tmp_path / "nope.yaml"
    result = ingest(command, "--config", path)
    assert_clean_failure(result, 2)
    assert str(path) in result.stderr
    assert "not found" in result.stderr


def test_invalid_yaml_exits_2(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("kafka: {bootstrap_servers: [\n")
    result = ingest("check", "--config", path)
    assert_clean_failure(result, 2)
    assert str(path) in result.stderr
    assert "YAML" in result.stderr


def test_no_config_at_all_exits_2(tmp_path):
    result = ingest("check", env={"INGEST_CONFIG": None})
    assert_clean_failure(result, 2)
    assert "INGEST_CONFIG" in result.stderr


def test_check_unreachable_database_exits_3(tmp_path, kafka_bootstrap):
    data = example_config(kafka_bootstrap, closed_port_dsn())
    path = write_config(tmp_path, data)
    result = ingest("check", "--config", path)
    both = assert_clean_failure(result, 3)
    assert "unreachable" in result.stderr, both
    assert "postgres sink" in result.stderr and "orders" in result.stderr, both
    assert f"kafka {kafka_bootstrap}" in result.stdout, both  # the broker was fine


def test_check_unreachable_dlq_database_exits_3(tmp_path, kafka_bootstrap, pg_dsn):
    data = example_config(kafka_bootstrap, pg_dsn)
    data["pipelines"][0]["dlq"] = {"kind": "postgres", "dsn": closed_port_dsn()}
    path = write_config(tmp_path, data)
    result = ingest("check", "--config", path)
    both = assert_clean_failure(result, 3)
    assert "DLQ" in result.stderr and "orders" in result.stderr, both


def test_check_unreachable_broker_exits_3(tmp_path, pg_dsn):
    bootstrap = f"127.0.0.1:{free_port()}"
    data = example_config(bootstrap, pg_dsn)
    data["kafka"]["client"] = {"sasl.username": "u", "sasl.password": PASSWORD,
                               "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN"}
    path = write_config(tmp_path, data)
    result = ingest("check", "--config", path)
    both = assert_clean_failure(result, 3)
    assert "kafka" in result.stderr, both
    assert bootstrap in result.stderr, both


# --------------------------------------------------------------------------- migrate


def test_migrate_creates_tables(tmp_path, kafka_bootstrap, pg_dsn):
    path = write_config(tmp_path, example_config(kafka_bootstrap, pg_dsn))
    result = ingest("migrate", "--config", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "orders" in result.stdout and "ingest_dlq" in result.stdout and "ingest_offsets" in result.stdout

    assert {"orders", "ingest_dlq", "ingest_offsets"} <= set(tables_in(pg_dsn))

    cols = columns_of(pg_dsn, "orders")
    assert list(cols) == ["order_id", "status", "amount", "updated_at", "kafka_offset",
                          "_ingest_stream", "_ingest_offset"]  # the hidden row-source columns
    assert cols["order_id"][:2] == ("bigint", "NO")
    assert cols["status"][:2] == ("text", "YES")
    assert cols["amount"] == ("numeric", "YES", 12, 2)
    assert cols["updated_at"][:2] == ("timestamp with time zone", "YES")
    assert cols["kafka_offset"][:2] == ("bigint", "NO"), "the version column is required"
    assert primary_key_of(pg_dsn, "orders") == ["order_id"]

    dlq_cols = columns_of(pg_dsn, "ingest_dlq")
    for name, type_ in [("id", "bigint"), ("pipeline", "text"), ("topic", "text"), ("partition", "integer"),
                        ("offset", "bigint"), ("key", "bytea"), ("value", "bytea"), ("headers", "jsonb"),
                        ("stage", "text"), ("error_class", "text"), ("error_message", "text"),
                        ("status", "text"), ("attempts", "integer"), ("last_failed_at", "timestamp with time zone")]:
        assert dlq_cols[name][0] == type_, (name, dlq_cols[name])
    assert primary_key_of(pg_dsn, "ingest_dlq") == ["id"]
    assert unique_constraints_of(pg_dsn, "ingest_dlq") == {
        "ingest_dlq_record_key": ["pipeline", "topic", "partition", "offset"]
    }
    idx = indexes_of(pg_dsn, "ingest_dlq")
    assert "(pipeline, last_failed_at)" in idx["ingest_dlq_pipeline_time_idx"]
    assert "(pipeline, status, id)" in idx["ingest_dlq_pipeline_status_idx"]
    assert set(idx) == {"ingest_dlq_pkey", "ingest_dlq_record_key", "ingest_dlq_pipeline_time_idx",
                        "ingest_dlq_pipeline_status_idx"}

    off_cols = columns_of(pg_dsn, "ingest_offsets")
    assert {k: v[0] for k, v in off_cols.items()} == {
        "pipeline": "text", "topic": "text", "partition": "integer", "next_offset": "bigint",
        "updated_at": "timestamp with time zone",
    }
    assert primary_key_of(pg_dsn, "ingest_offsets") == ["pipeline", "topic", "partition"]

    # The sink works with what migrate made: an upsert on the conflict key succeeds.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for status in ("new", "paid"):
            conn.execute(
                "INSERT INTO orders (order_id, status, amount, kafka_offset) VALUES (1, %s, 9.99, 0) "
                "ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status", (status,))
        assert conn.execute("SELECT order_id, status FROM orders").fetchall() == [(1, "paid")]


def test_migrate_twice_is_idempotent(tmp_path, kafka_bootstrap, pg_dsn):
    path = write_config(tmp_path, example_config(kafka_bootstrap, pg_dsn))
    first = ingest("migrate", "--config", path)
    assert first.returncode == 0, first.stdout + first.stderr
    snapshot = catalog_snapshot(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO orders (order_id, status, kafka_offset) VALUES (7, 'kept', 0)")
    second = ingest("migrate", "--config", path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert catalog_snapshot(pg_dsn) == snapshot
    assert query(pg_dsn, "SELECT order_id, status FROM orders") == [(7, "kept")]


def test_migrate_selected_pipeline_only(tmp_path, kafka_bootstrap, pg_dsn):
    data = example_config(kafka_bootstrap, pg_dsn)
    second = copy.deepcopy(data["pipelines"][0])
    second["name"] = "refunds"
    second["group_id"] = "ingest-refunds"
    second["sink"]["table"] = "refunds"
    data["pipelines"].append(second)
    path = write_config(tmp_path, data)
    result = ingest("migrate", "--config", path, "--pipeline", "refunds")
    assert result.returncode == 0, result.stdout + result.stderr
    tables = tables_in(pg_dsn)
    assert "refunds" in tables and "orders" not in tables


def test_migrate_existing_table_without_unique_key_fails(tmp_path, kafka_bootstrap, pg_dsn):
    query(pg_dsn, "CREATE TABLE orders (order_id bigint, status text, amount numeric(12,2), "
                  "updated_at timestamptz, kafka_offset bigint)")
    path = write_config(tmp_path, example_config(kafka_bootstrap, pg_dsn))
    result = ingest("migrate", "--config", path)
    both = result.stdout + result.stderr
    assert result.returncode != 0, both
    assert "Traceback" not in both, both
    assert "error:" in result.stderr, both
    assert "orders" in result.stderr and "order_id" in result.stderr, both
    assert "unique index" in result.stderr, both
    # The existing table is left as it was.
    assert primary_key_of(pg_dsn, "orders") == []


def test_migrate_existing_table_with_unique_index_is_accepted(tmp_path, kafka_bootstrap, pg_dsn):
    query(pg_dsn, "CREATE TABLE orders (order_id bigint NOT NULL, status text, amount numeric(12,2), "
                  "updated_at timestamptz, kafka_offset bigint)")
    query(pg_dsn, "CREATE UNIQUE INDEX orders_order_id_uq ON orders (order_id)")
    path = write_config(tmp_path, example_config(kafka_bootstrap, pg_dsn))
    result = ingest("migrate", "--config", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {"ingest_dlq", "ingest_offsets"} <= set(tables_in(pg_dsn))


def test_migrate_unreachable_database_exits_3(tmp_path, kafka_bootstrap):
    path = write_config(tmp_path, example_config(kafka_bootstrap, closed_port_dsn()))
    result = ingest("migrate", "--config", path)
    both = assert_clean_failure(result, 3)
    assert "orders" in result.stderr and "postgres" in result.stderr, both


def test_migrate_hostile_identifiers(tmp_path, kafka_bootstrap, pg_dsn):
    query(pg_dsn, "CREATE TABLE x (id int)")
    query(pg_dsn, "INSERT INTO x VALUES (42)")
    data = example_config(kafka_bootstrap, pg_dsn)
    sink = data["pipelines"][0]["sink"]
    sink["table"] = HOSTILE_TABLE
    sink["conflict_key"] = [HOSTILE_COLUMN]
    sink["version_column"] = None
    sink["columns"] = {
        HOSTILE_COLUMN: {"type": "bigint", "source": "$.id"},
        "x); DROP TABLE x; --": {"type": "text", "source": "$.v"},
        "Mixed Case": {"type": "varchar(16)", "source": "$.m"},
    }
    data["pipelines"][0]["dlq"] = {"kind": "postgres", "table": 'dlq"; DROP TABLE x; --'}
    path = write_config(tmp_path, data)

    for _ in range(2):  # also idempotent with hostile names
        result = ingest("migrate", "--config", path)
        assert result.returncode == 0, result.stdout + result.stderr

    tables = tables_in(pg_dsn)
    assert "x" in tables
    assert query(pg_dsn, "SELECT id FROM x") == [(42,)]
    assert HOSTILE_TABLE in tables
    assert 'dlq"; DROP TABLE x; --' in tables
    assert sorted(tables) == sorted(["x", HOSTILE_TABLE, 'dlq"; DROP TABLE x; --', "ingest_offsets", "ingest_lane_offsets"])

    cols = columns_of(pg_dsn, HOSTILE_TABLE)
    assert list(cols) == [HOSTILE_COLUMN, "x); DROP TABLE x; --", "Mixed Case", "_ingest_stream", "_ingest_offset"]
    assert cols[HOSTILE_COLUMN][:2] == ("bigint", "NO")
    assert cols["x); DROP TABLE x; --"][0] == "text"
    assert cols["Mixed Case"][0] == "character varying"
    assert primary_key_of(pg_dsn, HOSTILE_TABLE) == [HOSTILE_COLUMN]
    assert unique_constraints_of(pg_dsn, 'dlq"; DROP TABLE x; --') == {
        'dlq"; DROP TABLE x; --_record_key': ["pipeline", "topic", "partition", "offset"]
    }
    assert len(indexes_of(pg_dsn, 'dlq"; DROP TABLE x; --')) == 4


def test_migrate_hostile_schema(tmp_path, kafka_bootstrap, pg_dsn):
    schema = 'Sch"ema ✓'
    data = example_config(kafka_bootstrap, pg_dsn)
    data["pipelines"][0]["sink"]["schema"] = schema
    data["pipelines"][0]["dlq"] = {"kind": "postgres", "schema": schema}
    path = write_config(tmp_path, data)
    result = ingest("migrate", "--config", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert tables_in(pg_dsn, schema) == ["ingest_dlq", "ingest_lane_offsets", "ingest_offsets", "orders"]
    assert primary_key_of(pg_dsn, "orders", schema) == ["order_id"]


@pytest.mark.parametrize("length", [40, 55, 60, 63])
def test_migrate_long_dlq_table_name(tmp_path, kafka_bootstrap, pg_dsn, length):
    """Any DLQ table name the config accepts (1-63 bytes) gets its unique constraint and both indexes."""
    table = "d" * length
    data = example_config(kafka_bootstrap, pg_dsn)
    data["pipelines"][0]["dlq"] = {"kind": "postgres", "table": table}
    path = write_config(tmp_path, data)
    result = ingest("migrate", "--config", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert table in tables_in(pg_dsn)
    assert list(unique_constraints_of(pg_dsn, table).values()) == [["pipeline", "topic", "partition", "offset"]]
    defs = sorted(indexes_of(pg_dsn, table).values())
    assert len(defs) == 4, defs
    assert any("(pipeline, last_failed_at)" in d for d in defs), defs
    assert any("(pipeline, status, id)" in d for d in defs), defs


def test_migrate_ddl_rejected_by_database_is_a_clean_error(tmp_path, kafka_bootstrap, pg_dsn):
    """A column type the config accepts but PostgreSQL refuses (varchar(0)) fails with a message, not a traceback."""
    data = example_config(kafka_bootstrap, pg_dsn)
    data["pipelines"][0]["sink"]["columns"]["status"]["type"] = "varchar(0)"
    path = write_config(tmp_path, data)
    result = ingest("migrate", "--config", path)
    both = result.stdout + result.stderr
    assert result.returncode in (1, 2), both
    assert "Traceback" not in both, both
    assert "error:" in result.stderr and "orders" in result.stderr, both
