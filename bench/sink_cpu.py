"""The PostgreSQL sink's own CPU per row: ``PostgresSink.write`` of pre-mapped rows, nothing else.

    .venv/bin/python bench/sink_cpu.py [--rows 5000] [--batches 20] [--rounds 3]
    PYTHONPATH=<another checkout> .venv/bin/python bench/sink_cpu.py   # the same, that checkout's sink

Writes ``--batches`` batches of ``--rows`` distinct rows of the benchmark's columns (bigint,
bigint, text, numeric(12,2), timestamptz and the two hidden source columns) into a fresh table of
``$INGEST_PG_DSN`` or an embedded PostgreSQL, checks the table (every row, every amount), and
prints this process's CPU per row (user + sys: the COPY formatting, psycopg, the driver; the
server's work is not in it) and the wall time per row, the median of ``--rounds`` rounds. What end
to end saves from a cheaper write path is this figure times the rows written per record
(collapsing leaves about one in three on the pipeline benchmarks' stream, where each key has
three records).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import psycopg

from ingest.core.routing import stream_id
from ingest.embedded import EmbeddedServices, start_postgres
from ingest.sinks.postgres.schema import sink_table_sql
from ingest.sinks.postgres.settings import PostgresSinkSettings
from ingest.sinks.postgres.sink import PostgresSink

COLUMNS = {"event_id": {"type": "bigint"}, "user_id": {"type": "bigint"}, "kind": {"type": "text"},
           "amount": {"type": "numeric(12,2)"}, "ts": {"type": "timestamptz"}}


def one_round(dsn: str, rows: int, batches: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per row of ``batches`` writes of ``rows`` rows into a new table (after one warm-up write)."""
    table = f"sink_cpu_{uuid.uuid4().hex[:8]}"
    cfg = PostgresSinkSettings(dsn=dsn, table=table, conflict_key=["event_id"], columns=COLUMNS)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in sink_table_sql(cfg):
            conn.execute(statement)
    sink = PostgresSink(cfg, pool_size=1)
    now = datetime.now(timezone.utc)
    sid = stream_id("bench", 0)
    data = [[(n, n % 997, "click" if n % 3 else "view", Decimal(n % 10000) / 100, now, sid, n)
             for n in range(b * rows, (b + 1) * rows)] for b in range(batches + 1)]
    try:
        sink.write(data[0])  # the pool, the stage table, the prepared statements
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for batch in data[1:]:
            sink.write(batch)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        with psycopg.connect(dsn) as conn:  # every row written, every amount as given
            got = conn.execute(f'SELECT count(*), sum(amount) FROM "{table}"').fetchone()
        want = (sum(map(len, data)), sum(row[3] for batch in data for row in batch))
        if tuple(got) != want:
            raise SystemExit(f"{table}: count and sum of amount {tuple(got)}, expected {want}")
    finally:
        sink.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
    n = rows * batches
    return (cpu1 - cpu0) / n * 1e6, (wall1 - wall0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5000, help="rows per batch (the pipeline benches' batch size)")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import ingest

    services = EmbeddedServices()
    try:
        start_postgres(services)
        got = [one_round(services.pg_dsn, args.rows, args.batches) for _ in range(args.rounds)]
    finally:
        services.close()
    cpu, wall = statistics.median(c for c, _ in got), statistics.median(w for _, w in got)
    print(f"{Path(ingest.__file__).parent.parent}: PostgresSink.write, {args.batches} x {args.rows} rows, "
          f"median of {args.rounds}: client CPU {cpu:.2f} us/row, wall {wall:.2f} us/row "
          f"(rounds: {', '.join(f'{c:.2f}' for c, _ in got)} us)")


if __name__ == "__main__":
    main()
