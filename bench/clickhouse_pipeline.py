"""Kafka → ClickHouse benchmark: ``ingest run`` beside a raw ``client.insert`` of the same rows.

    .venv/bin/python bench/clickhouse_pipeline.py [--records 200000] [--lanes 1 2] [--rounds 3] [--no-rows]

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
                     what the sink sends when every column has an Arrow type (ch_arrow.py);
                     the tables are built first, and the process CPU of the inserts alone
                     (every thread: chDB's pools and merges too) is chDB's insert work per
                     record, which the targets take off ingest's own CPU
  (m) decode + map alone -- orjson + the ClickHouse-dialect mapper over the records
  (w) write path alone -- the mapped records through the batch writer serially, in
                     batches of the pipeline's size: dedupe by key, insert token,
                     columnar ``ClickHouseSink.write``
  (e) end to end  -- ``ingest run`` as a subprocess (first record → last batch handled:
                     consume, decode, map, dedupe by key, Arrow insert with the
                     insert token, commit), per lane count with the default settings (a
                     one-lane pipeline of this stream has the columnar tier: the batch
                     decoded, checked and collapsed in Arrow, ``ingest.runner.columnar``;
                     more lanes map by rows), and once more as ``lanes=1, rows``
                     (``columnar: false``: the row path beside it), with its peak RSS, ingest's
                     own CPU per record (user + sys of the ``ingest run`` process, chDB's
                     insert included, less an ``ingest run`` of the same configuration on
                     an empty topic: start-up, chDB load, group join, idle wait; median
                     of the rounds) and which path its records took: the share written by
                     the columnar tier (``columnar_records``), or the mapper's fast-path hit
                     rate (1 - the summary's ``fast_path_misses`` / ``records_mapped``)
  (p) poison      -- (e) with lanes=1 (default settings) on a second topic of the same records (same keys, so
                     the same partitions), except that one in ``POISON_EVERY`` (0.1 %) is
                     poison (bench/common.py's ``poison_event``: alternately not JSON and an
                     ``id`` that is not a number), dead-lettered to PostgreSQL: its records/s,
                     own CPU and path, run right after the clean lanes=1 run in each round
                     so a slow spell hits both

(a) and every (e) and (p) run ``--rounds`` times, interleaved; the script prints the
best and the median of each, then e/r (target ≥ 0.5) and e/min(m, w), the bound
e/r ≤ a/r, the cap the machine's CPU puts on doing (a) and (w) together (CPU-seconds
of every process per record, from /proc/stat), and the targets: e(lanes=1)/(a) of the
medians (≥ 0.9), ingest's own CPU per record with lanes=1 (≤ 4 µs) and (p)/e(lanes=1)
of the medians (≥ 0.8). It checks each clean end-to-end table with FINAL (one row per
key) and that each (p) run dead-lettered exactly ``poison_count(n)`` records (exiting
non-zero if not); the (p) tables are only checked to hold between ``keys -
poison_count(n)`` and ``keys`` keys, as a key whose records were all poison has no row.
``--lanes`` must include 1. (m) and (w) say where the time goes: with chDB the insert
runs inside the ingest process, so decode/map and the Native encoding share its cores
(and the GIL) with ClickHouse itself.
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
from ingest.runner.writer import BatchWriter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PARTITIONS,
    POISON_EVERY,
    Window,
    consume_all,
    cpu_cap,
    create_topic,
    hit_rate,
    paths,
    poison_count,
    poison_event,
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


#: The end-to-end configuration by rows (``columnar: false``; 1 lane): the default configuration
#: (``lanes=1``) has the columnar tier, this one measures the row path beside it.
ROWS = "lanes=1, rows"


def pipeline_settings(name: str, url: str, topic: str, lanes: int, dlq_dsn: str,
                      columnar: bool | None = None) -> dict:
    """A pipeline of the bench's stream; ``columnar``: the setting (None: unset, the default)."""
    cfg = {
        "name": name, "topics": [topic], "group_id": f"bench-e2e-{uuid.uuid4().hex}", "lanes": lanes,
        "batch": {"max_rows": BATCH_ROWS, "max_latency_ms": 200},
        "sink": {"kind": "clickhouse", "url": url, "database": DATABASE, "table": name,
                 "order_by": ["event_id"], "columns": COLUMNS},
        "dlq": {"kind": "postgres", "dsn": dlq_dsn, "table": "bench_dlq"},
    }
    if columnar is not None:
        cfg["columnar"] = columnar
    return cfg


def _configuration(label: str) -> tuple[int, bool | None]:
    """``(lanes, columnar setting)`` of an end-to-end configuration label (``lanes=N`` or :data:`ROWS`)."""
    if label == ROWS:
        return 1, False
    return int(label.removeprefix("lanes=")), None


def raw_insert(path: Path, rows: list[tuple], settings: PipelineSettings) -> tuple[float, float, float, float]:
    """Seconds for (batched inserts, one insert, batched Arrow inserts) of ``rows`` into fresh tables of the
    sink's shape, and the process CPU-seconds of the Arrow inserts alone (tables built beforehand)."""
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
        tables = [encoder.table(list(zip(*rows[i:i + BATCH_ROWS]))) for i in range(0, len(rows), BATCH_ROWS)]
        start, cpu = time.perf_counter(), time.process_time()
        for batch in tables:
            client.insert_arrow(f"{sink.table}_arrow", batch, database=DATABASE)
        arrow, arrow_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert client.command(f"SELECT count() FROM {table}_arrow FINAL") == keys
    finally:
        client.close()
    return batched, one, arrow, arrow_cpu


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


def _run_config(bootstrap: str, topic: str, workdir: Path, name: str, label: str, dlq_dsn: str) -> Path:
    path = workdir / f"chdb-{name}"
    lanes, columnar = _configuration(label)
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [pipeline_settings(name, f"chdb://{path}", topic, lanes, dlq_dsn, columnar)],
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


def _table_name(label: str) -> str:
    lanes, columnar = _configuration(label)
    return f"{lanes}{'_rows' if columnar is False else ''}"


def idle_cpu_s(bootstrap: str, workdir: Path, label: str, dlq_dsn: str) -> float:
    """CPU-seconds of ``ingest run`` on an empty topic (start-up, chDB load, group join, idle wait)."""
    topic = f"bench-idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    config = _run_config(bootstrap, topic, workdir, f"idle_{_table_name(label)}", label, dlq_dsn)
    return run_measured(_run_command(config), env=ENV)


def end_to_end(bootstrap: str, topic: str, workdir: Path, label: str, dlq_dsn: str, n: int, rnd: int,
               tag: str = "") -> dict:
    """``ingest run`` of ``topic`` in configuration ``label`` into a fresh chDB table (``tag`` names the
    table apart, e.g. ``poison``)."""
    import clickhouse_connect

    name = f"e2e_{tag}{_table_name(label)}_{rnd}"
    path = workdir / f"chdb-{name}"
    config = _run_config(bootstrap, topic, workdir, name, label, dlq_dsn)
    summary = workdir / f"{name}.json"
    process_cpu_s = run_measured(_run_command(config, summary), env=ENV)
    data = orjson.loads(summary.read_bytes())
    stats = data["pipelines"][name]
    client = clickhouse_connect.get_client(dsn=f"chdb://{path}")  # the subprocess has released the path
    try:
        final = client.command(f"SELECT count() FROM {DATABASE}.{name} FINAL")
    finally:
        client.close()
    mapped = stats["records_mapped"]
    return {"rate": stats["rate_per_s"], "rss": data["peak_rss_bytes"], "consumed": stats["records_consumed"],
            "written": stats["rows_written"], "final": final, "process_cpu_s": process_cpu_s,
            "hit_rate": hit_rate(stats), "mapped": mapped, "fast_path_misses": stats["fast_path_misses"],
            "typed_hit_rate": hit_rate(stats, "typed_misses") if "typed_misses" in stats else None,
            "columnar_share": stats.get("columnar_records", 0) / n, "dead_lettered": stats["dead_lettered"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure (a), every (e) and (p) this many times, interleaved; report best and median")
    ap.add_argument("--no-rows", action="store_true",
                    help=f"skip the row path's configuration ({ROWS}, columnar: false)")
    args = ap.parse_args()
    n = args.records
    if 1 not in args.lanes:
        ap.error("--lanes must include 1: the poison stream and the targets are measured against lanes=1")
    n_poison = poison_count(n)

    services = start_all()
    workdir = Path(tempfile.mkdtemp(prefix="ingest-bench-ch-"))
    try:
        bootstrap, dlq_dsn = services.bootstrap, services.pg_dsn
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, topic)
        t = time.perf_counter()
        produce(bootstrap, topic, n)
        print(f"produced {n} records in {time.perf_counter() - t:.1f} s", flush=True)
        poison_topic = f"bench-poison-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, poison_topic)
        t = time.perf_counter()
        produce(bootstrap, poison_topic, n, value=poison_event)
        print(f"produced the same {n} records with {n_poison} poison (1 in {POISON_EVERY}) in "
              f"{time.perf_counter() - t:.1f} s", flush=True)

        settings = PipelineSettings.model_validate(
            pipeline_settings("raw", "chdb://memory", topic, 1, dlq_dsn))
        mapper = Mapper(settings.sink.columns)
        records, win_a = consume_all(bootstrap, topic, n)
        tune_for_throughput()  # the same interpreter settings as `ingest run`
        start = time.perf_counter()
        rows = [mapper.map(r)[0] for r in records]
        t_m = time.perf_counter() - start
        t_r, t_r1, t_ra, cpu_ra = raw_insert(workdir / "chdb-raw", rows, settings)
        chdb_us = cpu_ra / n * 1e6  # chDB's insert work per record
        items = [Item(rec, row, None, 0, rec.size_bytes) for rec, row in zip(records, rows)]
        win_w = write_path(workdir / "chdb-raw", items, PipelineSettings.model_validate(
            pipeline_settings("writepath", f"chdb://{workdir / 'chdb-raw'}", topic, 1, dlq_dsn)))
        one = "lanes=1"
        labels = [f"lanes={lanes}" for lanes in args.lanes] + ([] if args.no_rows else [ROWS])
        e2e_runs: dict[str, list[dict]] = {label: [] for label in labels}
        poison_runs: list[dict] = []
        a_rates = [n / win_a.wall_s]
        for rnd in range(args.rounds):
            if rnd:
                a_rates.append(n / consume_all(bootstrap, topic, n)[1].wall_s)
            for label in labels:
                e2e_runs[label].append(end_to_end(bootstrap, topic, workdir, label, dlq_dsn, n, rnd))
                if label == one:  # the poison stream right after the clean lanes=1 run: the same slow spells
                    res = end_to_end(bootstrap, poison_topic, workdir, one, dlq_dsn, n, rnd, tag="poison_")
                    if res["dead_lettered"] != n_poison:
                        raise SystemExit(f"poison run (round {rnd + 1}) dead-lettered {res['dead_lettered']} "
                                         f"records, want poison_count({n}) = {n_poison}")
                    poison_runs.append(res)
            print(f"round {rnd + 1}/{args.rounds}: a {a_rates[-1]:,.0f}  "
                  + "  ".join(f"e[{k}] {v[-1]['rate']:,.0f}" for k, v in e2e_runs.items())
                  + f"  p[lanes=1] {poison_runs[-1]['rate']:,.0f}", flush=True)
        idle = {label: idle_cpu_s(bootstrap, workdir, label, dlq_dsn) for label in labels}
        e2e = {label: max(runs, key=lambda res: res["rate"]) for label, runs in e2e_runs.items()}

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
        print(f"{'(ra) raw client.insert_arrow, batches of ' + str(BATCH_ROWS):<52}{ra:>12,.0f}   "
              f"process CPU of the inserts {chdb_us:.2f} us/record (chDB's insert work)")
        print(f"{'(m) decode + map alone':<52}{m:>12,.0f}")
        print(f"{'(w) write path alone (dedupe, token, insert)':<52}{w:>12,.0f}")
        e_med: dict[str, float] = {}
        own_med: dict[str, float] = {}
        for label, runs in e2e_runs.items():
            for res in runs:
                assert res["consumed"] == n, f"end-to-end consumed {res['consumed']} of {n}"
                assert res["final"] == keys, f"end-to-end table holds {res['final']} keys with FINAL, want {keys}"
                assert res["dead_lettered"] == 0, f"clean end-to-end run dead-lettered {res['dead_lettered']}"
            res = e2e[label]
            e_med[label] = statistics.median(run["rate"] for run in runs)
            own_med[label] = statistics.median((run["process_cpu_s"] - idle[label]) / n * 1e6 for run in runs)
            print(f"{'(e) ingest run, ' + label:<52}{res['rate']:>12,.0f}{e_med[label]:>12,.0f}   "
                  f"peak RSS {res['rss'] / 2**20:.0f} MiB, {res['written']} rows inserted, ingest's own CPU "
                  f"{own_med[label]:.2f} us/record (median, chDB's insert included; idle run {idle[label]:.2f} s), "
                  f"{paths(runs)}")
        for res in poison_runs:
            assert res["consumed"] == n, f"poison end-to-end consumed {res['consumed']} of {n}"
            # A key whose records were all poison has no row; no poison record makes one.
            assert keys - n_poison <= res["final"] <= keys, \
                f"poison end-to-end table holds {res['final']} keys with FINAL, want {keys - n_poison}..{keys}"
        p_best = max(run["rate"] for run in poison_runs)
        p_med = statistics.median(run["rate"] for run in poison_runs)
        p_own = statistics.median((run["process_cpu_s"] - idle[one]) / n * 1e6 for run in poison_runs)
        print(f"{'(p) ingest run, lanes=1, ' + format(100 / POISON_EVERY, 'g') + ' % poison':<52}"
              f"{p_best:>12,.0f}{p_med:>12,.0f}   "
              f"peak RSS {max(run['rss'] for run in poison_runs) / 2**20:.0f} MiB, "
              f"{n_poison} dead-lettered (PostgreSQL DLQ) per run, ingest's own CPU {p_own:.2f} us/record "
              f"(median; idle run of lanes=1), {paths(poison_runs)}")
        print("(path: the share of records the columnar tier wrote, or 1 - fast_path_misses / records_mapped; "
              "the lowest of the rounds)")
        best = max(res["rate"] for res in e2e.values())
        print(f"\nratio e/r = {best / r:.2f} (target >= 0.5)   e/r1 = {best / r1:.2f}   e/ra = {best / ra:.2f}   "
              f"e/min(m,w) = {best / min(m, w):.2f}   serial bound 1/(1/m+1/w) = {1 / (1 / m + 1 / w):,.0f}/s\n"
              f"(end-to-end tables: {keys} keys with FINAL, as expected; poison tables: "
              + ", ".join(str(run["final"]) for run in poison_runs) + " keys)")
        # End to end cannot deliver faster than the broker delivers to one consumer (chDB: one process).
        (cpu_a, cpu_w), cores, bound = cpu_cap(n, win_a, win_w)
        print(f"bounds: e <= (a) = {a:,.0f}/s, so e/r <= a/r = {a / r:.2f};   e/a = {best / a:.2f}\n"
              f"machine CPU per record (broker + ClickHouse + Python): (a) {cpu_a:.1f} us, (w) {cpu_w:.1f} us -> "
              f"both on {cores} cores cap end to end at {bound:,.0f}/s;   e / that cap = {best / bound:.2f}")
        print(f"\ntargets (medians of {args.rounds} round{'s' if args.rounds != 1 else ''}):\n"
              f"  e(lanes=1) / (a) consume only = {e_med[one]:,.0f} / {a_med:,.0f} = {e_med[one] / a_med:.2f} "
              f"(target >= 0.9)\n"
              f"  ingest's own CPU per record (lanes=1) {own_med[one]:.2f} us, less chDB's insert work (ra) "
              f"{chdb_us:.2f} us = {own_med[one] - chdb_us:.2f} us (target <= 4)\n"
              f"  poison / clean (lanes=1) = {p_med:,.0f} / {e_med[one]:,.0f} = {p_med / e_med[one]:.2f} "
              f"(target >= 0.8)")
        if ROWS in e_med:
            print(f"  row path ({ROWS}): e / (a) = {e_med[ROWS] / a_med:.2f}, own CPU {own_med[ROWS]:.2f} us per "
                  f"record; {one} / row path = x{e_med[one] / e_med[ROWS]:.2f} records/s")
    finally:
        services.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
