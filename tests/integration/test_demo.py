"""`ingest demo` (the README's first command, after its venv set-up) works and leaves nothing running."""

from __future__ import annotations

import uuid

import psutil
from harness import run_ingest


def _embedded_children(mark: str | None = None) -> set[int]:
    """PIDs of embedded brokers / PostgreSQL servers started from temp directories (the demo's kind);
    with ``mark``, only those whose environment carries ``INGEST_TEST_MARK=<mark>`` (inherited from the
    demo run that started them: other runs on the machine -- a bench, another suite -- start their own)."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ingest-pg-" in cmd or ("tansu" in cmd and "broker" in cmd):
            if mark is not None:
                try:
                    if proc.environ().get("INGEST_TEST_MARK") != mark:
                        continue
                except (psutil.Error, OSError):
                    continue
            found.add(proc.info["pid"])
    return found


def _marked_run(args: list[str]) -> tuple[object, str]:
    mark = uuid.uuid4().hex
    res = run_ingest(args, timeout_s=300, env={"INGEST_PG_DSN": None, "INGEST_TEST_MARK": mark})
    return res, mark


def test_demo_runs_end_to_end_and_cleans_up(tmp_path):
    res, mark = _marked_run(["demo", "--orders", "2000"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "demo OK" in res.stdout
    assert "dead-letter queue" in res.stdout and "rows in table / orders expected" in res.stdout
    assert _embedded_children(mark) == set()


def test_the_orders_items_example_runs_end_to_end(tmp_path):
    """``ingest demo --example orders-items`` runs config/orders_items.yaml's pipeline: both tables equal
    the latest good record of every order, the poison ones are dead-lettered whole."""
    res, mark = _marked_run(["demo", "--example", "orders-items", "--orders", "800"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "demo OK" in res.stdout and "order items in table / expected" in res.stdout
    assert _embedded_children(mark) == set()


def test_the_orders_items_demo_runs_the_example_file():
    """The demo's pipeline is config/orders_items.yaml's (only the addresses differ)."""
    from pathlib import Path

    import yaml

    from ingest.demo_items import EXAMPLE_FILE, items_pipeline

    root = Path(__file__).resolve().parents[2]
    example = yaml.safe_load((root / EXAMPLE_FILE).read_text())["pipelines"][0]
    demo = items_pipeline("b:9092", example["sink"]["dsn"])["pipelines"][0]
    assert demo == example
