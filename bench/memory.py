"""Memory under a large backlog: peak RSS with a crawling sink does not grow with the backlog.

    .venv/bin/python bench/memory.py [--backlogs 200000 1000000] [--duration 60] [--max-buffered 20000]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded
PostgreSQL (pgserver). For each backlog size: a fresh 6-partition topic gets that
many ~100 B JSON records (produced as fast as the broker takes them), and
``ingest run`` (one process, ``max_buffered_records: --max-buffered``) consumes it
into a table whose statement-level trigger sleeps ``--crawl`` seconds per batch,
so the sink writes ~``lanes * max_rows / crawl`` records/s and the consumer sits
paused by backpressure almost all the time. After ``--duration`` seconds the
process gets SIGTERM (flush, final commit). Its RSS is sampled with psutil every
0.5 s.

A baseline run on an empty topic gives the fixed overhead (interpreter,
libraries, librdkafka, pools). Two bounds sit on top of it: ingest's own
buffer, ``(max_buffered_records + consume_batch_size) * bytes per in-flight
record`` (the bytes per record measured here with tracemalloc on the same
records: Record + mapped row + Item, as the pipeline holds them), and
librdkafka's prefetch queue, ``queued.max.messages.kbytes`` of payload (ingest's
default 32 MiB) counted twice for librdkafka's per-message bookkeeping. An
attribution run repeats the largest backlog with a 1 MiB prefetch queue, so
what librdkafka holds and what ingest holds can be told apart.

Reported per run: RSS over time, peak RSS (sampled, and the kernel's VmHWM),
peak minus baseline, seconds paused, records consumed, and whether the consumer
was rebalanced (it must hold one assignment from start to SIGTERM: no
``partitions revoked`` / ``lost`` before the signal). Exits 1 if a run
rebalanced, failed, wrote fewer rows than it consumed or grew past
baseline + bounds + slack.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import orjson
import psutil
import psycopg
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.core.mapping import Mapper  # noqa: E402
from ingest.embedded import start_all  # noqa: E402
from ingest.sinks.postgres.settings import PostgresSinkSettings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import send_all  # noqa: E402

from ingest.types import Item, Record  # noqa: E402

PARTITIONS = 6
CONSUME_BATCH = 5000  # kafka.consume_batch_size (the default)
COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "user_id": {"type": "bigint", "source": "$.user"},
    "kind": {"type": "text", "source": "$.kind"},
    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
}
CLIENT = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
MiB = 2**20


def progress(msg: str) -> None:
    print(f"% {msg}", flush=True)


def value(i: int) -> bytes:
    return orjson.dumps({"id": i, "user": i % 997, "kind": "click" if i % 3 else "view",
                         "amount": round(i % 10000 / 100, 2), "ts": 1764460800000 + i, "pad": "p" * 16})


def key(i: int) -> bytes:
    return str(i).encode()


def produce(bootstrap: str, topic: str, n: int) -> float:
    t = time.perf_counter()
    send_all(bootstrap, ((topic, key(i), value(i)) for i in range(n)), flush_timeout_s=300, config={
        "linger.ms": 50, "batch.size": 1_000_000, "compression.type": "none", "queue.buffering.max.kbytes": 1_048_576})
    return time.perf_counter() - t


def bytes_per_record(n: int = 20_000) -> float:
    """Python heap bytes per in-flight record (Record + mapped row + Item), measured with tracemalloc."""
    mapper = Mapper(PostgresSinkSettings(dsn="postgresql://x@y/z", table="t", conflict_key=["id"],
                                         columns=COLUMNS).columns)
    raw = [(key(i), value(i)) for i in range(n)]  # as librdkafka hands them over: fresh bytes per message
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = []
    for i, (k, v) in enumerate(raw):
        rec = Record("memory-bench-topic", i % PARTITIONS, i, bytes(k), bytes(v), 1764460800000 + i, ())
        row, _ = mapper.map(rec)
        held.append(Item(rec, row, None, 1, len(v) + len(k) + 64))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def make_table(dsn: str, table: str, crawl_s: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        conn.execute(f'CREATE TABLE "{table}" (id bigint PRIMARY KEY, user_id bigint, kind text, '
                     f"amount numeric(12,2), ts timestamptz)")
        conn.execute(f"""
            CREATE OR REPLACE FUNCTION bench_memory_crawl() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep({float(crawl_s)}); RETURN NULL; END $$""")
        conn.execute(f'CREATE TRIGGER "{table}_crawl" AFTER INSERT ON "{table}" '
                     f"FOR EACH STATEMENT EXECUTE FUNCTION bench_memory_crawl()")


def vm_hwm(pid: int) -> int:
    """The process's own RSS high-water mark (``VmHWM``; unlike ``ru_maxrss`` it is not inherited
    from the parent across fork/exec)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def events(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                pass
    return out


def run(bootstrap: str, dsn: str, topic: str, tag: str, args: argparse.Namespace, duration_s: float) -> dict:
    table = f"bench_memory_{tag}"
    make_table(dsn, table, args.crawl)
    name = f"mem{tag}"
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": {**CLIENT, **args.client},
                  "consume_batch_size": CONSUME_BATCH},
        "pipelines": [{
            "name": name, "topics": [topic], "group_id": f"bench-memory-{uuid.uuid4().hex}",
            "lanes": args.lanes, "batch": {"max_rows": args.batch, "max_latency_ms": 200},
            "max_buffered_records": args.max_buffered, "shutdown_timeout_s": 120,
            "sink": {"kind": "postgres", "dsn": dsn, "table": table, "conflict_key": ["id"], "columns": COLUMNS},
            "dlq": {"kind": "postgres", "table": "bench_memory_dlq"},
        }],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "summary.json"
        err_path = Path(tmp) / "stderr"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "ingest", "run", "-c", str(path), "--metrics-port", "0",
                                     "--log-level", "info", "--summary-json", str(summary)],
                                    env=env, stdout=subprocess.DEVNULL, stderr=err)
        ps = psutil.Process(proc.pid)
        samples: list[tuple[float, int]] = []
        started = time.monotonic()
        assigned_at: float | None = None
        while time.monotonic() - started < duration_s and proc.poll() is None:
            try:
                samples.append((time.monotonic() - started, ps.memory_info().rss))
            except psutil.Error:
                break
            if assigned_at is None and b"partitions assigned" in err_path.read_bytes():
                assigned_at = time.monotonic() - started
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"ingest exited early ({proc.returncode}): {err_path.read_text()[-2000:]}")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stop_samples = 0
        hwm = vm_hwm(proc.pid)
        while proc.poll() is None and time.monotonic() - signalled < 150:
            try:
                samples.append((time.monotonic() - started, ps.memory_info().rss))
                stop_samples += 1
                hwm = max(hwm, vm_hwm(proc.pid))
            except psutil.Error:
                break
            time.sleep(0.5)
        code = proc.wait(30)
        stderr = err_path.read_text(errors="replace")
        data = orjson.loads(summary.read_bytes()) if summary.exists() else {}
    evs = [e.get("event") for e in events(stderr)]
    cut = evs.index("signal received: stopping") if "signal received: stopping" in evs else len(evs)
    stats = data.get("pipelines", {}).get(name, {})
    with psycopg.connect(dsn, autocommit=True) as conn:
        written = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
        conn.execute(f'DROP TABLE "{table}"')
    running = [rss for t, rss in samples[: len(samples) - stop_samples]]
    return {
        "exit": code, "samples": samples, "running_peak": max(running), "peak": max(rss for _, rss in samples),
        "summary_peak": data.get("peak_rss_bytes", 0), "hwm": hwm, "paused_s": stats.get("paused_s", 0.0),
        "consumed": stats.get("records_consumed", 0), "written": written, "assigned_at": assigned_at,
        "assignments": evs[:cut].count("partitions assigned"),
        "rebalanced": "partitions revoked" in evs[:cut] or "partitions lost" in evs[:cut],
        "pauses": evs.count("backpressure: pausing"), "stop_s": time.monotonic() - signalled,
    }


def rss_at(samples: list[tuple[float, int]], t: float) -> int:
    best = min(samples, key=lambda s: abs(s[0] - t))
    return best[1]


#: librdkafka prefetch settings of the attribution run (small queue: what is left is ingest's own memory)
SMALL_PREFETCH = {"queued.max.messages.kbytes": 1024, "queued.min.messages": 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backlogs", type=int, nargs="+", default=[200_000, 1_000_000])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds each run consumes before SIGTERM")
    ap.add_argument("--max-buffered", type=int, default=20_000, help="max_buffered_records")
    ap.add_argument("--crawl", type=float, default=1.0, help="seconds the sink sleeps per batch")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1000, help="max_rows per batch")
    ap.add_argument("--slack-mib", type=float, default=16.0,
                    help="allowed RSS above baseline + the bounds (allocator fragmentation)")
    ap.add_argument("--no-attribution", action="store_true",
                    help="skip the extra run on the largest backlog with a 1 MiB librdkafka prefetch queue")
    ap.add_argument("--client", action="append", default=[], metavar="KEY=VALUE",
                    help="extra librdkafka consumer setting for every run (repeatable)")
    args = ap.parse_args()
    args.client = {k: (int(v) if v.isdigit() else v) for k, v in (kv.split("=", 1) for kv in args.client)}

    from ingest.sources.kafka_config import _DEFAULTS as KAFKA_DEFAULTS

    prefetch_kib = int(args.client.get("queued.max.messages.kbytes", KAFKA_DEFAULTS["queued.max.messages.kbytes"]))
    per_record = bytes_per_record()
    services = start_all()
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        admin = AdminClient({"bootstrap.servers": bootstrap})
        topics = {n: f"bench-memory-{n}-{uuid.uuid4().hex[:8]}" for n in [0, *args.backlogs]}
        for f in admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in topics.values()]).values():
            f.result()

        progress("baseline run on an empty topic ...")
        base = run(bootstrap, dsn, topics[0], "empty", args, duration_s=12)
        baseline = base["running_peak"]
        produced_s: dict[int, float] = {}
        runs: list[tuple[str, int, dict]] = []  # (label, backlog, result)
        for n in args.backlogs:
            secs = produce(bootstrap, topics[n], n)
            produced_s[n] = secs
            progress(f"produced {n} records in {secs:.1f} s ({n / secs:,.0f}/s); running {args.duration:.0f} s ...")
            runs.append((f"{n:,}", n, run(bootstrap, dsn, topics[n], str(n), args, args.duration)))
        if not args.no_attribution:
            n = max(args.backlogs)
            progress(f"attribution run: {n} backlog with a 1 MiB librdkafka prefetch queue ...")
            small = argparse.Namespace(**{**vars(args), "client": {**args.client, **SMALL_PREFETCH}})
            runs.append((f"{n:,} q1M", n, run(bootstrap, dsn, topics[n], f"{n}q", small, args.duration)))

        py_bound = (args.max_buffered + CONSUME_BATCH) * per_record
        # librdkafka holds up to queued.max.messages.kbytes of payload; its per-message bookkeeping
        # roughly doubles that for ~100 B records, so the payload cap is counted twice.
        rdk_bound = 2 * prefetch_kib * 1024
        limit = baseline + py_bound + rdk_bound + args.slack_mib * MiB
        sink_rate = args.lanes * args.batch / args.crawl
        print(f"record ~{len(key(1)) + len(value(1))} B (key + JSON value); {PARTITIONS} partitions; sink crawls at "
              f"~{sink_rate:,.0f} records/s ({args.lanes} lanes x {args.batch} rows per {args.crawl:g} s batch); "
              f"each run {args.duration:.0f} s, then SIGTERM")
        print(f"ingest buffer: (max_buffered_records {args.max_buffered:,} + consume_batch_size {CONSUME_BATCH:,}) x "
              f"{per_record:,.0f} B per in-flight record (tracemalloc) = {py_bound / MiB:.1f} MiB")
        print(f"librdkafka prefetch: queued.max.messages.kbytes {prefetch_kib} KiB payload, x2 for its per-message "
              f"overhead = {rdk_bound / MiB:.1f} MiB")
        print(f"baseline (empty topic, same config): peak RSS {baseline / MiB:.1f} MiB")
        print()
        print(f"{'backlog':>14}{'produce s':>10}{'consumed':>10}{'paused s':>9}{'pauses':>7}"
              f"{'RSS@10s':>9}{'RSS@30s':>9}{'RSS@end':>9}{'peak':>8}{'peak-base':>10}{'VmHWM':>8}"
              f"{'assigns':>8}{'rebal':>6}")
        ok = True
        for label, n, r in runs:
            a = r["assigned_at"] or 0
            print(f"{label:>14}{produced_s[n]:>10.1f}{r['consumed']:>10,}{r['paused_s']:>9.1f}{r['pauses']:>7}"
                  f"{rss_at(r['samples'], a + 10) / MiB:>9.1f}{rss_at(r['samples'], a + 30) / MiB:>9.1f}"
                  f"{rss_at(r['samples'], args.duration) / MiB:>9.1f}{r['running_peak'] / MiB:>8.1f}"
                  f"{(r['running_peak'] - baseline) / MiB:>10.1f}{r['hwm'] / MiB:>8.1f}"
                  f"{r['assignments']:>8}{'yes' if r['rebalanced'] else 'no':>6}")
            ok &= not r["rebalanced"] and r["assignments"] == 1 and r["exit"] == 0
            ok &= r["consumed"] == r["written"]
            ok &= r["running_peak"] <= limit
        print("(MiB. RSS@Ns: N s after the partitions were assigned. peak: sampled every 0.5 s until SIGTERM. "
              "VmHWM: the kernel's high-water mark read just before exit, shutdown included. "
              "q1M: queued.max.messages.kbytes=1024, queued.min.messages=1000)")
        main_runs = [(n, r) for label, n, r in runs if not label.endswith("q1M")]
        if len(main_runs) >= 2:
            (n_small, r_small), (n_large, r_large) = min(main_runs), max(main_runs)
            print(f"\npeak RSS at {n_large:,} vs {n_small:,} backlog ({n_large / n_small:.0f}x the records, "
                  f"{n_large * (len(key(1)) + len(value(1))) / MiB:.0f} MiB of payload): "
                  f"{(r_large['running_peak'] - r_small['running_peak']) / MiB:+.1f} MiB")
        print(f"bound: peak <= baseline {baseline / MiB:.1f} + ingest buffer {py_bound / MiB:.1f} + librdkafka "
              f"prefetch {rdk_bound / MiB:.1f} + slack {args.slack_mib:.0f} = {limit / MiB:.1f} MiB: "
              f"{'held' if ok else 'NOT held (or a run rebalanced / failed / lost records)'}")
        summary_peaks = ", ".join(f"{r['summary_peak'] / MiB:.1f}" for _, _, r in runs)
        print(f"--summary-json peak_rss_bytes of the runs: {summary_peaks} MiB (ru_maxrss: inherited from the spawning "
              f"parent across exec -- this parent is {psutil.Process().memory_info().rss / MiB:.0f} MiB -- so not "
              f"the process's own peak; VmHWM is)")
        for label, _n, r in runs:
            print(f"{label}: one assignment: {'yes' if r['assignments'] == 1 else 'NO'}, "
                  f"{'REBALANCED' if r['rebalanced'] else 'no rebalance'} while paused {r['paused_s']:.0f} s in total "
                  f"(run {args.duration:.0f} s + shutdown); SIGTERM -> exit {r['exit']} in {r['stop_s']:.1f} s, "
                  f"{r['written']:,} rows written = {r['consumed']:,} consumed")
        return 0 if ok else 1
    finally:
        try:
            with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
                conn.execute("DROP TABLE IF EXISTS bench_memory_dlq")
                conn.execute("DROP FUNCTION IF EXISTS bench_memory_crawl() CASCADE")
        except Exception:  # noqa: BLE001 - best effort
            pass
        services.close()


if __name__ == "__main__":
    sys.exit(main())
