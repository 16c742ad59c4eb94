"""Shared by the format tests (test_formats_*.py): a one-pipeline config of a registry format, and
``ingest migrate`` + ``ingest run --until-idle`` as subprocesses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import run_ingest, write_config
from harness.kafka import TEST_CONSUMER_SETTINGS


def format_config(*, bootstrap: str, topic: str, group: str, fmt: str, sink: dict[str, Any],
                  registry: str | None, name: str = "fmt", dlq: dict[str, Any] | None = None,
                  **pipeline: Any) -> dict[str, Any]:
    """One pipeline ``name`` reading ``topic`` in format ``fmt`` into ``sink`` (small batches, fast commits)."""
    cfg: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "client": dict(TEST_CONSUMER_SETTINGS)},
        "pipelines": [{
            "name": name, "topics": [topic], "group_id": group, "format": fmt, "commit_interval_ms": 200,
            "batch": {"max_rows": 500, "max_latency_ms": 100}, "sink": sink, **({"dlq": dlq} if dlq else {}),
            **pipeline,
        }],
    }
    if registry is not None:
        cfg["schema_registry"] = {"url": registry}
    return cfg


def migrate(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    """Write ``cfg`` and run ``ingest migrate`` (must exit 0); the config's path."""
    path = write_config(tmp_path, cfg)
    res = run_ingest(["migrate", "-c", path], timeout_s=60, log_dir=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return path


def run_until_idle(path: Path, tmp_path: Path, *, expect: int = 0, timeout_s: float = 120) -> Any:
    """``ingest run --until-idle 2``; asserts its exit status and returns the completed process."""
    res = run_ingest(["run", "-c", path, "--until-idle", "2", "--metrics-port", "0"], timeout_s=timeout_s,
                     log_dir=tmp_path)
    assert res.returncode == expect, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res
