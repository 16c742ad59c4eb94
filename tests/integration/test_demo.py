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
