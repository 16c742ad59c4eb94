"""The cheapest upsert PostgreSQL can run: the same batches through six SQL forms, side by side.

    .venv/bin/python bench/upsert_variants.py [--rows 5000] [--batches 10] [--rounds 3]

Every variant writes the same batches of the pipeline benches' row (bigint key, bigint, text,
numeric(12,2), timestamptz) into a fresh table of an embedded PostgreSQL, in three shapes:

- ``new``: keys the table does not hold (inserts),
- ``update``: keys it holds, every row changed,
- ``replay``: the same batches again, every row identical to what is stored (a redelivery after a
  crash, a ``replay-dlq`` of rows already there).

The variants (one transaction per batch, as the sink commits):

- ``stage``: a text COPY into a temporary stage, then ``INSERT … SELECT … ON CONFLICT DO UPDATE``;
- ``stage+distinct``: the same, the update guarded by ``WHERE (t.cols) IS DISTINCT FROM (EXCLUDED.cols)``;
- ``stage binary``: the stage filled by a binary COPY -- the sink's own form (which stages its
  numeric, json and varchar columns as text inside the binary COPY; here every column is binary);
- ``binary+distinct``: both of the above;
- ``unlogged stage``: an unlogged table as the stage (truncated per batch) instead of a temporary one;
- ``unnest``: one ``INSERT … SELECT FROM unnest($1::bigint[], …) ON CONFLICT`` with binary array
  parameters, no stage;
- ``merge``: COPY into the stage, then ``MERGE``.

For each it prints rows/s (wall) and the CPU per row of the PostgreSQL backend (from
``/proc/<pg_backend_pid>/stat``, 10 ms ticks: run enough rows) and of this client process, medians
of ``--rounds`` interleaved rounds, with each variant's ratio to ``stage binary``; and it checks that every variant leaves the same
table (count, sum and a digest of every row), and that ``stage+distinct`` updated no row on the
replay (``xmin`` unchanged: no dead tuples).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import psycopg
from psycopg import sql

from ingest.embedded import EmbeddedServices, start_postgres

COLUMNS = ("event_id", "user_id", "kind", "amount", "ts")
TYPES = ("bigint", "bigint", "text", "numeric(12,2)", "timestamptz")
SHAPES = ("new", "update", "replay")
TICKS = os.sysconf("SC_CLK_TCK")

Row = tuple[int, int, str, Decimal, datetime]


def rows_of(first: int, n: int, salt: int) -> list[Row]:
    """``n`` rows with keys ``first…first+n-1``; ``salt`` changes every value column."""
    epoch = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return [(k, (k * 7 + salt) % 997, ("click", "view", "buy")[(k + salt) % 3], Decimal((k * 13 + salt) % 100000) / 100,
             epoch + timedelta(milliseconds=k + salt)) for k in range(first, first + n)]


def backend_cpu_s(pid: int) -> float:
    """utime + stime of a local process, in seconds (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Variant:
    """One SQL form of the batch upsert on one connection and table."""

    def __init__(self, conn: psycopg.Connection, table: str, name: str) -> None:
        self.conn, self.table, self.name = conn, sql.Identifier(table), name
        self.cols = sql.SQL(", ").join(map(sql.Identifier, COLUMNS))
        non_key = [sql.Identifier(c) for c in COLUMNS[1:]]
        self.set_clause = sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(c, c) for c in non_key)
        self.distinct = sql.SQL("({}) IS DISTINCT FROM ({})").format(
            sql.SQL(", ").join(sql.SQL("t.{}").format(c) for c in non_key),
            sql.SQL(", ").join(sql.SQL("EXCLUDED.{}").format(c) for c in non_key))
        self.stage = sql.Identifier(f"stage_{table}")
        if name in ("stage", "stage+distinct", "stage binary", "binary+distinct", "merge"):
            conn.execute(sql.SQL("CREATE TEMP TABLE {} (LIKE {}) ON COMMIT DELETE ROWS").format(self.stage, self.table))
        elif name == "unlogged stage":
            conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {})").format(self.stage, self.table))
        conn.commit()

    def _copy(self, rows: Sequence[Row], binary: bool = False) -> None:
        fmt = sql.SQL(" (FORMAT BINARY)") if binary else sql.SQL("")
        with self.conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN{}").format(self.stage, self.cols, fmt)) as cp:
            if binary:
                cp.set_types(["bigint", "bigint", "text", "numeric", "timestamptz"])
            for row in rows:
                cp.write_row(row)

    def _insert_from_stage(self, guarded: bool) -> None:
        self.conn.execute(sql.SQL("INSERT INTO {} AS t ({}) SELECT {} FROM {} ON CONFLICT (event_id) DO UPDATE SET {}{}")
                          .format(self.table, self.cols, self.cols, self.stage, self.set_clause,
                                  sql.SQL(" WHERE {}").format(self.distinct) if guarded else sql.SQL("")))

    def write(self, rows: Sequence[Row]) -> None:
        """One batch, one transaction."""
        name = self.name
        if name == "unnest":
            cols = list(zip(*rows))
            self.conn.cursor(binary=True).execute(
                sql.SQL("INSERT INTO {} AS t ({}) SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::text[], "
                        "%s::numeric[], %s::timestamptz[]) ON CONFLICT (event_id) DO UPDATE SET {}")
                .format(self.table, self.cols, self.set_clause), [list(c) for c in cols])
        elif name == "merge":
            self._copy(rows)
            non_key = COLUMNS[1:]
            self.conn.execute(sql.SQL(
                "MERGE INTO {} AS t USING {} AS s ON t.event_id = s.event_id "
                "WHEN MATCHED THEN UPDATE SET {} WHEN NOT MATCHED THEN INSERT ({}) VALUES ({})").format(
                self.table, self.stage,
                sql.SQL(", ").join(sql.SQL("{} = s.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in non_key),
                self.cols, sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(c)) for c in COLUMNS)))
        elif name == "unlogged stage":
            self.conn.execute(sql.SQL("TRUNCATE {}").format(self.stage))
            self._copy(rows)
            self._insert_from_stage(guarded=False)
        else:
            self._copy(rows, binary=name in ("stage binary", "binary+distinct"))
            self._insert_from_stage(guarded=name in ("stage+distinct", "binary+distinct"))
        self.conn.commit()


VARIANTS = ("stage", "stage+distinct", "stage binary", "binary+distinct", "unlogged stage", "unnest", "merge")
#: the variant the ratios are to: the sink's own form
BASELINE = "stage binary"


def one_round(dsn: str, variant: str, rows: int, batches: int) -> tuple[dict[str, tuple[float, float, float]], str]:
    """``({shape: (rows/s, backend µs/row, client µs/row)}, digest of the table)`` of one variant on a
    fresh table; checks its count and sum of amount."""
    table = f"upsert_{uuid.uuid4().hex[:8]}"
    n = rows * batches
    out: dict[str, tuple[float, float, float]] = {}
    with psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} ({})").format(sql.Identifier(table), sql.SQL(", ").join(
            sql.SQL("{} {}{}").format(sql.Identifier(c), sql.SQL(t), sql.SQL(" PRIMARY KEY" if c == "event_id" else ""))
            for c, t in zip(COLUMNS, TYPES))))
        conn.commit()
        v = Variant(conn, table, variant)
        pid = conn.info.backend_pid
        v.write(rows_of(n * 10, rows, 0))  # warm-up: plans, the stage's first use (its keys are outside the shapes')
        plan: dict[str, Callable[[int], list[Row]]] = {
            "new": lambda b: rows_of(b * rows, rows, 0),        # inserts
            "update": lambda b: rows_of(b * rows, rows, 1),     # every value changed
            "replay": lambda b: rows_of(b * rows, rows, 1),     # identical to what is stored
        }
        xmin_before = None
        for shape in SHAPES:
            data = [plan[shape](b) for b in range(batches)]
            if shape == "replay":
                xmin_before = conn.execute(sql.SQL("SELECT sum(xmin::text::bigint) FROM {} WHERE event_id < %s").format(
                    sql.Identifier(table)), [n * 10]).fetchone()[0]
                conn.commit()
            server0, cpu0, wall0 = backend_cpu_s(pid), time.process_time(), time.perf_counter()
            for batch in data:
                v.write(batch)
            server1, cpu1, wall1 = backend_cpu_s(pid), time.process_time(), time.perf_counter()
            out[shape] = (n / (wall1 - wall0), (server1 - server0) / n * 1e6, (cpu1 - cpu0) / n * 1e6)
        digest, count, total, xmin_after = conn.execute(sql.SQL(
            "SELECT md5(string_agg(t::text, ',' ORDER BY event_id)), count(*), sum(amount), sum(xmin::text::bigint) "
            "FROM {} t WHERE event_id < %s").format(sql.Identifier(table)), [n * 10]).fetchone()
        conn.commit()
        if count != n or total != sum(row[3] for row in rows_of(0, n, 1)):
            raise SystemExit(f"{variant}: the table differs from the batches ({count} rows, sum of amount {total})")
        if variant.endswith("+distinct") and xmin_after != xmin_before:
            raise SystemExit(f"{variant}: the replay rewrote rows it should have left alone")
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
        conn.commit()
    return out, digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5000, help="rows per batch (the pipeline benches' batch size)")
    ap.add_argument("--batches", type=int, default=10, help="batches per shape")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are printed)")
    args = ap.parse_args()
    services = EmbeddedServices()
    got: dict[str, list[dict[str, tuple[float, float, float]]]] = {v: [] for v in VARIANTS}
    digests: set[str] = set()
    try:
        start_postgres(services)
        with psycopg.connect(services.pg_dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
        for _ in range(args.rounds):
            for variant in VARIANTS:
                figures, digest = one_round(services.pg_dsn, variant, args.rows, args.batches)
                got[variant].append(figures)
                digests.add(digest)
    finally:
        services.close()
    if len(digests) != 1:
        raise SystemExit(f"the variants left different tables: {sorted(digests)}")
    print(f"PostgreSQL {version}, {args.batches} batches x {args.rows} rows per shape, medians of {args.rounds} "
          f"interleaved rounds; every variant left the same table; ratios (x) to {BASELINE!r}")
    print(f"{'variant':<16}{'shape':<8}{'rows/s':>10}{'backend us/row':>16}{'client us/row':>15}"
          f"{'x rows/s':>10}{'x backend':>11}")
    base = {s: tuple(statistics.median(r[s][i] for r in got[BASELINE]) for i in range(3)) for s in SHAPES}
    for variant in VARIANTS:
        for shape in SHAPES:
            rate, server, client = (statistics.median(r[shape][i] for r in got[variant]) for i in range(3))
            print(f"{variant:<16}{shape:<8}{rate:>10,.0f}{server:>16.2f}{client:>15.2f}"
                  f"{rate / base[shape][0]:>10.2f}{(server / base[shape][1]) if base[shape][1] else 0:>11.2f}")


if __name__ == "__main__":
    main()
