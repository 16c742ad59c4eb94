"""``ingest demo``: the whole product end to end on embedded services, in one command.

1. starts an embedded Kafka-protocol broker (Tansu) and PostgreSQL (pgserver,
   or ``$INGEST_PG_DSN``),
2. produces a realistic stream of order events -- creates and updates of the
   same orders, exact duplicates, and a sprinkling of poison records (bad JSON,
   a missing id, a wrong type, an amount violating a CHECK constraint),
3. runs ``ingest migrate`` and the pipeline until idle with a live progress line,
4. prints a summary (rows, DLQ, rate, lag) and the DLQ contents, checks the
   table against the stream, and stops every service it started.
"""

from __future__ import annotations

import logging
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import yaml
from rich.console import Console
from rich.table import Table

DEMO_TOPIC = "orders.v1"
PARTITIONS = 6


def demo_config(bootstrap: str, dsn: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": "orders",
            "topics": [DEMO_TOPIC],
            "key": "$.order_id",
            "lanes": 4,
            "batch": {"max_rows": 2000, "max_latency_ms": 300},
            "commit_interval_ms": 300,
            "sink": {
                "kind": "postgres", "dsn": dsn, "table": "orders", "conflict_key": ["order_id"],
                "version_column": "kafka_offset",
                "columns": {
                    "order_id": {"type": "bigint", "source": "$.order_id", "required": True},
                    "customer": {"type": "text", "source": "$.customer"},
                    "status": {"type": "text", "source": "$.status"},
                    "amount": {"type": "numeric(12,2)", "source": "$.amount"},
                    "updated_at": {"type": "timestamptz", "source": "$.ts"},
                    "kafka_offset": {"type": "bigint", "source": "@offset"},
                },
            },
            "dlq": {"kind": "postgres", "table": "ingest_dlq"},
        }],
    }


def make_events(n_orders: int, seed: int = 7) -> tuple[list[tuple[bytes, bytes]], dict[int, dict[str, Any]], int]:
    """Events in produce order, the expected final row per order, and the poison count."""
    rng = random.Random(seed)
    statuses = ["created", "paid", "packed", "shipped", "delivered"]
    events: list[tuple[bytes, bytes]] = []
    expected: dict[int, dict[str, Any]] = {}
    poison = 0
    ts = 1_764_460_800_000
    progress = {i: 0 for i in range(1, n_orders + 1)}
    open_orders = list(progress)
    while open_orders:
        order_id = rng.choice(open_orders)
        step = progress[order_id]
        ts += rng.randint(1, 50)
        event = {"order_id": order_id, "customer": f"c{order_id % 977}", "status": statuses[step],
                 "amount": round(rng.uniform(5, 500), 2), "ts": ts}
        raw = orjson.dumps(event)
        events.append((str(order_id).encode(), raw))
        expected[order_id] = event
        if rng.random() < 0.02:
            events.append((str(order_id).encode(), raw))  # an exact duplicate (producer retry)
        progress[order_id] += 1
        if progress[order_id] == len(statuses):
            open_orders.remove(order_id)
        if rng.random() < 0.004:
            poison += 1
            kind = rng.randrange(4)
            bad = [b'{"order_id": 12, "status": "paid", ',            # truncated JSON
                   orjson.dumps({"status": "paid", "amount": 1}),     # no order_id
                   orjson.dumps({"order_id": "twelve", "amount": 1}),  # wrong type
                   orjson.dumps({"order_id": 10_000_000 + poison, "amount": -5, "status": "refund"})][kind]
            events.append((b"poison", bad))
    return events, expected, poison


def run_demo(n_orders: int = 20_000, keep: bool = False) -> int:
    """Run the demo; returns the process exit code (0 when the table matches the stream)."""
    from ingest.embedded import start_all

    console = Console()
    console.rule("[bold]ingest demo")
    with console.status("starting embedded Kafka broker and PostgreSQL..."):
        services = start_all()
    try:
        console.print(f"broker     {services.bootstrap}\npostgres   {services.pg_dsn.split('?')[0]}...")
        events, expected, poison = make_events(n_orders)
        with tempfile.TemporaryDirectory() as tmp:
            settings, pipeline_cfg = prepare(
                console, services, events, demo_config(services.bootstrap, services.pg_dsn), tmp,
                f"{len(events):,} events for {n_orders:,} orders ({poison} poison records)")
            with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
                # A business rule the stream sometimes breaks: such rows are isolated into the DLQ.
                conn.execute("ALTER TABLE orders DROP CONSTRAINT IF EXISTS amount_positive")
                conn.execute("ALTER TABLE orders ADD CONSTRAINT amount_positive CHECK (amount > 0)")
            built = _build(settings, pipeline_cfg)
            pipeline = built.pipeline
            started = time.monotonic()
            thread = threading.Thread(target=pipeline.run, name="demo-pipeline", daemon=True)
            with console.status("") as status:
                thread.start()
                while thread.is_alive():
                    s = pipeline.stats
                    status.update(f"ingesting: consumed {s.records_consumed:,} / {len(events):,}  written "
                                  f"{s.rows_written:,}  dead-lettered {s.dead_lettered_total}")
                    thread.join(0.2)
            elapsed = time.monotonic() - started
            built.close()
            lag = _committed_lag(settings, pipeline_cfg)
            return _report(console, services.pg_dsn, pipeline.stats, expected, poison, lag, elapsed)
    finally:
        if not keep:
            with console.status("stopping services..."):
                services.close()


def prepare(console: Console, services: Any, events: list[tuple[bytes, bytes]], config: dict[str, Any], tmp: str,
            what: str) -> tuple[Any, Any]:
    """Create the demo topic, produce ``events`` (``what`` says what they are), write ``config`` into
    ``tmp``, load it and migrate its pipeline: ``(settings, the pipeline's settings)``."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from ingest.config import load_settings
    from ingest.migrate import migrate_pipeline

    admin = AdminClient({"bootstrap.servers": services.bootstrap}, logger=_QUIET)
    for fut in admin.create_topics([NewTopic(DEMO_TOPIC, PARTITIONS, 1)]).values():
        fut.result()
    _produce(services.bootstrap, events)
    console.print(f"produced   {what}")
    path = Path(tmp) / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    pipeline = settings.pipelines[0]
    for line in migrate_pipeline(pipeline):
        console.print(f"migrate    {line}")
    return settings, pipeline


def _produce(bootstrap: str, events: list[tuple[bytes, bytes]]) -> None:
    """Produce the sample stream (the producer is released on return, before the broker stops)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 10,
                         "queue.buffering.max.messages": 1_000_000}, logger=_QUIET)
    for key, value in events:
        while True:
            try:
                producer.produce(DEMO_TOPIC, key=key, value=value)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(30):
        raise RuntimeError("the embedded broker did not acknowledge the sample stream")


#: librdkafka's own connection chatter is noise in a demo.
_QUIET = logging.getLogger("ingest.demo.rdkafka")
_QUIET.setLevel(logging.CRITICAL)


def _committed_lag(settings: Any, p: Any) -> int:
    """Records between the group's committed offsets and the log end (clamped at 0)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": settings.kafka.bootstrap_servers, "group.id": p.effective_group_id},
                        logger=_QUIET)
    try:
        parts = [TopicPartition(DEMO_TOPIC, i) for i in range(PARTITIONS)]
        total = 0
        for tp in consumer.committed(parts, timeout=10):
            _, high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10, cached=False)
            total += max(0, high - max(tp.offset, 0))
        return total
    finally:
        consumer.close()


def _build(settings: Any, p: Any) -> Any:
    from ingest.cli.build import build_pipeline
    from ingest.runner import RunOptions

    return build_pipeline(settings, p, stop=threading.Event(), abort=threading.Event(),
                          options=RunOptions(until_idle_s=2.0))


def _report(console: Console, dsn: str, stats: Any, expected: dict[int, dict[str, Any]], poison: int,
            lag: int, elapsed: float) -> int:
    with psycopg.connect(dsn) as conn:
        rows = {r[0]: r for r in conn.execute("SELECT order_id, status, amount FROM orders")}
        dlq_total = conn.execute("SELECT count(*) FROM ingest_dlq").fetchone()[0]
        dlq = conn.execute(
            "SELECT stage, error_class, count(*), min(error_message), min(\"partition\" || '/' || \"offset\") "
            "FROM ingest_dlq GROUP BY stage, error_class ORDER BY stage, error_class"
        ).fetchall()
    wrong = sum(1 for oid, ev in expected.items() if oid not in rows or rows[oid][1] != ev["status"])
    table = Table(title="summary", show_header=False)
    table.add_row("records consumed", f"{stats.records_consumed:,}")
    table.add_row("rows written (after in-batch dedupe)", f"{stats.rows_written:,}")
    table.add_row("rows in table / orders expected", f"{len(rows):,} / {len(expected):,}")
    table.add_row("orders with a wrong final status", str(wrong))
    table.add_row("dead-lettered / poison produced", f"{dlq_total} / {poison}")
    table.add_row("throughput", f"{stats.rate_per_s():,.0f} records/s (wall {elapsed:.1f} s incl. group join)")
    table.add_row("consumer lag after run", f"{lag} records")
    console.print(table)
    dlq_table = Table(title="dead-letter queue (ingest_dlq)")
    for col in ("stage", "error class", "records", "example (partition/offset: error)"):
        dlq_table.add_column(col, no_wrap=col != "example (partition/offset: error)")
    for stage, error_class, count, message, where in dlq:
        dlq_table.add_row(stage, error_class, str(count), f"{where}: {message[:45]}")
    console.print(dlq_table)
    ok = wrong == 0 and len(rows) == len(expected) and dlq_total == poison and lag == 0
    console.print("[bold green]demo OK[/]" if ok else "[bold red]demo found a mismatch[/]")
    return 0 if ok else 1
