"""Many tables (issue #36): the same records into one table, and spread over 20 tables by a pattern
subscription and a table template, side by side in one run.

    .venv/bin/python bench/multi_table.py [--records 200000] [--tables 20] [--rounds 3]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded PostgreSQL (pgserver).
Produces the benchmark's JSON records (bench/common.py's ``event``, ~110 B, a third of them updates)
twice: all into one topic, and each into topic ``<prefix>.t<key % tables>`` (the same keys and
values, so the same rows, spread over ``tables`` topics of 6 partitions each; a key in one table; the
one topic has as many partitions as the N together, so batches collapse alike). Then runs
``ingest run --until-idle`` (one process, one lane), ``--rounds`` times interleaved:

  one table        topics: [the one topic], sink.table: a name (the default write tier: columnar)
  one table, rows  the same with ``columnar: false`` (the row path beside it)
  N tables         topics: ['^<prefix>\\.(?P<t>t[0-9]+)$'], sink.table: "{t}": every table created on
                   its first record; on the columnar tier each batch is split by table, one CSV COPY of
                   every table's rows into one stage and every table's upsert in one round trip

and prints records/s (best, median) and ingest's own CPU per record (user + sys of its process less
an idle run of the same configuration on empty topics), and the ratio N tables / one table (the
issue's target: >= 0.8 x records/s). Every run's tables are checked against the stream (the last
record of each key, in its table) and the script exits non-zero on a difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import orjson
import psycopg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PARTITIONS, create_topic, event, run_measured, send_all  # noqa: E402
from pg_pipeline import COLUMNS, run_command  # noqa: E402

from ingest.embedded import start_all  # noqa: E402

CONFIGS = ("one table", "one table, rows", "N tables")


def keys_of(n: int) -> list[tuple[int, int]]:
    """(i, key) of every record, as bench/common.py's ``produce`` makes them."""
    keys = max(1, n // 3)
    return [(i, (i * 7919) % keys) for i in range(n)]


def config(bootstrap: str, topics: list[str], dsn: str, table: str, name: str, schema: str) -> dict:
    pipeline: dict = {
        "name": "bench", "topics": topics, "group_id": f"bench-m-{uuid.uuid4().hex}", "lanes": 1,
        "batch": {"max_rows": 5000, "max_latency_ms": 200},
        "sink": {"kind": "postgres", "dsn": dsn, "schema": schema, "table": table, "conflict_key": ["event_id"],
                 "columns": COLUMNS},
        "dlq": {"kind": "postgres", "table": "bench_dlq"},
    }
    if name == "one table, rows":
        pipeline["columnar"] = False
    return {"kafka": {"bootstrap_servers": bootstrap,
                      "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
            "pipelines": [pipeline]}


def run(bootstrap: str, dsn: str, name: str, tag: str, one_topic: str, prefix: str) -> tuple[dict, float, str]:
    """One ``ingest run`` into fresh tables: (its summary, its process CPU-seconds, the schema written)."""
    schema = f"bench_m_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{schema}"')
    if name == "N tables":
        topics, table = [f"^{prefix}\\.(?P<t>t[0-9]+)$"], "{t}"
    else:
        topics, table = [one_topic], "events"
        _make_in_schema(dsn, schema)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(config(bootstrap, topics, dsn, table, name, schema)))
        summary = Path(tmp) / "summary.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cpu_s = run_measured(run_command(path, 1, summary), env=env)
        return orjson.loads(summary.read_bytes())["pipelines"]["bench"], cpu_s, schema


def _make_in_schema(dsn: str, schema: str) -> None:
    from ingest.drivers.postgres import execute_ddl
    from ingest.sinks.postgres.settings import PostgresSinkSettings
    from ingest.sinks.postgres.statements import sink_table_sql

    cfg = PostgresSinkSettings(dsn=dsn, schema=schema, table="events", conflict_key=["event_id"], columns=COLUMNS)
    execute_ddl(dsn, "bench", sink_table_sql(cfg))


def expected_rows(n: int, tables: int) -> dict[str, dict[int, tuple]]:
    """table -> event_id -> (user_id, kind, amount) of the last record of each key routed there."""
    out: dict[str, dict[int, tuple]] = {}
    for i, key in keys_of(n):
        doc = orjson.loads(event(i, key))
        amount = Decimal(repr(doc["amount"])).quantize(Decimal("0.01"))
        out.setdefault(f"t{key % tables}", {})[doc["id"]] = (doc["user"], doc["kind"], amount)
    return out


def last_per_key(n: int) -> dict[int, tuple]:
    """event_id -> (user_id, kind, amount) of the last record of each key (the one-table runs)."""
    out = {}
    for i, key in keys_of(n):
        doc = orjson.loads(event(i, key))
        out[doc["id"]] = (doc["user"], doc["kind"], Decimal(repr(doc["amount"])).quantize(Decimal("0.01")))
    return out


def check(dsn: str, schema: str, want: dict[str, dict[int, tuple]], name: str) -> None:
    """The tables of ``schema`` hold exactly ``want`` (table -> event_id -> values)."""
    with psycopg.connect(dsn) as conn:
        for table, rows in want.items():
            got = {r[0]: r[1:] for r in conn.execute(
                f'SELECT event_id, user_id, kind, amount FROM "{schema}"."{table}"')}  # noqa: S608 - bench names
            if got != rows:
                raise SystemExit(f"{name}: table {table}: {len(got)} rows, expected {len(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--tables", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    services = start_all()
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        tag = uuid.uuid4().hex[:8]
        one_topic, prefix, idle_prefix = f"bench-m-{tag}", f"benchm{tag}", f"benchmidle{tag}"
        # as many partitions as the N topics together: a batch then holds records of as many keys, and
        # collapses as many, in both layouts (a key's records are in one partition either way)
        create_topic(bootstrap, one_topic, PARTITIONS * args.tables)
        create_topic(bootstrap, f"{idle_prefix}-one", PARTITIONS * args.tables)
        for t in range(args.tables):
            create_topic(bootstrap, f"{prefix}.t{t}")
            create_topic(bootstrap, f"{idle_prefix}.t{t}")
        started = time.perf_counter()
        pairs = keys_of(args.records)
        send_all(bootstrap, ((one_topic, str(k).encode(), event(i, k)) for i, k in pairs))
        send_all(bootstrap, ((f"{prefix}.t{k % args.tables}", str(k).encode(), event(i, k)) for i, k in pairs))
        print(f"produced {args.records} records twice (1 topic, {args.tables} topics) in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        expected = {"N tables": expected_rows(args.records, args.tables)}
        expected["one table"] = expected["one table, rows"] = {"events": last_per_key(args.records)}
        idle = {name: run(bootstrap, dsn, name, f"idle{j}", f"{idle_prefix}-one", idle_prefix)[1]
                for j, name in enumerate(CONFIGS)}
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        cpus: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for r in range(args.rounds):
            for j, name in enumerate(CONFIGS):
                stats, cpu_s, schema = run(bootstrap, dsn, name, f"{r}_{j}", one_topic, prefix)
                assert stats["records_consumed"] == args.records, stats
                check(dsn, schema, expected[name], name)
                rates[name].append(args.records / stats["busy_s"] if stats["busy_s"] else stats["rate_per_s"])
                cpus[name].append((cpu_s - idle[name]) / args.records * 1e6)
                print(f"round {r + 1} {name:16s} {rates[name][-1]:>10,.0f} records/s, own CPU "
                      f"{cpus[name][-1]:.2f} us per record, tier {stats.get('write_tier')}, "
                      f"tables {len(stats.get('rows_written_by_table') or {}) or 1}", flush=True)
        print(f"\n{args.records} records, {args.tables} tables, {args.rounds} rounds, 1 process, 1 lane")
        print(f"{'configuration':18s} {'best rec/s':>12s} {'median rec/s':>13s} {'own CPU us/rec':>15s}")
        for name in CONFIGS:
            print(f"{name:18s} {max(rates[name]):>12,.0f} {statistics.median(rates[name]):>13,.0f} "
                  f"{statistics.median(cpus[name]):>15.2f}")
        one, rows, many = (statistics.median(rates[n]) for n in CONFIGS)
        print(f"\nN tables / one table = {many / one:.2f} x records/s (target >= 0.8); "
              f"N tables / one table by rows = {many / rows:.2f} x")
    finally:
        services.close()


if __name__ == "__main__":
    main()
