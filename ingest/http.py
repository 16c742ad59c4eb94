"""The operations HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz``, ``/status`` on one port.

A small threaded ``http.server`` in a daemon thread (no framework needed):

- ``GET /metrics``  Prometheus text format of the process registry;
- ``GET /healthz``  200 while every running pipeline loop turned within
  ``stuck_after_s``, else 503 (an orchestrator restarts the container);
- ``GET /readyz``   200 when every pipeline has partitions assigned and its sink
  answered, else 503;
- ``GET /status``   200 with every pipeline's state, partitions (committed offset,
  log end, lag), dead letters by class and last error (:mod:`ingest.status`;
  the JSON is documented in the README). Always 200 while the process serves:
  the state is in the body, not the code.

Bodies of the health endpoints are small JSON documents with the details.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ingest.metrics import Metrics


def serve(metrics: Metrics, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:  # noqa: S104 - a container port
    """Start serving in a daemon thread; returns the server (call ``shutdown()`` to stop)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz"):
                ok, detail = metrics.health.live() if path == "/healthz" else metrics.health.ready()
                body = orjson.dumps({"ok": ok, "pipelines": detail})
                self._send(200 if ok else 503, body, "application/json")
            elif path == "/status":
                self._send(200, orjson.dumps(metrics.status.snapshot()), "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence access logs
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ingest-http", daemon=True).start()
    return server
