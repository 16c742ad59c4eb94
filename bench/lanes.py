"""Lanes scaling benchmark: a sink that waits a fixed time per batch, lanes 1, 2, 4, 8, measured in one run.

    .venv/bin/python bench/lanes.py [--records 50000] [--keys 256] [--sleep 0.1] [--batch 250]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded
PostgreSQL (pgserver). Produces one topic (8 partitions, ``--records`` JSON
records of ~100 B over ``--keys`` distinct Kafka keys) and a second topic of the
same size with a single key. Each run is ``ingest run --until-idle`` as a
subprocess on the whole backlog, fresh consumer group, fresh table whose
statement-level ``AFTER INSERT`` trigger runs ``pg_sleep(--sleep)``: every batch
(one ``INSERT .. SELECT .. ON CONFLICT`` per batch) waits that long, like a sink
with a fixed round trip. Batches are ``--batch`` records (``max_rows``).

Throughput is ``rate_per_s`` from ``--summary-json`` (first record consumed to
last batch handled). Runs: lanes 1, 2, 4, 8 on the many-key topic, then lanes 8
on the one-key topic (≈ one lane's rate; its "hot key" warning is counted).
Prints a table and the ratios 8 lanes / 1 lane (target ≥ 5×) and one key at
8 lanes / 1 lane (target ≈ 1×). Exits 1 if a run did not consume every record.

Why 100 ms per batch by default: the ratio only measures lanes when the fixed
wait dominates each batch. On a 2-core machine shared by broker, PostgreSQL and
ingest, one batch of 250 records also costs ~15-20 ms of real work (COPY, upsert,
fsync'd commit, Python), and the whole machine tops out around 30k records/s
with no wait at all; with ``--sleep 0.01 --batch 50`` 8 lanes reached only ~4x
(machine-bound, not lane-bound). Keys are produced in random order: a strict
rotation (key-0, key-1, ...) aliases with the 1-in-16 hot-key sampler and makes
it report keys that are not hot.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from pathlib import Path

import orjson
import psycopg
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.embedded import start_all  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import send_all  # noqa: E402

PARTITIONS = 8
COLUMNS = {
    "k": {"type": "text", "source": "@key", "required": True},
    "seq": {"type": "bigint", "source": "$.seq"},
    "pad": {"type": "text", "source": "$.pad"},
}
CLIENT = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def progress(msg: str) -> None:
    """Progress lines start with '%' (bench/report drops them from the result)."""
    print(f"% {msg}", flush=True)


def produce(bootstrap: str, topic: str, n: int, keys: int) -> None:
    pad = "x" * 60
    rng = random.Random(7)  # keys in random order (a strict rotation would alias with the 1-in-16 hot-key sampler)
    send_all(bootstrap, ((topic, f"key-{rng.randrange(keys)}".encode(), orjson.dumps({"seq": i, "pad": pad}))
                         for i in range(n)))


def make_table(dsn: str, table: str, sleep_s: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        conn.execute(f'CREATE TABLE "{table}" (k text PRIMARY KEY, seq bigint, pad text)')
        conn.execute(f"""
            CREATE OR REPLACE FUNCTION bench_lanes_sleep() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep({float(sleep_s)}); RETURN NULL; END $$""")
        conn.execute(f'CREATE TRIGGER "{table}_sleep" AFTER INSERT ON "{table}" '
                     f"FOR EACH STATEMENT EXECUTE FUNCTION bench_lanes_sleep()")


def drop_tables(dsn: str, tables: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in tables:
            conn.execute(f'DROP TABLE IF EXISTS "{t}"')
        conn.execute("DROP FUNCTION IF EXISTS bench_lanes_sleep() CASCADE")


def run(bootstrap: str, dsn: str, topic: str, lanes: int, batch: int, sleep_s: float, tag: str) -> dict:
    table = f"bench_lanes_{tag}"
    make_table(dsn, table, sleep_s)
    name = f"lanes{tag}"
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": CLIENT},
        "pipelines": [{
            "name": name, "topics": [topic], "group_id": f"bench-lanes-{uuid.uuid4().hex}",
            "lanes": lanes, "batch": {"max_rows": batch, "max_latency_ms": 200},
            "hot_key_interval_s": 1,
            "sink": {"kind": "postgres", "dsn": dsn, "table": table, "conflict_key": ["k"], "columns": COLUMNS},
            "dlq": {"kind": "postgres", "table": "bench_lanes_dlq"},
        }],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "summary.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        proc = subprocess.run([sys.executable, "-m", "ingest", "run", "-c", str(path), "--until-idle", "2",
                               "--metrics-port", "0", "--log-level", "warning", "--summary-json", str(summary)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ingest run exited {proc.returncode}: {proc.stderr[-2000:]}")
        data = orjson.loads(summary.read_bytes())
    stats = data["pipelines"][name]
    hot = []
    for line in proc.stderr.splitlines():
        if line.startswith("{") and '"hot key' in line:
            hot.append(orjson.loads(line))
    return {"rate": stats["rate_per_s"], "consumed": stats["records_consumed"], "batches": stats["batches"],
            "busy_s": stats["busy_s"], "hot_keys": Counter(e.get("key") for e in hot), "table": table}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--keys", type=int, default=256, help="distinct keys of the many-key topic (>= 64)")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds each batch waits in the sink")
    ap.add_argument("--batch", type=int, default=250, help="max_rows per batch")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()

    services = start_all()
    tables: list[str] = []
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        many, one = f"bench-lanes-many-{uuid.uuid4().hex[:8]}", f"bench-lanes-one-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for f in admin.create_topics([NewTopic(many, PARTITIONS, 1), NewTopic(one, PARTITIONS, 1)]).values():
            f.result()
        t = time.perf_counter()
        produce(bootstrap, many, args.records, args.keys)
        produce(bootstrap, one, args.records, 1)
        progress(f"produced 2 x {args.records} records in {time.perf_counter() - t:.1f} s")

        results: list[tuple[str, int, int, dict]] = []
        for lanes in args.lanes:
            progress(f"lanes {lanes}, {args.keys} keys ...")
            r = run(bootstrap, dsn, many, lanes, args.batch, args.sleep, f"many{lanes}")
            tables.append(r["table"])
            results.append((f"{args.keys} keys", args.keys, lanes, r))
        top = max(args.lanes)
        progress(f"lanes {top}, 1 key ...")
        r = run(bootstrap, dsn, one, top, args.batch, args.sleep, f"one{top}")
        tables.append(r["table"])
        results.append(("1 key", 1, top, r))

        per_lane = Counter(zlib.crc32(f"key-{i}".encode()) % top for i in range(args.keys))
        print(f"records: {args.records} per topic over {PARTITIONS} partitions; sink waits {args.sleep * 1000:.0f} ms "
              f"per batch (statement trigger pg_sleep); batch max_rows {args.batch}")
        print(f"keys per lane at lanes={top} (crc32 % {top}): {sorted(per_lane.values())}")
        print(f"{'topic':<10}{'lanes':>6}{'records/s':>12}{'vs 1 lane':>11}{'batches':>9}{'busy s':>8}  hot-key warnings")
        base = next((r["rate"] for _, _, lanes, r in results if lanes == 1), None)
        ok = True
        for label, _keys, lanes, r in results:
            ok &= r["consumed"] == args.records
            ratio = f"{r['rate'] / base:.2f}x" if base else "-"
            hot = ", ".join(f"{k} x{n}" for k, n in r["hot_keys"].items()) or "none"
            print(f"{label:<10}{lanes:>6}{r['rate']:>12,.0f}{ratio:>11}{r['batches']:>9}{r['busy_s']:>8.1f}  {hot}")
        if base:
            top_many = next(r for label, _, lanes, r in results if lanes == top and label != "1 key")
            one_r = results[-1][3]
            scale = top_many["rate"] / base
            print(f"\nratio {top} lanes / 1 lane ({args.keys} keys): {scale:.2f}x (target >= 5x: "
                  f"{'met' if scale >= 5 else 'NOT met'})")
            print(f"ratio 1 key at {top} lanes / 1 lane: {one_r['rate'] / base:.2f}x (target ~1x); hot key warning "
                  f"{'fired' if one_r['hot_keys'] else 'did NOT fire'}")
        if not ok:
            print("ERROR: a run did not consume every record")
            return 1
        return 0
    finally:
        try:
            drop_tables(services.pg_dsn, [*tables, "bench_lanes_dlq"])
        except Exception:  # noqa: BLE001 - best effort
            pass
        services.close()


if __name__ == "__main__":
    sys.exit(main())
