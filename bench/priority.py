"""Priority with aging, measured: queue waits of a mixed backlog, with and without priorities, in one run.

    .venv/bin/python bench/priority.py [--records 100000] [--slots 2] [--sleep-ms 20] [--aging-ms 100]
                                       [--max-buffered 20000]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded
PostgreSQL (pgserver). Three pipelines share one database whose write budget is
``max_concurrent_writes`` (default 2) -- ``orders`` (priority 10), ``payments``
(5) and ``clicks`` (0), each with its own topic, table and 2 lanes. Every insert
statement into their tables sleeps ``--sleep-ms`` (a statement-level trigger),
so the write slots are the bottleneck, as with a busy database. Each pipeline
buffers at most ``--max-buffered`` records (then pauses its source), so
consumption is paced by the writes instead of decoding every backlog in one
burst at the start (a burst that starves the slot holders of the GIL and makes
the first seconds' waits mostly noise).

Two passes of ``ingest run`` (one process, one config holding the three
pipelines, fresh topics, tables and groups each pass) get the same mixed
backlog, produced in interleaved chunks once every pipeline holds its
partitions (so no group join gives one a head start):

  (1) with priorities   -- 10 / 5 / 0, ``scheduler.aging_ms_per_level`` = --aging-ms
  (2) without           -- every pipeline priority 0 (FIFO)

and prints, per pipeline and priority, the p50 / p95 / p99 / max wait of a ready
batch for a write slot (``--summary-json`` -> ``queue_wait_s``) and when the
pipeline's last row was in (seconds after the first write of the pass), side by
side. The database's own log of the writes (start and end of each statement)
confirms that no more than ``max_concurrent_writes`` ran at once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.embedded import start_all  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import send_all  # noqa: E402

PIPELINES = (("orders", 10), ("payments", 5), ("clicks", 0))
PARTITIONS = 4
LANES = 2
BATCH_ROWS = 500
CLIENT = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "kind": {"type": "text", "source": "$.kind"},
    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
}


def create_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(n, PARTITIONS, 1) for n in names]).values():
        f.result(30)
    deadline = time.monotonic() + 30
    while True:  # metadata with a leader for every partition
        md = admin.list_topics(timeout=5)
        if all(n in md.topics and len(md.topics[n].partitions) == PARTITIONS
               and all(p.leader >= 0 for p in md.topics[n].partitions.values()) for n in names):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"topics {names} not ready")
        time.sleep(0.1)


def produce_interleaved(bootstrap: str, topics: list[str], n: int, chunk: int = 2000) -> None:
    def messages() -> Iterator[tuple[str, bytes, bytes]]:
        for start in range(0, n, chunk):
            for topic in topics:
                for i in range(start, min(n, start + chunk)):
                    yield topic, str(i).encode(), orjson.dumps({"id": i, "kind": "click" if i % 3 else "view",
                                                                "amount": round(i % 10000 / 100, 2),
                                                                "ts": 1764460800000 + i})

    send_all(bootstrap, messages())


def slow_down_and_log(dsn: str, tables: list[str], sleep_ms: int) -> None:
    """Each INSERT/COPY into ``tables`` sleeps ``sleep_ms`` and records its start and end in bench_write_log."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_write_log (tbl text, xid bigint, started timestamptz, "
                     "ended timestamptz)")
        conn.execute(
            "CREATE OR REPLACE FUNCTION bench_slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "  IF TG_WHEN = 'BEFORE' THEN "
            "    INSERT INTO bench_write_log VALUES (TG_TABLE_NAME, txid_current(), clock_timestamp(), NULL); "
            f"    PERFORM pg_sleep({sleep_ms / 1000}); "
            "  ELSE "
            "    UPDATE bench_write_log SET ended = clock_timestamp() "
            "    WHERE xid = txid_current() AND tbl = TG_TABLE_NAME; "
            "  END IF; RETURN NULL; END $$")
        for t in tables:
            conn.execute(f'CREATE TRIGGER slow BEFORE INSERT ON "{t}" FOR EACH STATEMENT '
                         "EXECUTE FUNCTION bench_slow_insert()")
            conn.execute(f'CREATE TRIGGER slow_end AFTER INSERT ON "{t}" FOR EACH STATEMENT '
                         "EXECUTE FUNCTION bench_slow_insert()")


def write_log(dsn: str, tables: list[str]) -> list[tuple[str, float, float]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT tbl, extract(epoch FROM started)::float8, extract(epoch FROM ended)::float8 "
            "FROM bench_write_log WHERE tbl = ANY(%s) ORDER BY started", (tables,)).fetchall()


def max_concurrent(writes: list[tuple[str, float, float]]) -> int:
    events = sorted([(s, 1) for _, s, _ in writes] + [(e, -1) for _, _, e in writes])  # ends first on ties
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def assigned_pipelines(stderr_path: Path) -> set[str]:
    got = set()
    for line in stderr_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                e = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if e.get("event") == "partitions assigned" and e.get("partitions"):
                got.add(e.get("pipeline"))
    return got


def run_pass(label: str, bootstrap: str, dsn: str, args: argparse.Namespace, prioritized: bool) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    names = [name for name, _ in PIPELINES]
    topics = {name: f"prio-{label}-{name}-{tag}" for name in names}
    tables = {name: f"prio_{label}_{name}" for name in names}
    create_topics(bootstrap, list(topics.values()))
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": CLIENT},
        "scheduler": {"aging_ms_per_level": args.aging_ms},
        "pipelines": [{
            "name": name, "topics": [topics[name]], "group_id": f"prio-{label}-{name}-{tag}",
            "priority": priority if prioritized else 0, "lanes": LANES,
            "max_buffered_records": args.max_buffered,
            "batch": {"max_rows": BATCH_ROWS, "max_latency_ms": 100},
            "sink": {"kind": "postgres", "dsn": dsn, "table": tables[name], "conflict_key": ["id"],
                     "columns": COLUMNS, "max_concurrent_writes": args.slots},
            "dlq": {"kind": "postgres", "table": "prio_dlq"},
        } for name, priority in PIPELINES],
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "priority.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "summary.json"
        subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        slow_down_and_log(dsn, list(tables.values()), args.sleep_ms)
        err_path = Path(tmp) / "stderr.log"
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ingest", "run", "-c", str(path), "--until-idle", "3", "--metrics-port", "0",
                 "--log-level", "info", "--summary-json", str(summary)],
                env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 90
            while assigned_pipelines(err_path) != set(names):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pipelines not assigned: {err_path.read_text()[-3000:]}")
                time.sleep(0.1)
            produce_interleaved(bootstrap, [topics[n] for n in names], args.records)
            if proc.wait(600) != 0:
                raise RuntimeError(f"ingest run exited {proc.returncode}: {err_path.read_text()[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        data = orjson.loads(summary.read_bytes())
    writes = write_log(dsn, list(tables.values()))
    t0 = min(s for _, s, _ in writes)
    out: dict[str, Any] = {"max_concurrent": max_concurrent(writes), "pipelines": {}}
    for name in names:
        stats = data["pipelines"][name]
        if stats["records_consumed"] != args.records or stats["dead_lettered"]:
            raise RuntimeError(f"{label}/{name}: consumed {stats['records_consumed']} of {args.records}, "
                               f"dead-lettered {stats['dead_lettered']}")
        mine = [w for w in writes if w[0] == tables[name]]
        out["pipelines"][name] = {"wait": stats["queue_wait_s"], "batches": stats["batches"],
                                  "drained_s": max(e for _, _, e in mine) - t0}
    out["total_s"] = max(e for _, _, e in writes) - t0
    durations = sorted(e - s for _, s, e in writes)
    out["write_p50_s"], out["write_max_s"] = durations[len(durations) // 2], durations[-1]
    out["writes"] = len(writes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000, help="backlog per pipeline")
    ap.add_argument("--slots", type=int, default=2, help="sink.max_concurrent_writes of the shared database")
    ap.add_argument("--sleep-ms", type=int, default=20, help="extra cost of every insert statement")
    ap.add_argument("--aging-ms", type=int, default=100, help="scheduler.aging_ms_per_level")
    ap.add_argument("--max-buffered", type=int, default=20_000,
                    help="max_buffered_records per pipeline (a waiting pipeline pauses its source here)")
    args = ap.parse_args()

    services = start_all()
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        t = time.perf_counter()
        with_p = run_pass("prio", bootstrap, dsn, args, prioritized=True)
        without = run_pass("fifo", bootstrap, dsn, args, prioritized=False)
        elapsed = time.perf_counter() - t
    finally:
        services.close()

    print(f"\nmixed backlog: {len(PIPELINES)} pipelines x {args.records} records, batches of {BATCH_ROWS} rows, "
          f"{LANES} lanes each; one database, max_concurrent_writes {args.slots}, every write +{args.sleep_ms} ms; "
          f"aging {args.aging_ms} ms/level")
    head = f"{'p50':>7}{'p95':>7}{'p99':>7}{'max':>7}{'drained':>9}"
    print(f"\n{'':<20}{'with priorities (10/5/0)':^37}   {'without (all priority 0)':^37}")
    print(f"{'pipeline':<11}{'prio':>5}    {head}   {head}")
    for name, priority in PIPELINES:
        cells = []
        for res in (with_p, without):
            p = res["pipelines"][name]
            w = p["wait"]
            cells.append(f"{w['p50']:>7.3f}{w['p95']:>7.3f}{w['p99']:>7.3f}{w['max']:>7.3f}{p['drained_s']:>8.1f}s")
        print(f"{name:<11}{priority:>5}    {cells[0]}   {cells[1]}")
    print("\nqueue wait in seconds per batch; drained = last row of the pipeline in, seconds after the pass's "
          "first write")
    print(f"all drained after {with_p['total_s']:.1f} s with priorities, {without['total_s']:.1f} s without; "
          f"most writes at once seen by the database: {with_p['max_concurrent']} / {without['max_concurrent']} "
          f"(budget {args.slots}); bench {elapsed:.0f} s")
    print("writes (statement start to rows in, at the database): " + "; ".join(
        f"{label} {res['writes']} writes, p50 {res['write_p50_s'] * 1000:.0f} ms, max {res['write_max_s'] * 1000:.0f} ms"
        for label, res in (("with priorities", with_p), ("without", without))))
    for res in (with_p, without):
        if res["max_concurrent"] > args.slots:
            print(f"WARNING: {res['max_concurrent']} concurrent writes exceed the budget of {args.slots}")


if __name__ == "__main__":
    main()
