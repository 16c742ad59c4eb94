"""Every command for every sink kind and every DLQ kind (issue 16): PostgreSQL, ClickHouse (chDB) and a
test-only third kind, SQLite (tests/plugins/sqlite_sink.py, registered with one registry line and loaded
through INGEST_PLUGINS) × the PostgreSQL DLQ table and a Kafka DLQ topic. Real broker, real databases,
``python -m ingest`` as a subprocess.

Each cell: check, migrate, run (two poison records among good ones), lag, dlq count|list|show,
replay-dlq --dry-run, --to sink after fixing the cause, then a new poison record replayed --to topic and
run again -- and the table ends holding every record.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from harness import REPO_ROOT, run_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS, produce

pytestmark = pytest.mark.timeout(300)

PLUGIN_ENV = {"INGEST_PLUGINS": "sqlite_sink",
              "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests" / "plugins"), os.environ.get("PYTHONPATH", "")])}


def _sink(kind: str, *, pg_dsn: str, chdb_url: str, sqlite_path: Path, fixed: bool) -> dict[str, Any]:
    status: dict[str, Any] = {"type": "String" if kind == "clickhouse" else "text"}
    status.update({"default": "fixed"} if fixed else {"required": True})
    if kind == "clickhouse":
        return {"kind": "clickhouse", "url": chdb_url, "database": "matrix", "table": "items", "order_by": ["id"],
                "columns": {"id": {"type": "UInt64"}, "status": status}}
    base = {"table": "items", "conflict_key": ["id"],
            "columns": {"id": {"type": "bigint", "required": True}, "status": status}}
    if kind == "postgres":
        return {"kind": "postgres", "dsn": pg_dsn, **base}
    return {"kind": "sqlite", "path": str(sqlite_path), **base}


class Cell:
    """One sink kind × DLQ kind: its configs (strict, and fixed: the cause of the poison removed)."""

    def __init__(self, sink_kind: str, dlq_kind: str, tmp_path: Path, *, bootstrap: str, topic: str,
                 dlq_topic: str, group: str, pg_dsn: str, chdb: Any) -> None:
        self.sink_kind, self.dlq_kind, self.tmp = sink_kind, dlq_kind, tmp_path
        self.pg_dsn, self.chdb, self.sqlite_path = pg_dsn, chdb, tmp_path / "items.db"
        dlq = {"kind": "postgres", "dsn": pg_dsn} if dlq_kind == "postgres" else {"kind": "kafka", "topic": dlq_topic}
        self.configs = {}
        for fixed in (False, True):
            self.configs[fixed] = write_config(tmp_path / ("fixed" if fixed else "strict"), {
                "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
                "pipelines": [{
                    "name": "items", "topics": [topic], "group_id": group, "commit_interval_ms": 200,
                    "batch": {"max_rows": 100, "max_latency_ms": 100},
                    "sink": _sink(sink_kind, pg_dsn=pg_dsn, chdb_url=chdb.url, sqlite_path=self.sqlite_path,
                                  fixed=fixed),
                    "dlq": dlq,
                }],
            })

    def ingest(self, *args: str, fixed: bool = False, expect: int = 0) -> Any:
        res = run_ingest([*args, "-c", self.configs[fixed]], timeout_s=120, env=PLUGIN_ENV, log_dir=self.tmp)
        assert res.returncode == expect, (f"{self.sink_kind} x {self.dlq_kind}: ingest {' '.join(args)} exited "
                                          f"{res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        return res

    def rows(self) -> dict[int, str]:
        if self.sink_kind == "postgres":
            with psycopg.connect(self.pg_dsn) as conn:
                return dict(conn.execute("SELECT id, status FROM items").fetchall())
        if self.sink_kind == "sqlite":
            with sqlite3.connect(self.sqlite_path) as conn:
                return dict(conn.execute("SELECT id, status FROM items").fetchall())
        client = self.chdb.client()
        try:
            return dict(client.query("SELECT id, status FROM matrix.items FINAL").result_rows)
        finally:
            self.chdb.close()

    def dlq_count(self, fixed: bool = False) -> list[dict[str, Any]]:
        return orjson.loads(self.ingest("dlq", "count", "-p", "items", "--format", "json", fixed=fixed).stdout)


def _records(ids: range, poison: bool = False) -> list[tuple[bytes, bytes]]:
    return [(str(i).encode(), orjson.dumps({"id": i} if poison else {"id": i, "status": "s"})) for i in ids]


@pytest.mark.parametrize("dlq_kind", ["postgres", "kafka"])
@pytest.mark.parametrize("sink_kind", ["postgres", "clickhouse", "sqlite"])
def test_every_command_works_for_every_sink_and_dlq_kind(sink_kind, dlq_kind, kafka_bootstrap, pg_dsn, new_topic,
                                                         group_id, chdb, tmp_path):
    topic, dlq_topic = new_topic(partitions=2), new_topic(partitions=1)
    cell = Cell(sink_kind, dlq_kind, tmp_path, bootstrap=kafka_bootstrap, topic=topic, dlq_topic=dlq_topic,
                group=group_id, pg_dsn=pg_dsn, chdb=chdb)
    assert "config ok" in cell.ingest("check").stdout
    cell.ingest("migrate")
    produce(kafka_bootstrap, topic, _records(range(1, 6)) + _records(range(6, 8), poison=True))
    cell.ingest("run", "--until-idle", "2", "--metrics-port", "0")
    assert cell.rows() == {i: "s" for i in range(1, 6)}

    lag = orjson.loads(cell.ingest("lag", "--format", "json").stdout)
    assert [p["lag"] for p in lag["pipelines"]["items"]["partitions"]] == [0, 0]
    assert cell.dlq_count() == [{"stage": "map", "error_class": "missing_field", "status": "pending", "count": 2}]
    listed = orjson.loads(cell.ingest("dlq", "list", "-p", "items", "--format", "json").stdout)
    assert sorted(orjson.loads(e["value"])["id"] for e in listed) == [6, 7]
    shown = orjson.loads(cell.ingest("dlq", "show", str(listed[0]["id"]), "-p", "items").stdout)
    assert shown["error_class"] == "missing_field" and shown["id"] == listed[0]["id"]
    assert "2 entries would be replayed" in cell.ingest("replay-dlq", "-p", "items", "--dry-run").stdout
    if dlq_kind == "kafka":
        cell.ingest("replay-dlq", "-p", "items", "--purge", expect=2)

    replayed = cell.ingest("replay-dlq", "-p", "items", "--to", "sink", fixed=True).stdout
    assert replayed.startswith("replayed 2, still failing 0"), replayed
    assert cell.rows() == {**{i: "s" for i in range(1, 6)}, 6: "fixed", 7: "fixed"}
    assert cell.dlq_count(fixed=True) == [{"stage": "map", "error_class": "missing_field", "status": "replayed",
                                           "count": 2}]

    produce(kafka_bootstrap, topic, _records(range(8, 9), poison=True))
    cell.ingest("run", "--until-idle", "2", "--metrics-port", "0")
    assert 8 not in cell.rows()
    replayed = cell.ingest("replay-dlq", "-p", "items", "--to", "topic", fixed=True).stdout
    assert replayed.startswith("replayed 1, still failing 0"), replayed
    cell.ingest("run", "--until-idle", "2", "--metrics-port", "0", fixed=True)
    assert cell.rows() == {**{i: "s" for i in range(1, 6)}, 6: "fixed", 7: "fixed", 8: "fixed"}
