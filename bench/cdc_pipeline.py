"""Change data capture benchmark: a Debezium stream with 20 % deletes end to end, beside pure upserts.

    .venv/bin/python bench/cdc_pipeline.py [--records 200000] [--rounds 3] [--lanes 4] [--deletes 0.2]
                                           [--sink postgres|clickhouse] [--json FILE]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded PostgreSQL
(pgserver), and produces three topics (6 partitions, ``--records`` change events each over
``records / 3`` keys, every key in one partition: ``crc32(id) % 6``, the partition set explicitly
as Kafka Connect pins a key), made by the test harness's simulated source table
(``tests/harness/cdc_source.py``) -- a table ``items (id bigint, name text, price numeric(12,2),
qty integer, updated_at timestamp)`` with ``lsn`` as the version column:

  (a) upsert         -- plain JSON upserts, no envelope: each record the row (price as decimal text,
                        updated_at as epoch ms) plus ``lsn``; inserts and updates only. The
                        pure-upsert figure the CDC streams are held against;
  (b) debezium       -- Debezium change events as the JSON converter writes them with
                        ``value.converter.schemas.enable=false`` (the common production setting;
                        with ``decimal.handling.mode=string`` and ``time.precision.mode=connect``,
                        which a schemaless stream needs), ``--deletes`` of the events deletes
                        (as many inserts, re-inserting deleted keys; the rest updates), each delete
                        followed by its tombstone;
  (c) debezium+schema -- the same workload with the schema part (``schemas.enable=true``, the
                        converter's default: precise decimals as base64, MicroTimestamp), ~3 KB a record.

Each is run end to end by ``ingest run --until-idle 3`` as a subprocess (``envelope: debezium``
for (b) and (c), hard deletes) into a fresh table, ``--rounds`` times, the three interleaved in
each round (their order rotating per round, so a slow spell of this shared machine hits every
stream of a round alike). Printed per stream: the write tier the run chose and the share of its records the columnar tier wrote
(``write_tier``, ``columnar_records`` of the summary), records/s (Kafka records, tombstones included:
first record → last batch handled, from the run's summary), changes/s (change events: tombstones
excluded), best and median; ingest's own CPU per record and per change (user + sys of its
process, less an ``ingest run`` of the same configuration on an empty topic: start-up, group
join, idle wait) and the machine's CPU per record (every process, from /proc/stat, inside the
run's busy window); then the ratios of the medians of (b) and (c) to (a), by records/s and by
changes/s. The target is (b)/(a) >= 0.8. After the last round each stream's table is checked
against the source table's final state (every row and value; deleted keys absent) and the script
exits non-zero when one differs.

``--sink clickhouse`` runs the same into chDB (in-process ClickHouse, ``ReplacingMergeTree(lsn,
_ingest_deleted)``; each run its own chDB path, read back with ``FINAL`` after the run), the DLQ in
PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC
from pathlib import Path
from typing import Any

import orjson
import psycopg
import yaml

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(TESTS))  # harness.cdc_source: the simulated source table

from harness.cdc_source import SourceTable, produce_stream
from harness.kafka import close_producers

from ingest.embedded import start_all

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PARTITIONS,
    PRODUCER,
    BusySampler,
    create_topic,
    run_measured,
)

BATCH_ROWS = 5000
CH_DATABASE = "bench"
PG_COLUMNS = {
    "id": {"type": "bigint", "required": True},
    "name": {"type": "text"},
    "price": {"type": "numeric(12,2)"},
    "qty": {"type": "integer"},
    "updated_at": {"type": "timestamptz"},
}
CH_COLUMNS = {
    "id": {"type": "Int64", "required": True},
    "name": {"type": "Nullable(String)"},
    "price": {"type": "Nullable(Decimal(12, 2))"},
    "qty": {"type": "Nullable(Int32)"},
    "updated_at": {"type": "Nullable(DateTime64(6, 'UTC'))"},
}
#: stream -> (label, SourceTable arguments besides seed/keys/partitions)
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "a": ("(a) upsert (plain JSON)",
          {"delete_frac": 0.0, "schemas": False, "encoding": "string", "envelope": "none", "rekey_frac": 0.0,
           "short_lived_frac": 0.0}),
    "b": ("(b) debezium, schemas.enable=false", {"schemas": False, "encoding": "string"}),
    "c": ("(c) debezium, schemas.enable=true", {"schemas": True, "encoding": "precise"}),
}
#: ``--breakdown``: the envelope without deletes, to tell its cost from the deletes'.
BREAKDOWN = {"b0": ("(b0) as (b), without deletes",
                    {"schemas": False, "encoding": "string", "delete_frac": 0.0, "rekey_frac": 0.0,
                     "short_lived_frac": 0.0})}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- configuration


def pipeline_config(stream: str, *, bootstrap: str, topic: str, table: str, lanes: int, pg_dsn: str,
                    sink: str, chdb_path: Path | None) -> dict[str, Any]:
    version_source = "$.lsn" if stream == "a" else "@source.lsn"
    if sink == "postgres":
        sink_cfg: dict[str, Any] = {
            "kind": "postgres", "dsn": pg_dsn, "table": table, "conflict_key": ["id"], "version_column": "lsn",
            "columns": {**PG_COLUMNS, "lsn": {"type": "bigint", "source": version_source}}}
    else:
        sink_cfg = {"kind": "clickhouse", "url": f"chdb://{chdb_path}", "database": CH_DATABASE, "table": table,
                    "order_by": ["id"], "version_column": "lsn",
                    "columns": {**CH_COLUMNS, "lsn": {"type": "UInt64", "source": version_source}}}
    pipeline: dict[str, Any] = {
        "name": "bench", "topics": [topic], "group_id": f"bench-cdc-{uuid.uuid4().hex}", "lanes": lanes,
        "batch": {"max_rows": BATCH_ROWS, "max_latency_ms": 200},
        "sink": sink_cfg,
        "dlq": {"kind": "postgres", "dsn": pg_dsn, "table": "bench_dlq"},
    }
    if stream != "a":
        pipeline["envelope"] = "debezium"
        pipeline["deletes"] = {"mode": "hard"}
    return {"kafka": {"bootstrap_servers": bootstrap,
                      "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
            "pipelines": [pipeline]}


def run_command(path: Path, summary: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "ingest", "run", "-c", str(path), "--until-idle", "3", "--metrics-port", "0",
           "--log-level", "warning"]
    return cmd + (["--summary-json", str(summary)] if summary is not None else [])


def drop_pg_tables(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_ingest_deleted"')


def prepare(stream: str, workdir: Path, name: str, **kw: Any) -> Path:
    """Write the configuration of one run and ``ingest migrate`` it (a fresh table / chDB path)."""
    if kw["sink"] == "postgres":
        drop_pg_tables(kw["pg_dsn"], kw["table"])
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(stream, **kw)))
    subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=ENV,
                   stdout=subprocess.DEVNULL)
    return path


# --------------------------------------------------------------------------- runs


def idle_cpu_s(stream: str, bootstrap: str, workdir: Path, lanes: int, pg_dsn: str, sink: str) -> float:
    """CPU-seconds of ``ingest run`` of ``stream``'s configuration on an empty topic."""
    topic = f"bench-cdc-idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    name = f"idle_{stream}"
    path = prepare(stream, workdir, name, bootstrap=bootstrap, topic=topic, table=f"bench_cdc_{name}", lanes=lanes,
                   pg_dsn=pg_dsn, sink=sink, chdb_path=workdir / f"chdb-{name}")
    return run_measured(run_command(path), env=ENV, stdout=subprocess.DEVNULL)


def end_to_end(stream: str, rnd: int, bootstrap: str, topic: str, workdir: Path, lanes: int, pg_dsn: str,
               sink: str) -> dict[str, Any]:
    name = f"{stream}_{rnd}"
    table = f"bench_cdc_{stream}" if sink == "postgres" else f"bench_cdc_{name}"
    chdb_path = workdir / f"chdb-{name}"
    path = prepare(stream, workdir, name, bootstrap=bootstrap, topic=topic, table=table, lanes=lanes, pg_dsn=pg_dsn,
                   sink=sink, chdb_path=chdb_path)
    summary = workdir / f"{name}.json"
    with BusySampler() as busy:
        process_cpu_s = run_measured(run_command(path, summary), env=ENV, stdout=subprocess.DEVNULL)
    data = orjson.loads(summary.read_bytes())
    stats = data["pipelines"]["bench"]
    window = stats.get("busy_window_s") or [None, None]
    consumed = stats["records_consumed"]
    machine_us = busy.cpu_s(*window) / consumed * 1e6 if None not in window and consumed else None
    rate = consumed / stats["busy_s"] if stats.get("busy_s") else stats["rate_per_s"]
    return {"rate": rate, "consumed": consumed, "rows": stats["rows_written"], "deleted": stats.get("rows_deleted", 0),
            "dead": stats["dead_lettered"], "process_cpu_s": process_cpu_s, "machine_cpu_us": machine_us,
            "busy_s": stats.get("busy_s"), "table": table, "chdb_path": chdb_path, "rss": data.get("peak_rss_bytes", 0),
            "tier": stats.get("write_tier"), "columnar_records": stats.get("columnar_records", 0)}


# --------------------------------------------------------------------------- checking the tables


def _utc(dt: Any) -> Any:
    if dt is None:
        return None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def read_table(sink: str, pg_dsn: str, run: dict[str, Any], deletes: bool) -> dict[int, tuple]:
    cols = "id, name, price, qty, updated_at, lsn"
    if sink == "postgres":
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(f'SELECT {cols} FROM "{run["table"]}"').fetchall()
    else:
        import clickhouse_connect

        client = clickhouse_connect.get_client(dsn=f"chdb://{run['chdb_path']}")  # the run has released it
        try:
            live = " WHERE _ingest_deleted = 0" if deletes else ""  # only tables with deletes have the flag
            rows = client.query(f"SELECT {cols} FROM {CH_DATABASE}.{run['table']} FINAL{live}").result_rows
        finally:
            client.close()
    return {r[0]: (r[1], r[2], r[3], _utc(r[4]), r[5]) for r in rows}


def check_table(label: str, got: dict[int, tuple], source: SourceTable) -> None:
    expected = {k: tuple(v) for k, v in source.rows.items()}
    if got != expected:
        missing = sorted(expected.keys() - got.keys())[:3]
        extra = sorted(got.keys() - expected.keys())[:3]
        differ = [(k, expected[k], got[k]) for k in sorted(expected.keys() & got.keys()) if expected[k] != got[k]][:2]
        raise SystemExit(f"{label}: table has {len(got)} rows, the source {len(expected)}; missing {missing}, "
                         f"unexpected {extra}, different {differ}")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000, help="change events per stream")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run every stream this many times, interleaved; report best and median")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--deletes", type=float, default=0.2, help="share of the CDC streams' events that delete")
    ap.add_argument("--sink", choices=("postgres", "clickhouse"), default="postgres")
    ap.add_argument("--seed", type=int, default=20_250_101)
    ap.add_argument("--breakdown", action="store_true",
                    help="also run (b0): (b)'s envelope without deletes, to tell the envelope's cost from the deletes'")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON to this file")
    args = ap.parse_args()
    n = args.records
    keys = max(1, n // 3)
    streams = {**STREAMS, **(BREAKDOWN if args.breakdown else {})}

    services = start_all()
    workdir = Path(tempfile.mkdtemp(prefix="ingest-bench-cdc-"))
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        topics: dict[str, str] = {}
        sources: dict[str, SourceTable] = {}
        for stream, (label, kw) in streams.items():
            if stream in ("b", "c"):
                kw = {**kw, "delete_frac": args.deletes}
            t = time.perf_counter()
            source = SourceTable(args.seed, keys=keys, partitions=PARTITIONS, **kw)
            records = source.events(n)
            made_s = time.perf_counter() - t
            topics[stream] = f"bench-cdc-{stream}-{uuid.uuid4().hex[:8]}"
            create_topic(bootstrap, topics[stream])
            t = time.perf_counter()
            produce_stream(bootstrap, topics[stream], records, chunk=50_000,
                           config=PRODUCER)
            size = sum(len(r[1] or b"") for r in records)
            print(f"{label}: {source.describe()}; {len(records)} records, {size / len(records):,.0f} B a record; "
                  f"made in {made_s:.1f} s, produced in {time.perf_counter() - t:.1f} s", flush=True)
            sources[stream] = source
            del records

        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in streams}
        order = list(streams)
        for rnd in range(args.rounds):
            shift = rnd % len(order)
            for stream in order[shift:] + order[:shift]:
                runs[stream].append(end_to_end(stream, rnd, bootstrap, topics[stream], workdir, args.lanes, dsn,
                                               args.sink))
            print(f"round {rnd + 1}/{args.rounds}: " + "  ".join(f"{s} {runs[s][-1]['rate']:,.0f}/s" for s in order),
                  flush=True)
        idles = {s: idle_cpu_s(s, bootstrap, workdir, args.lanes, dsn, args.sink) for s in order}

        # The tables of the last round: each the source table's final state.
        for stream, rs in runs.items():
            source = sources[stream]
            for r in rs:
                assert r["consumed"] == source.records_made, \
                    f"{stream}: consumed {r['consumed']} of {source.records_made} records"
                assert r["dead"] == 0, f"{stream}: {r['dead']} records dead-lettered"
            check_table(streams[stream][0], read_table(args.sink, dsn, rs[-1], stream != "a"), source)

        figures: dict[str, dict[str, Any]] = {}
        print(f"\n{n} change events per stream over {PARTITIONS} partitions, {keys} keys, "
              f"{args.deletes:.0%} deletes in (b) and (c) (+ a tombstone each), sink {args.sink}, lanes {args.lanes}, "
              f"batch {BATCH_ROWS} rows; {args.rounds} rounds, interleaved (best, median)")
        head = (f"{'stream':<38}{'records':>9}{'rec/s best':>12}{'median':>10}{'changes/s':>11}"
                f"{'own CPU us/rec':>16}{'us/change':>11}{'machine us/rec':>16}")
        print(head)
        for stream, rs in runs.items():
            source = sources[stream]
            records, changes = source.records_made, source.events_made
            rates = [r["rate"] for r in rs]
            best, median = max(rates), statistics.median(rates)
            own = statistics.median((r["process_cpu_s"] - idles[stream]) / records * 1e6 for r in rs)
            machine = [r["machine_cpu_us"] for r in rs if r["machine_cpu_us"]]
            fig = {"records": records, "changes": changes, "best": best, "median": median,
                   "changes_per_s_median": median * changes / records, "own_cpu_us_per_record": own,
                   "own_cpu_us_per_change": own * records / changes,
                   "machine_cpu_us_per_record": statistics.median(machine) if machine else None,
                   "idle_cpu_s": idles[stream], "rates": rates,
                   "peak_rss_bytes": max(r["rss"] for r in rs), "rows_deleted_last": rs[-1]["deleted"],
                   "write_tier": rs[-1]["tier"],
                   "columnar_share": statistics.median(r["columnar_records"] / r["consumed"] for r in rs)}
            figures[stream] = fig
            print(f"{streams[stream][0]:<38}{records:>9}{best:>12,.0f}{median:>10,.0f}"
                  f"{fig['changes_per_s_median']:>11,.0f}{own:>16.2f}{fig['own_cpu_us_per_change']:>11.2f}"
                  + (f"{fig['machine_cpu_us_per_record']:>16.1f}" if machine else f"{'-':>16}"))
        a = figures["a"]
        for stream in [s for s in order if s != "a"]:
            f = figures[stream]
            print(f"{stream}/a (medians): records/s x{f['median'] / a['median']:.3f}   "
                  f"changes/s x{f['changes_per_s_median'] / a['changes_per_s_median']:.3f}   "
                  f"own CPU per change x{f['own_cpu_us_per_change'] / a['own_cpu_us_per_change']:.3f}"
                  + ("   (target >= 0.8 x)" if stream == "b" else ""))
        for stream in order:
            f = figures[stream]
            print(f"{streams[stream][0]}: write tier {f['write_tier']}, records written by the columnar tier "
                  f"{f['columnar_share']:.0%} (median of the rounds)")
        print("(records/s: Kafka records consumed / the run's busy time, tombstones included; changes/s: the same "
              "without tombstones; own CPU: user + sys of the ingest process less its idle run, median)")
        print("(end-to-end tables of the last round: each equals its source table's final state -- "
              + "; ".join(f"{s} {len(sources[s].rows)} rows" for s in order) + ")")
        if args.json:
            args.json.write_bytes(orjson.dumps({"records": n, "rounds": args.rounds, "sink": args.sink,
                                                "lanes": args.lanes, "deletes": args.deletes, "streams": figures},
                                               option=orjson.OPT_INDENT_2))
    finally:
        close_producers()
        services.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
