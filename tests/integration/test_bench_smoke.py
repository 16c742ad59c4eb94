"""The benchmarks still run: each end-to-end bench on a tiny stream, checking its own verdicts.

Not a speed test (figures on a few thousand records mean nothing): a bench
that broke with the product (a table created by hand missing a column the sink
now writes, a renamed module) fails here instead of on the next release's
measurement. Each bench checks its end-to-end table against the stream itself
and exits non-zero when it does not match.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(("script", "args", "expect"), [
    # One run of the main bench with every format (one broker, database and baselines for all of them):
    # JSON, Avro and Protobuf each by default (the columnar tier: every record) and by rows, every table
    # checked against the stream; the poison and wide streams beside the clean one.
    ("pg_pipeline.py", ["--records", "3000", "--naive-records", "100", "--rounds", "1", "--processes", "0",
                        "--lanes", "1", "--format", "all"],
     ("(e) ingest run, lanes=1", "written columnar 100.00 %",
      # the poison stream beside the clean one: its dead letters are exactly its poison records
      re.compile(r"0\.1 % poison stream, lanes=1: [\d,]+ records/s, poison / clean = [\d.]+ .*written columnar "
                 r"[\d.]+ %, 3 dead letters = the poison records"),
      re.compile(r"1 process \(lanes=1\): e / min\(a,b\) = [\d.]+ +\(target >= 0\.9\); written columnar 100\.00 %"),
      re.compile(r"wide stream \(16 columns, \d+ B, nested\), lanes=1: [\d,]+ records/s = [\d.]+ MB/s"),
      # the row path beside the default: every record by the fast path, the poison ones dead-lettered
      re.compile(r"row path \(lanes=1, rows\): e / min\(a,b\) = [\d.]+, own CPU -?[\d.]+ us per record; "
                 r"fast path 100\.00 % \(typed 100\.00 %\); lanes=1 / row path = x[\d.]+ records/s"),
      re.compile(r"0\.1 % poison stream, lanes=1, rows: [\d,]+ records/s, poison / clean = [\d.]+; "
                 r"fast path 99\.90 % \(typed [\d.]+ %\), 3 dead letters = the poison records"),
      ("json lanes=1 1000 rows (1000 written), lanes=1, rows 1000 rows (1000 written); "
       "avro lanes=1 1000 rows (1000 written), lanes=1, rows 1000 rows (1000 written); "
       "protobuf lanes=1 1000 rows (1000 written), lanes=1, rows 1000 rows (1000 written)"),
      re.compile(r"^lanes=1 +avro +[\d,]+ +[\d,]+ +-?[\d.]+ +100\.0%$", re.MULTILINE),
      re.compile(r"^lanes=1, rows +avro +[\d,]+ +[\d,]+ +-?[\d.]+ +0\.0%$", re.MULTILINE),
      re.compile(r"^lanes=1 +protobuf +[\d,]+ +[\d,]+ +-?[\d.]+ +100\.0%$", re.MULTILINE),
      re.compile(r"^lanes=1, rows +protobuf +[\d,]+ +[\d,]+ +-?[\d.]+ +0\.0%$", re.MULTILINE),
      re.compile(r"^lanes=1 +protobuf/json +x[\d.]+ +x-?[\d.]+$", re.MULTILINE))),
    # the row path and the columnar tier end to end on one stream; it checks both tables
    ("columnar.py", ["--records", "3000", "--rounds", "1"],
     (re.compile(r"columnar / rows: records/s x[\d.]+, own CPU x-?[\d.]+"),)),
    # JSON and JSON Schema side by side: JSON Schema on the columnar tier (every record), and by rows
    ("pg_pipeline.py", ["--records", "3000", "--naive-records", "100", "--rounds", "1", "--processes", "0",
                        "--lanes", "1", "--format", "json+json_schema", "--no-wide", "--no-poison"],
     (("json lanes=1 1000 rows (1000 written), lanes=1, rows 1000 rows (1000 written); "
       "json_schema lanes=1 1000 rows (1000 written), lanes=1, rows 1000 rows (1000 written)"),
      re.compile(r"^lanes=1 +json_schema +[\d,]+ +[\d,]+ +-?[\d.]+ +100\.0%$", re.MULTILINE),
      re.compile(r"^lanes=1, rows +json_schema +[\d,]+ +[\d,]+ +-?[\d.]+ +0\.0%$", re.MULTILINE))),
    # the default (columnar) configuration and the row path beside it, each saying which path it took
    ("clickhouse_pipeline.py", ["--records", "3000", "--rounds", "1", "--lanes", "1"],
     ("(end-to-end tables: 1000 keys with FINAL, as expected; poison tables:", "ingest's own CPU per record (lanes=1)",
      re.compile(r"\(e\) ingest run, lanes=1 .*written columnar 100\.00 %"),
      re.compile(r"\(e\) ingest run, lanes=1, rows .*fast path 100\.00 %"),
      re.compile(r"row path \(lanes=1, rows\): e / \(a\) = [\d.]+, own CPU -?[\d.]+ us per record"))),
    # ingest's own CPU by thread (threads named by bench/thread_names.py) and by stage (py-spy's stacks
    # of the pipeline thread given to the hot path's stages)
    ("hot_path_profile.py", ["--records", "3000", "--rounds", "1"],
     (re.compile(r"^  pipeline thread +-?[\d.]+ µs +-?[\d.]+ µs$", re.MULTILINE),
      re.compile(r"^  librdkafka +-?[\d.]+ µs +-?[\d.]+ µs$", re.MULTILINE),
      re.compile(r"^  the process \(rusage\) +-?[\d.]+ µs", re.MULTILINE),
      "of which ingest's own",
      re.compile(r"^pipeline thread by stage \(py-spy, \d+ samples", re.MULTILINE),
      re.compile(r"^  consume\(\) in librdkafka / Message objects +[\d.]+%", re.MULTILINE))),
    # the upsert's SQL forms side by side; it checks every variant leaves the same table
    ("upsert_variants.py", ["--rows", "200", "--batches", "2", "--rounds", "1"],
     (re.compile(r"every variant left the same table; ratios \(x\) to 'stage binary'"),
      re.compile(r"^binary\+distinct replay +[\d,]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", re.MULTILINE))),
    ("sink_cpu.py", ["--rows", "300", "--batches", "2", "--rounds", "1"],
     (re.compile(r"PostgresSink\.write, 2 x 300 rows, median of 1: client CPU [\d.]+ us/row"),)),
    # each stage of the hot path alone; it checks the table its writes filled
    ("components.py", ["--records", "3000", "--rounds", "1"],
     (re.compile(r"^write +-?[\d.]+ +-?[\d.]+$", re.MULTILINE), re.compile(r"^sum +-?[\d.]+ +-?[\d.]+ ", re.MULTILINE))),
    # the CDC streams beside the plain upserts; each final table checked against its source table
    ("cdc_pipeline.py", ["--records", "3000", "--rounds", "1"], "(end-to-end tables of the last round"),
    # transforms (a filter, three computed columns) beside the same pipeline without; each table checked
    ("transforms_pipeline.py", ["--records", "3000", "--rounds", "1"],
     (re.compile(r"transforms / plain = x[\d.]+ records/s \(medians; target >= 0\.8\)"),
      re.compile(r"round 1 transforms +[\d,]+ records/s, own CPU -?[\d.]+ us per record, columnar 3000, filtered 0"),
      re.compile(r"transforms took the columnar tier \(100% of records written by columns\)"))),
    # the same records into one table and over N tables by a pattern and a template; every table checked
    ("multi_table.py", ["--records", "3000", "--tables", "3", "--rounds", "1"],
     (re.compile(r"N tables / one table = [\d.]+ x records/s \(target >= 0\.8\)"),
      re.compile(r"round 1 N tables +[\d,]+ records/s, own CPU -?[\d.]+ us per record, tier columnar, tables 3"))),
])
def test_bench_runs_end_to_end(script: str, args: list[str], expect: str | tuple[str | re.Pattern, ...]) -> None:
    res = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                         timeout=280, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"{script} exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    for want in (expect,) if isinstance(expect, str) else expect:  # one string, or a tuple of strings / patterns
        found = want in res.stdout if isinstance(want, str) else want.search(res.stdout) is not None
        assert found, f"{want!r} not in the output:\n{res.stdout[-3000:]}"
