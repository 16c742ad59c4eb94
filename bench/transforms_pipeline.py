"""Transforms end to end (issue #37): a pipeline with one filter and three computed columns beside the
same pipeline without transforms, on the same records, in one run.

    .venv/bin/python bench/transforms_pipeline.py [--records 200000] [--rounds 3]

Starts an embedded broker (Tansu) and uses ``$INGEST_PG_DSN`` or an embedded PostgreSQL
(pgserver), produces one topic of the benchmark's JSON records (bench/common.py's ``event``: 6
partitions, ~110 B, a third of them updates), then runs ``ingest run --until-idle`` on it, ``--rounds``
times interleaved, in three configurations (one process, one lane):

  plain        the pipeline without transforms, defaults (the columnar tier: it fits)
  plain, rows  the same with ``columnar: false`` (the row path, which transforms take)
  transforms   the same columns plus ``filter: value.kind != 'none'`` (keeps every record) and
               ``set``: ``amount_cents: int(value.amount * 100.0)``, ``label: value.kind + '-' +
               string(value.user)``, ``bucket: value.user % 16`` (three more columns)
  plain, wide  no transforms, the transforms' eight columns, from a second topic whose records carry
               the three computed values already (~40 B more each): what the wider rows cost without
               the transforms, so that transforms / plain-wide is what the transforms themselves cost

and prints records/s (best, median) and ingest's own CPU per record (user + sys of its process less
an idle run of the same configuration on an empty topic), the ratios transforms / plain and
transforms / plain-rows (the issue's target: >= 0.8 x records/s), and the transforms' own CPU per
record: transforms less the plain configuration of the same write tier (plain when the transforms
ran on the columnar tier, as these steps do since issue #37 item 8; plain-rows when they ran by
rows), which tier each took (``columnar_records``), and both differences. Each run's table is
checked against the stream (the last record of each key, with the computed values) and the script
exits non-zero on a difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import orjson
import psycopg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import create_topic, event, produce, run_measured  # noqa: E402
from pg_pipeline import COLUMNS, make_table, run_command  # noqa: E402

from ingest.embedded import start_all  # noqa: E402

TRANSFORMS = [
    {"filter": "value.kind != 'none'"},
    {"set": {"amount_cents": "int(value.amount * 100.0)", "label": "value.kind + '-' + string(value.user)",
             "bucket": "value.user % 16"}},
]
T_COLUMNS = {**COLUMNS, "amount_cents": {"type": "bigint", "required": True}, "label": {"type": "text"},
             "bucket": {"type": "bigint"}}
CONFIGS = {"plain": (COLUMNS, None, None), "plain, rows": (COLUMNS, None, False),
           "transforms": (T_COLUMNS, TRANSFORMS, None), "plain, wide": (T_COLUMNS, None, None)}
#: the configurations whose table has the computed columns
COMPUTED = ("transforms", "plain, wide")


def wide_event(i: int, key: int) -> bytes:
    """:func:`event` with the three values the transforms compute, computed here."""
    doc = orjson.loads(event(i, key))
    doc.update(amount_cents=int(doc["amount"] * 100.0), label=f"{doc['kind']}-{doc['user']}", bucket=doc["user"] % 16)
    return orjson.dumps(doc)


def config(bootstrap: str, topic: str, dsn: str, table: str, name: str) -> dict:
    columns, transforms, columnar = CONFIGS[name]
    pipeline: dict = {
        "name": "bench", "topics": [topic], "group_id": f"bench-t-{uuid.uuid4().hex}", "lanes": 1,
        "batch": {"max_rows": 5000, "max_latency_ms": 200},
        "sink": {"kind": "postgres", "dsn": dsn, "table": table, "conflict_key": ["event_id"], "columns": columns},
        "dlq": {"kind": "postgres", "table": "bench_dlq"},
    }
    if transforms:
        pipeline["transforms"] = transforms
    if columnar is not None:
        pipeline["columnar"] = columnar
    return {"kafka": {"bootstrap_servers": bootstrap,
                      "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
            "pipelines": [pipeline]}


def run(bootstrap: str, topic: str, dsn: str, name: str, tag: str) -> tuple[dict, float, str]:
    """One ``ingest run`` of ``topic`` into a fresh table: (its summary, its process CPU-seconds, the table)."""
    table = f"bench_t_{tag}"
    columns = CONFIGS[name][0]
    make_table(dsn, table, keyed=True, columns=columns)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(config(bootstrap, topic, dsn, table, name)))
        summary = Path(tmp) / "summary.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cpu_s = run_measured(run_command(path, 1, summary), env=env)
        return orjson.loads(summary.read_bytes())["pipelines"]["bench"], cpu_s, table


def expected_rows(n: int) -> dict[int, tuple]:
    """event_id -> (user_id, kind, amount, amount_cents, label, bucket) of the last record of each key."""
    keys = max(1, n // 3)
    out = {}
    for i in range(n):
        doc = orjson.loads(event(i, (i * 7919) % keys))
        amount = Decimal(repr(doc["amount"])).quantize(Decimal("0.01"))
        out[doc["id"]] = (doc["user"], doc["kind"], amount, int(doc["amount"] * 100.0),
                          f"{doc['kind']}-{doc['user']}", doc["user"] % 16)
    return out


def check(dsn: str, table: str, expected: dict[int, tuple], computed: bool) -> None:
    cols = "event_id, user_id, kind, amount" + (", amount_cents, label, bucket" if computed else "")
    with psycopg.connect(dsn) as conn:
        got = {r[0]: r[1:] for r in conn.execute(f'SELECT {cols} FROM "{table}"')}  # noqa: S608 - bench names
    want = {k: (v if computed else v[:3]) for k, v in expected.items()}
    if got != want:
        differ = [(k, want.get(k), got.get(k)) for k in sorted(want.keys() | got.keys()) if want.get(k) != got.get(k)]
        raise SystemExit(f"table {table}: {len(got)} rows, expected {len(want)}; first differences {differ[:3]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    services = start_all()
    try:
        bootstrap, dsn = services.bootstrap, services.pg_dsn
        topic, idle_topic = f"bench-t-{uuid.uuid4().hex[:8]}", f"bench-t-idle-{uuid.uuid4().hex[:8]}"
        wide_topic = f"bench-t-wide-{uuid.uuid4().hex[:8]}"
        create_topic(bootstrap, topic)
        create_topic(bootstrap, idle_topic)
        create_topic(bootstrap, wide_topic)
        t = time.perf_counter()
        produce(bootstrap, topic, args.records)
        produce(bootstrap, wide_topic, args.records, wide_event)
        print(f"produced {args.records} records in {time.perf_counter() - t:.1f} s", flush=True)
        expected = expected_rows(args.records)
        idle = {name: run(bootstrap, idle_topic, dsn, name, f"idle_{i}")[1] for i, name in enumerate(CONFIGS)}
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        cpus: dict[str, list[float]] = {name: [] for name in CONFIGS}
        columnar_share: dict[str, float] = {}
        for r in range(args.rounds):
            for i, name in enumerate(CONFIGS):
                stats, cpu_s, table = run(bootstrap, wide_topic if name == "plain, wide" else topic, dsn, name,
                                          f"{r}_{i}")
                assert stats["records_consumed"] == args.records, stats
                check(dsn, table, expected, computed=name in COMPUTED)
                rates[name].append(args.records / stats["busy_s"] if stats["busy_s"] else stats["rate_per_s"])
                cpus[name].append((cpu_s - idle[name]) / args.records * 1e6)
                columnar_share[name] = stats.get("columnar_records", 0) / args.records
                print(f"round {r + 1} {name:12s} {rates[name][-1]:>10,.0f} records/s, own CPU "
                      f"{cpus[name][-1]:.2f} us per record, columnar {stats.get('columnar_records', 0)}, "
                      f"filtered {stats.get('filtered', 0)}", flush=True)
        print(f"\n{args.records} records, {len(expected)} keys, {args.rounds} rounds, 1 process, 1 lane")
        print(f"{'configuration':14s} {'best rec/s':>12s} {'median rec/s':>13s} {'own CPU us (median)':>20s}")
        med = {name: statistics.median(rates[name]) for name in CONFIGS}
        cpu = {name: statistics.median(cpus[name]) for name in CONFIGS}
        for name in CONFIGS:
            print(f"{name:14s} {max(rates[name]):>12,.0f} {med[name]:>13,.0f} {cpu[name]:>20.2f}")
        print(f"transforms / plain = x{med['transforms'] / med['plain']:.2f} records/s (medians; target >= 0.8); "
              f"transforms / plain-rows = x{med['transforms'] / med['plain, rows']:.2f}")
        pairs = [t / p for t, p in zip(rates["transforms"], rates["plain"], strict=True)]
        print(f"transforms / plain, round by round: {', '.join(f'x{x:.2f}' for x in pairs)}")
        print(f"plain-wide / plain = x{med['plain, wide'] / med['plain']:.2f} (the three more columns alone); "
              f"transforms / plain-wide = x{med['transforms'] / med['plain, wide']:.2f} (the transforms alone); "
              f"own CPU transforms - plain-wide: {cpu['transforms'] - cpu['plain, wide']:.2f} us")
        same_tier = "plain" if columnar_share["transforms"] > 0.5 else "plain, rows"
        print(f"transforms took the {'columnar tier' if same_tier == 'plain' else 'row path'} "
              f"({columnar_share['transforms']:.0%} of records written by columns)")
        print(f"the transforms' own CPU per record (transforms - {same_tier}; medians): "
              f"{cpu['transforms'] - cpu[same_tier]:.2f} us  (transforms - plain: "
              f"{cpu['transforms'] - cpu['plain']:.2f} us, transforms - plain, rows: "
              f"{cpu['transforms'] - cpu['plain, rows']:.2f} us)")
    finally:
        services.close()


if __name__ == "__main__":
    main()
