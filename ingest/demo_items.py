"""``ingest demo --example orders-items``: orders with their line items, exploded into two tables.

Runs ``config/orders_items.yaml``'s pipeline (the same steps and columns: :func:`items_pipeline`,
kept equal to the file by a test) on embedded services: a stream of orders updated many times --
items added, changed and removed, some orders emptied -- with a few poison records (an item
without a sku, a quantity that is not a number), then checks that ``orders`` and ``order_items``
equal the latest good record of every order, with no orphan item and no stale one, and that every
poison record is in the DLQ.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from typing import Any

import orjson
import psycopg
from rich.console import Console
from rich.table import Table

from ingest.demo import DEMO_TOPIC, _build, _committed_lag, prepare

EXAMPLE_FILE = "config/orders_items.yaml"


def items_pipeline(bootstrap: str, dsn: str) -> dict[str, Any]:
    """The configuration of ``config/orders_items.yaml`` with the embedded services' addresses."""
    return {
        "kafka": {"bootstrap_servers": bootstrap, "client": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}},
        "pipelines": [{
            "name": "orders-with-items", "topics": [DEMO_TOPIC], "format": "json", "key": "$.id",
            "transforms": [
                {"set": {"item_count": "size(value.items)"}},
                {"timestamp": {"field": "created_ms", "format": "epoch_ms", "into": "created_at"}},
                {"explode": {"path": "items", "table": "order_items", "conflict_key": ["order_id", "line_no"],
                             "parent": {"order_id": "value.id"}, "index_as": "line_no", "index_start": 1,
                             "replace": True,
                             "columns": {"order_id": {"type": "bigint"}, "line_no": {"type": "integer"},
                                         "sku": {"type": "text", "required": True},
                                         "qty": {"type": "integer", "required": True},
                                         "price": {"type": "numeric(12,2)"}}},
                 "name": "items"},
            ],
            "sink": {"kind": "postgres", "dsn": dsn, "table": "orders", "conflict_key": ["id"],
                     "columns": {"id": {"type": "bigint", "required": True}, "customer": {"type": "text"},
                                 "total": {"type": "numeric(12,2)"}, "item_count": {"type": "integer"},
                                 "created_at": {"type": "timestamptz"}}},
            "dlq": {"kind": "postgres", "table": "ingest_dlq"},
        }],
    }


def make_orders(n_orders: int, seed: int = 11) -> tuple[list[tuple[bytes, bytes]], dict[int, list[tuple]], int]:
    """Events in produce order, each order's expected items (line, sku, qty) after its last good
    record, and how many poison records there are."""
    rng = random.Random(seed)
    events: list[tuple[bytes, bytes]] = []
    expected: dict[int, list[tuple]] = {}
    poison = 0
    ms = 1_764_928_800_000
    for _ in range(n_orders * 4):
        order_id = rng.randrange(1, n_orders + 1)
        items = [{"sku": f"SKU-{rng.randrange(40)}", "qty": rng.randrange(1, 6), "price": f"{rng.randrange(1, 90)}.50"}
                 for _ in range(rng.choice((0, 1, 2, 2, 3, 4)))]
        ms += rng.randrange(1, 40)
        doc = {"id": order_id, "customer": f"c-{order_id % 97}", "created_ms": ms, "items": items,
               "total": f"{sum(int(i['price'].split('.')[0]) for i in items)}.00"}
        if items and rng.random() < 0.01:
            poison += 1
            items[-1] = {"qty": 1} if rng.random() < 0.5 else {"sku": "SKU-1", "qty": "two"}
        else:
            expected[order_id] = [(n + 1, i["sku"], i["qty"]) for n, i in enumerate(items)]
        events.append((str(order_id).encode(), orjson.dumps(doc)))
    return events, expected, poison


def run_items_demo(n_orders: int = 5_000) -> int:
    """Run the example; returns the exit code (0 when both tables match the stream)."""
    from ingest.embedded import start_all

    console = Console()
    console.rule("[bold]ingest demo: orders with items (config/orders_items.yaml)")
    with console.status("starting embedded Kafka broker and PostgreSQL..."):
        services = start_all()
    try:
        events, expected, poison = make_orders(n_orders)
        with tempfile.TemporaryDirectory() as tmp:
            settings, p = prepare(console, services, events, items_pipeline(services.bootstrap, services.pg_dsn), tmp,
                                  f"{len(events):,} order records ({poison} poison)")
            built = _build(settings, p)
            started = time.monotonic()
            thread = threading.Thread(target=built.pipeline.run, name="demo-pipeline", daemon=True)
            thread.start()
            thread.join()
            elapsed = time.monotonic() - started
            built.close()
            lag = _committed_lag(settings, p)
            return _report(console, services.pg_dsn, built.pipeline.stats, expected, poison, lag, elapsed)
    finally:
        with console.status("stopping services..."):
            services.close()


def _report(console: Console, dsn: str, stats: Any, expected: dict[int, list[tuple]], poison: int, lag: int,
            elapsed: float) -> int:
    with psycopg.connect(dsn) as conn:
        orders = {r[0] for r in conn.execute("SELECT id FROM orders")}
        got: dict[int, list[tuple]] = {}
        for order_id, line, sku, qty in conn.execute("SELECT order_id, line_no, sku, qty FROM order_items ORDER BY 1, 2"):
            got.setdefault(order_id, []).append((line, sku, qty))
        dlq = conn.execute("SELECT count(*) FROM ingest_dlq WHERE stage = 'transform'").fetchone()[0]
    want = {k: v for k, v in expected.items() if v}
    wrong = sum(1 for k in set(got) | set(want) if got.get(k) != want.get(k))
    table = Table(title="summary", show_header=False)
    table.add_row("records consumed", f"{stats.records_consumed:,}")
    table.add_row("orders in table / expected", f"{len(orders):,} / {len(expected):,}")
    table.add_row("order items in table / expected", f"{sum(map(len, got.values())):,} / "
                                                     f"{sum(map(len, want.values())):,}")
    table.add_row("orders whose items differ from the latest record", str(wrong))
    table.add_row("dead-lettered whole (transform) / poison produced", f"{dlq} / {poison}")
    table.add_row("wall time", f"{elapsed:.1f} s incl. group join")
    table.add_row("consumer lag after run", f"{lag} records")
    console.print(table)
    ok = wrong == 0 and orders == set(expected) and dlq == poison and lag == 0
    console.print("[bold green]demo OK[/]" if ok else "[bold red]demo found a mismatch[/]")
    return 0 if ok else 1
