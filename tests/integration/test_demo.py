"""`ingest demo` (the README's first command, after its venv set-up) works and leaves nothing running."""

from __future__ import annotations

import psutil
from harness import run_ingest


def _embedded_children() -> set[int]:
    """PIDs of embedded brokers / PostgreSQL servers started from temp directories (the demo's kind)."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ingest-pg-" in cmd or ("tansu" in cmd and "broker" in cmd):
            found.add(proc.info["pid"])
    return found


def test_demo_runs_end_to_end_and_cleans_up(tmp_path):
    before = _embedded_children()
    res = run_ingest(["demo", "--orders", "2000"], timeout_s=300, env={"INGEST_PG_DSN": None})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "demo OK" in res.stdout
    assert "dead-letter queue" in res.stdout and "rows in table / orders expected" in res.stdout
    assert _embedded_children() - before == set()


def test_the_orders_items_example_runs_end_to_end(tmp_path):
    """``ingest demo --example orders-items`` runs config/orders_items.yaml's pipeline: both tables equal
    the latest good record of every order, the poison ones are dead-lettered whole."""
    before = _embedded_children()
    res = run_ingest(["demo", "--example", "orders-items", "--orders", "800"], timeout_s=300,
                     env={"INGEST_PG_DSN": None})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "demo OK" in res.stdout and "order items in table / expected" in res.stdout
    assert _embedded_children() - before == set()


def test_the_orders_items_demo_runs_the_example_file():
    """The demo's pipeline is config/orders_items.yaml's (only the addresses differ)."""
    from pathlib import Path

    import yaml

    from ingest.demo_items import EXAMPLE_FILE, items_pipeline

    root = Path(__file__).resolve().parents[2]
    example = yaml.safe_load((root / EXAMPLE_FILE).read_text())["pipelines"][0]
    demo = items_pipeline("b:9092", example["sink"]["dsn"])["pipelines"][0]
    assert demo == example
