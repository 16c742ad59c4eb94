"""Row path against the columnar tier (``columnar: true``), end to end on the same records, in one run.

    .venv/bin/python bench/columnar.py [--records 200000] [--rounds 3]

Starts the embedded broker and PostgreSQL (or ``$INGEST_PG_DSN``), produces ``bench/pg_pipeline.py``'s
JSON stream once (6 partitions, ~110 B, a third of the records updates), then per round runs
``ingest run`` (1 process, 1 lane, the pipeline bench's configuration) with ``columnar: false`` and
``columnar: true`` (order alternating per round), each with an idle run of the same configuration on an
empty topic. Prints per configuration the median records/s and ingest's own CPU per record (user + sys
of the process less its idle run), the ratios columnar / rows, and exits non-zero unless both tables
hold exactly the stream's last record per key and the columnar run wrote every record columnar.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import orjson
import psycopg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pg_pipeline as pgb  # noqa: E402
from common import create_topic, event, produce, run_measured  # noqa: E402

from ingest.embedded import start_all  # noqa: E402


def _run(services, topic: str, table: str, columnar: bool) -> tuple[float, dict]:
    pgb.make_table(services.pg_dsn, table, keyed=True)
    cfg = pgb.e2e_config(services.bootstrap, topic, services.pg_dsn, table, 1)
    cfg["pipelines"][0]["columnar"] = columnar
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "s.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cpu = run_measured(pgb.run_command(path, 1, summary), env=env, stderr=subprocess.DEVNULL)
        stats = orjson.loads(summary.read_bytes())["pipelines"]["bench"] if summary.exists() else {}
    return cpu, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.records
    services = start_all()
    topic = f"bench-columnar-{uuid.uuid4().hex[:8]}"
    idle_topic = f"bench-columnar-idle-{uuid.uuid4().hex[:8]}"
    create_topic(services.bootstrap, topic)
    create_topic(services.bootstrap, idle_topic)
    produce(services.bootstrap, topic, n)
    keys = max(1, n // 3)
    expected = {}
    for i in range(n):
        doc = orjson.loads(event(i, (i * 7919) % keys))
        expected[doc["id"]] = doc
    results: dict[str, list[tuple[float, float]]] = {"rows": [], "columnar": []}
    for r in range(args.rounds):
        order = ["rows", "columnar"] if r % 2 == 0 else ["columnar", "rows"]
        for label in order:
            columnar = label == "columnar"
            idle_cpu, _ = _run(services, idle_topic, f"bench_col_idle_{label}", columnar)
            table = f"bench_col_{label}_{r}"
            cpu, stats = _run(services, topic, table, columnar)
            assert stats["records_consumed"] == n, stats
            if columnar and stats["columnar_records"] != n:
                raise SystemExit(f"columnar run wrote {stats['columnar_records']} of {n} records columnar")
            _check(services.pg_dsn, table, expected)
            rate = n / stats["busy_s"]
            own = (cpu - idle_cpu) / n * 1e6
            results[label].append((rate, own))
            print(f"round {r + 1} {label:8s}: {rate:9.0f} records/s, own CPU {own:5.2f} µs/record", flush=True)
    med = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for k, v in results.items()}
    print(f"\nmedians of {args.rounds} rounds, {n} records, 1 process, 1 lane:")
    for label, (rate, own) in med.items():
        print(f"  {label:8s} {rate:9.0f} records/s   own CPU {own:5.2f} µs/record")
    print(f"  columnar / rows: records/s x{med['columnar'][0] / med['rows'][0]:.2f}, "
          f"own CPU x{med['columnar'][1] / med['rows'][1]:.2f}")


def _check(dsn: str, table: str, expected: dict) -> None:
    with psycopg.connect(dsn) as conn:
        got = dict(conn.execute(f'SELECT event_id, user_id FROM "{table}"').fetchall())
    want = {k: d["user"] for k, d in expected.items()}
    if got != want:
        raise SystemExit(f"{table}: {len(got)} rows, expected {len(want)} (or values differ)")


if __name__ == "__main__":
    main()
