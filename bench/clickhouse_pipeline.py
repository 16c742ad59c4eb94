"""Kafka → ClickHouse benchmark: ``ingest run`` beside a raw ``client.insert`` of the same rows.

    .venv/bin/python bench/clickhouse_pipeline.py [--records 200000] [--lanes 1 2]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded
PostgreSQL (pgserver) for the DLQ, produces one topic of JSON records (6
partitions, ~110 B each, 1/3 as many keys as records so most are updates),
then measures on those same records, into modern ClickHouse in-process (chDB,
through clickhouse-connect's ``chdb://`` backend -- the only modern ClickHouse
that runs on these machines):

  (a) consume only -- the broker's delivery rate to one consumer: end to end can go no faster
                     (with chDB the pipeline is one process, so one consumer)
  (r) raw insert  -- the records consumed and mapped up front, then inserted with
                     ``client.insert(table, rows, column_names=..., column_type_names=...)``
                     in batches of the pipeline's batch size, one after another, into the
                     same ReplacingMergeTree table shape: the cost of ClickHouse and the
                     clickhouse-connect encoder alone
  (r1) raw insert, one call for all rows (the encoder's best case)
  (ra) raw insert_arrow -- the same batches as Arrow tables built from the rows, which is
                     what the sink sends when every column has an Arrow type (ch_arrow.py)
  (m) decode + map alone -- orjson + the ClickHouse-dialect mapper over the records
  (w) write path alone -- the mapped records through the batch writer serially, in
                     batches of the pipeline's size: dedupe by key, insert token,
                     columnar ``ClickHouseSink.write``
  (e) end to end  -- ``ingest run`` as a subprocess (first record → last batch handled:
                     consume, decode, map, dedupe by key, columnar insert with the
                     insert token, commit), per lane count, and its peak RSS

and prints e/r (target ≥ 0.5) and e/min(m, w), the bound e/r ≤ a/r, and the
cap the machine's CPU puts on doing (a) and (w) together (CPU-seconds of every
process per record, from /proc/stat), then checks the end-to-end table with FINAL. (m) and (w) say where the time goes: with chDB the insert runs
inside the ingest process, so decode/map and the Native encoding share its
cores (and the GIL) with ClickHouse itself.
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
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.config import PipelineSettings  # noqa: E402
from ingest.core.mapping import Mapper  # noqa: E402
from ingest.embedded import start_all  # noqa: E402
from ingest.sinks.clickhouse.arrow import ArrowEncoder  # noqa: E402
from ingest.sinks.clickhouse.schema import create_table_sql  # noqa: E402
from ingest.tuning import tune_for_throughput  # noqa: E402
from ingest.types import Item  # noqa: E402
from ingest.writer import BatchWriter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PARTITIONS,
    Window,
    consume_all,
    cpu_cap,
    create_topic,
    produce,
    run_measured,
)

BATCH_ROWS = 5000
DATABASE = "bench"
COLUMNS = {
    "event_id": {"type": "UInt64", "source": "$.id", "required": True},
    "user_id": {"type": "UInt32", "source": "$.user"},
    "kind": {"type": "LowCardinality(String)", "source": "$.kind"},
    "amount": {"type": "Decimal(12, 2)", "source": "$.amount"},
    "ts": {"type": "DateTime64(3)", "source": "$.ts"},
}


def pipeline_settings(name: str, url: str, topic: str, lanes: int, dlq_dsn: str) -> dict:
    return {
        "name": name, "topics": [topic], "group_id": f"bench-e2e-{uuid.uuid4().hex}", "lanes": lanes,
        "batch": {"max_rows": BATCH_ROWS, "max_latency_ms": 200},
        "sink": {"kind": "clickhouse", "url": url, "database": DATABASE, "table": name,
                 "order_by": ["event_id"], "columns": COLUMNS},
        "dlq": {"kind": "postgres", "dsn": dlq_dsn, "table": "bench_dlq"},
    }


def raw_insert(path: Path, rows: list[tuple], settings: PipelineSettings) -> tuple[float, float, float]:
    """Seconds for (batched inserts, one insert, batched Arrow inserts) of ``rows`` into fresh tables of the
    sink's shape."""
    import clickhouse_connect

    sink = settings.sink
    names = list(sink.columns)
    types = [t.ddl for t in sink.ch_types.values()]
    client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
    try:
        for stmt in create_table_sql(sink):
            client.command(stmt)
        table = f"{DATABASE}.{sink.table}"
        client.command(f"CREATE TABLE {table}_one AS {table}")
        client.insert(sink.table, rows[:10], column_names=names, column_type_names=types, database=DATABASE)
        client.command(f"TRUNCATE TABLE {table}")
        start = time.perf_counter()
        for i in range(0, len(rows), BATCH_ROWS):
            client.insert(sink.table, rows[i:i + BATCH_ROWS], column_names=names, column_type_names=types,
                          database=DATABASE)
        batched = time.perf_counter() - start
        start = time.perf_counter()
        client.insert(f"{sink.table}_one", rows, column_names=names, column_type_names=types, database=DATABASE)
        one = time.perf_counter() - start
        keys = len({row[0] for row in rows})
        assert client.command(f"SELECT count() FROM {table} FINAL") == keys
        # The same batches as Arrow tables built from the rows (what the sink does when it can).
        client.command(f"CREATE TABLE {table}_arrow AS {table}")
        encoder = ArrowEncoder.for_columns(names, list(sink.ch_types.values()))
        assert encoder is not None
        start = time.perf_counter()
        for i in range(0, len(rows), BATCH_ROWS):
            client.insert_arrow(f"{sink.table}_arrow", encoder.table(list(zip(*rows[i:i + BATCH_ROWS]))),
                                database=DATABASE)
        arrow = time.perf_counter() - start
        assert client.command(f"SELECT count() FROM {table}_arrow FINAL") == keys
    finally:
        client.close()
    return batched, one, arrow


class _NoDlq:
    def put(self, entries: object) -> None:
        raise AssertionError("no record of the benchmark is poison")

    def close(self) -> None:
        pass


def write_path(path: Path, items: list[Item], settings: PipelineSettings) -> Window:
    """Seconds for the batch writer + ClickHouseSink over ``items`` (serially, one lane)."""
    import threading

    from ingest.config import RetrySettings
    from ingest.sinks.clickhouse.sink import ClickHouseSink

    sink = ClickHouseSink(settings.sink, pipeline=settings.name)
    try:
        client = sink.client()
        for stmt in create_table_sql(settings.sink):
            client.command(stmt)
        writer = BatchWriter(pipeline=settings.name, write=sink.write, dlq=_NoDlq(), retry=RetrySettings(),
                             collapse_rule=settings.sink.collapse_rule(), abort=threading.Event(),
                             insert_tokens=True)
        window = Window()
        window.start()
        for i in range(0, len(items), BATCH_ROWS):
            result = writer.handle(0, items[i:i + BATCH_ROWS], "size")
            assert result.error is None, result.error
        return window.stop()
    finally:
        sink.close()


def _run_config(bootstrap: str, topic: str, workdir: Path, name: str, lanes: int, dlq_dsn: str) -> Path:
    path = workdir / f"chdb-{name}"
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [pipeline_settings(name, f"chdb://{path}", topic, lanes, dlq_dsn)],
    }
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(config)], check=True, env=ENV,
                   stdout=subprocess.DEVNULL)
    return config


ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run_command(config: Path, summary: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "ingest", "run", "-c", str(config), "--until-idle", "2", "--metrics-port", "0",
           "--log-level", "warning"]
    return cmd + (["--summary-json", str(summary)] if summary is not None else [])


def idle_cpu_s(bootstrap: str, workdir: Path, lanes: int, dlq_dsn: str) -> float:
    """CPU-seconds of ``ingest run`` on an empty topic (start-up, chDB load, group join, idle wait)."""
    topic = f"bench-idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    config = _run_config(bootstrap, topic, workdir, f"idle_{lanes}", lanes, dlq_dsn)
    return run_measured(_run_command(config), env=ENV)


def end_to_end(bootstrap: str, topic: str, workdir: Path, lanes: int, dlq_dsn: str, n: int, rnd: int) -> dict:
    import clickhouse_connect

    name = f"e2e_{lanes}_{rnd}"
    path = workdir / f"chdb-{name}"
    config = _run_config(bootstrap, topic, workdir, name, lanes, dlq_dsn)
    summary = workdir / f"{name}.json"
    process_cpu_s = run_measured(_run_command(config, summary), env=ENV)
    data = orjson.loads(summary.read_bytes())
    stats = data["pipelines"][name]
    client = clickhouse_connect.get_client(dsn=f"chdb://{path}")  # the subprocess has released the path
    try:
        final = client.command(f"SELECT count() FROM {DATABASE}.{name} FINAL")
    finally:
        client.close()
    return {"rate": stats["rate_per_s"], "rss": data["peak_rss_bytes"], "consumed": stats["records_consumed"],
            "written": stats["rows_written"], "final": final, "process_cpu_s": process_cpu_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure (a) and every (e) this many times, interleaved; report best and median")
    args = ap.parse_args()
    n = args.records

    services = start_all()
    workdir = Path(tempfile.mkdtemp(prefix="ingest-bench-ch-"))
    try:
        bootstrap, dlq_dsn = services.bootstrap, services.pg_dsn
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, topic)
        t = time.perf_counter()
        produce(bootstrap, topic, n)
        print(f"produced {n} records in {time.perf_counter() - t:.1f} s", flush=True)

        settings = PipelineSettings.model_validate(
            pipeline_settings("raw", "chdb://memory", topic, 1, dlq_dsn))
        mapper = Mapper(settings.sink.columns)
        records, win_a = consume_all(bootstrap, topic, n)
        tune_for_throughput()  # the same interpreter settings as `ingest run`
        start = time.perf_counter()
        rows = [mapper.map(r)[0] for r in records]
        t_m = time.perf_counter() - start
        t_r, t_r1, t_ra = raw_insert(workdir / "chdb-raw", rows, settings)
        items = [Item(rec, row, None, 0, rec.size_bytes) for rec, row in zip(records, rows)]
        win_w = write_path(workdir / "chdb-raw", items, PipelineSettings.model_validate(
            pipeline_settings("writepath", f"chdb://{workdir / 'chdb-raw'}", topic, 1, dlq_dsn)))
        e2e_runs: dict[int, list[dict]] = {lanes: [] for lanes in args.lanes}
        a_rates = [n / win_a.wall_s]
        for rnd in range(args.rounds):
            if rnd:
                a_rates.append(n / consume_all(bootstrap, topic, n)[1].wall_s)
            for lanes in args.lanes:
                e2e_runs[lanes].append(end_to_end(bootstrap, topic, workdir, lanes, dlq_dsn, n, rnd))
            print(f"round {rnd + 1}/{args.rounds}: a {a_rates[-1]:,.0f}  "
                  + "  ".join(f"e[lanes={k}] {v[-1]['rate']:,.0f}" for k, v in e2e_runs.items()), flush=True)
        idle = {lanes: idle_cpu_s(bootstrap, workdir, lanes, dlq_dsn) for lanes in args.lanes}
        e2e = {lanes: max(runs, key=lambda res: res["rate"]) for lanes, runs in e2e_runs.items()}

        keys = len({row[0] for row in rows})
        t_w = win_w.wall_s
        r, r1, ra, m, w = n / t_r, n / t_r1, n / t_ra, n / t_m, n / t_w
        a, a_med = max(a_rates), statistics.median(a_rates)
        print(f"\nrecords: {n} over {PARTITIONS} partitions, {keys} keys, batch {BATCH_ROWS} rows, "
              f"ClickHouse = chDB (in-process) via clickhouse-connect")
        print(f"{'measure':<52}{'records/s':>12}{'median':>12}")
        print(f"{'(a) consume only (one confluent-kafka consumer)':<52}{a:>12,.0f}{a_med:>12,.0f}")
        print(f"{'(r) raw client.insert, batches of ' + str(BATCH_ROWS):<52}{r:>12,.0f}")
        print(f"{'(r1) raw client.insert, one call':<52}{r1:>12,.0f}")
        print(f"{'(ra) raw client.insert_arrow, batches of ' + str(BATCH_ROWS):<52}{ra:>12,.0f}")
        print(f"{'(m) decode + map alone':<52}{m:>12,.0f}")
        print(f"{'(w) write path alone (dedupe, token, insert)':<52}{w:>12,.0f}")
        for lanes, runs in e2e_runs.items():
            for res in runs:
                assert res["consumed"] == n, f"end-to-end consumed {res['consumed']} of {n}"
                assert res["final"] == keys, f"end-to-end table holds {res['final']} keys with FINAL, want {keys}"
            res = e2e[lanes]
            median = statistics.median(run["rate"] for run in runs)
            own = statistics.median((run["process_cpu_s"] - idle[lanes]) / n * 1e6 for run in runs)
            print(f"{'(e) ingest run, lanes=' + str(lanes):<52}{res['rate']:>12,.0f}{median:>12,.0f}   "
                  f"peak RSS {res['rss'] / 2**20:.0f} MiB, {res['written']} rows inserted, ingest process CPU "
                  f"{own:.2f} us/record (median, chDB's insert included; idle run {idle[lanes]:.2f} s)")
        best = max(res["rate"] for res in e2e.values())
        print(f"\nratio e/r = {best / r:.2f} (target >= 0.5)   e/r1 = {best / r1:.2f}   e/ra = {best / ra:.2f}   "
              f"e/min(m,w) = {best / min(m, w):.2f}   serial bound 1/(1/m+1/w) = {1 / (1 / m + 1 / w):,.0f}/s\n"
              f"(end-to-end table: {keys} keys with FINAL, as expected)")
        # End to end cannot deliver faster than the broker delivers to one consumer (chDB: one process).
        (cpu_a, cpu_w), cores, bound = cpu_cap(n, win_a, win_w)
        print(f"bounds: e <= (a) = {a:,.0f}/s, so e/r <= a/r = {a / r:.2f};   e/a = {best / a:.2f}\n"
              f"machine CPU per record (broker + ClickHouse + Python): (a) {cpu_a:.1f} us, (w) {cpu_w:.1f} us -> "
              f"both on {cores} cores cap end to end at {bound:,.0f}/s;   e / that cap = {best / bound:.2f}")
    finally:
        services.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
