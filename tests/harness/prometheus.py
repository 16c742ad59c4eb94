"""A real Prometheus server (Debian's ``prometheus`` package) on a free loopback port, for one test.

``start_prometheus(targets, rule_files, tmp_dir)`` writes a config that scrapes ``targets`` every
second as job ``ingest`` and loads ``rule_files``, starts
``prometheus --config.file=… --storage.tsdb.path=<tmp> --web.listen-address=127.0.0.1:<port>``
and waits for ``/-/ready``. Only loopback traffic. The binary missing or not starting raises
:class:`~harness.services.ServiceError` (the test fails; it is never skipped).
:class:`PrometheusServer` queries its HTTP API (``/api/v1/query``, ``query_range``, ``rules``,
``targets``) with the standard library only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from harness.services import ServiceError, _tail, die_with_parent, free_port, stop_process

START_TIMEOUT_S = 30.0


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if path is None:
        raise ServiceError("prometheus unavailable: install Debian's prometheus package (bash scripts/test.sh does)")
    return path


class PrometheusServer:
    """One running Prometheus; :meth:`stop` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        """GET ``/api/v1/<path>``; returns the decoded body (``status`` "success" or "error")."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400 / 422: a bad expression; the body says why
            return json.loads(exc.read())

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        return self.api("query", query=expr, time=at)

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> dict[str, Any]:
        return self.api("query_range", query=expr, start=start, end=end, step=step_s)

    def describe(self) -> str:
        return f"prometheus on {self.url} (pid {self.proc.pid}), log {self.log}:\n{_tail(self.log)}"

    def stop(self) -> None:
        stop_process(self.proc, 10)


def start_prometheus(targets: Sequence[str], rule_files: Sequence[Path], tmp_dir: Path, *,
                     interval_s: int = 1) -> PrometheusServer:
    """Scrape ``targets`` ("host:port") as job ``ingest`` every ``interval_s`` with ``rule_files``."""
    binary = prometheus_binary()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s",
                   "scrape_timeout": f"{interval_s}s"},
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": [{"job_name": "ingest", "static_configs": [{"targets": list(targets)}]}],
    }
    config_path = tmp_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = tmp_dir / "prometheus.log"
    for _ in range(3):  # a free port can be taken between the probe and the bind
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        server = PrometheusServer(proc, port, log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return server
            except OSError:
                pass
            time.sleep(0.1)
        server.stop()
        if "address already in use" not in log.read_text(errors="replace"):
            break
    raise ServiceError(f"prometheus did not become ready within {START_TIMEOUT_S}s\n{_tail(log)}")
