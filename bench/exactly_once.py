"""Exactly-once vs at-least-once: the cost of storing offsets beside the rows, measured in one run.

    .venv/bin/python bench/exactly_once.py [--records 200000] [--lanes 4] [--rounds 3]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded PostgreSQL
(pgserver), produces one topic of keyed JSON records (6 partitions, ~110 B each), then runs
``ingest run --until-idle`` as a subprocess over those same records once per delivery mode and
round, each into a fresh append-only table of the same definition (``on_conflict: none``, plain
INSERT through the COPY stage) with its own consumer group:

  at_least_once -- rows in one transaction per batch, offsets committed to Kafka only
  exactly_once  -- the same, plus per batch: lock + advance the lane's offsets
                   (``ingest_lane_offsets``) in the batch transaction, and per commit tick the
                   watermark upsert into ``ingest_offsets`` before the (advisory) Kafka commit

Each run prints its write tier (``write_tier``) and the share of records the columnar tier wrote
(``columnar_records``): both modes have the tier where the configuration fits it (issue #38 item 1).
Each figure is the run's ``rate_per_s`` from ``--summary-json`` (records consumed between the
first record and the last handled batch). Rounds alternate the order of the two modes so that
neither always runs on a warmer (or busier) machine; the ratio is printed for the mean rates and
per round (the two runs of a round are back to back, so their ratio is the least disturbed by
load that drifts over the whole benchmark), with the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
import psycopg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.embedded import start_all  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PARTITIONS, create_topic, produce  # noqa: E402

BATCH_ROWS = 5000
MODES = ("at_least_once", "exactly_once")
COLUMNS = {
    "id": {"type": "bigint", "source": "$.id", "required": True},
    "k": {"type": "bigint", "source": "$.k"},
    "kind": {"type": "text", "source": "$.kind"},
    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
    "ts": {"type": "timestamptz", "source": "$.ts"},
}


def append_only_event(i: int, key: int) -> bytes:
    """Every record has its own id (append-only table: each must land once)."""
    return orjson.dumps({"id": i, "k": key, "kind": "click" if i % 3 else "view",
                         "amount": round(i % 10000 / 100, 2), "ts": 1764460800000 + i})


def run_mode(bootstrap: str, topic: str, dsn: str, mode: str, lanes: int, n: int, tag: str) -> dict:
    name = f"bench_{'eo' if mode == 'exactly_once' else 'alo'}_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')
    cfg = {
        "kafka": {"bootstrap_servers": bootstrap, "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": name, "topics": [topic], "group_id": f"{name}-{uuid.uuid4().hex}",
            "lanes": lanes, "batch": {"max_rows": BATCH_ROWS, "max_latency_ms": 200},
            "sink": {"kind": "postgres", "dsn": dsn, "table": name, "on_conflict": "none", "delivery": mode,
                     "columns": COLUMNS},
            "dlq": {"kind": "postgres", "table": "bench_dlq"},
        }],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "summary.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "ingest", "run", "-c", str(path), "--until-idle", "2",
                        "--metrics-port", "0", "--log-level", "warning", "--summary-json", str(summary)],
                       check=True, env=env)
        data = orjson.loads(summary.read_bytes())
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows, distinct = conn.execute(f'SELECT count(*), count(DISTINCT id) FROM "{name}"').fetchone()
        conn.execute(f'DROP TABLE "{name}"')
    stats = data["pipelines"][name]
    if stats["records_consumed"] != n or rows != n or distinct != n:
        raise RuntimeError(f"{mode}: consumed {stats['records_consumed']}, table {rows} rows / {distinct} ids; "
                           f"want {n}")
    return {"rate": stats["rate_per_s"], "busy_s": stats["busy_s"], "batches": stats["batches"],
            "commits": stats["commits"], "rss": data["peak_rss_bytes"], "tier": stats.get("write_tier"),
            "columnar": stats.get("columnar_records", 0) / max(1, stats["records_consumed"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="runs per mode, order alternating")
    args = ap.parse_args()

    services = start_all()
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        topic = f"bench-eo-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, topic)
        t = time.perf_counter()
        produce(bootstrap, topic, args.records, value=append_only_event)
        print(f"produced {args.records} records in {time.perf_counter() - t:.1f} s", flush=True)

        results: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                res = run_mode(bootstrap, topic, dsn, mode, args.lanes, args.records, f"r{r}")
                results[mode].append(res)
                print(f"  round {r + 1} {mode:<14} {res['rate']:>10,.0f} records/s  busy {res['busy_s']:.2f} s  "
                      f"{res['batches']} batches  {res['commits']} commits  tier {res['tier']}, "
                      f"{100 * res['columnar']:.2f} % written columnar", flush=True)

        print(f"\nrecords: {args.records} over {PARTITIONS} partitions, lanes {args.lanes}, batch {BATCH_ROWS} rows, "
              f"append-only table (plain INSERT via COPY stage), {args.rounds} round(s)")
        print(f"{'delivery':<16}{'mean records/s':>16}    runs")
        means = {}
        for mode in MODES:
            rates = [x["rate"] for x in results[mode]]
            means[mode] = statistics.fmean(rates)
            print(f"{mode:<16}{means[mode]:>16,.0f}    {'  '.join(f'{x:,.0f}' for x in rates)}")
        ratio = means["exactly_once"] / means["at_least_once"]
        pairs = [e["rate"] / a["rate"] for e, a in zip(results["exactly_once"], results["at_least_once"])]
        print(f"\nratio exactly_once / at_least_once: of the means {ratio:.3f} (cost {100 * (1 - ratio):+.1f} %); "
              f"per round {', '.join(f'{x:.3f}' for x in pairs)}, median {statistics.median(pairs):.3f}")
    finally:
        services.close()


if __name__ == "__main__":
    main()
