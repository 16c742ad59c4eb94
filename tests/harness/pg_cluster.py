"""Throwaway PostgreSQL clusters of the test's own: a primary with a synchronous streaming replica.

:class:`ReplicatedPostgres` builds what a failover needs, with Debian's
PostgreSQL binaries, on free loopback ports, never touching the machine's shared
server:

1. ``initdb`` a primary (``wal_level=replica``, a ``host replication`` line in
   ``pg_hba.conf``, ``synchronous_standby_names`` naming the replica) and start it;
2. ``pg_basebackup -R -X stream`` into a second data directory, whose
   ``primary_conninfo`` carries ``application_name=replica1``; start it as a hot standby;
3. wait until ``pg_stat_replication.sync_state`` says ``sync``: from then on a commit the
   primary acknowledges is on the replica too.

:meth:`ReplicatedPostgres.fail_over` is the failure: ``pg_ctl -m immediate stop`` of the
primary (no shutdown checkpoint; its clients see their connections die) and
``pg_ctl promote`` of the replica. :attr:`ReplicatedPostgres.dsn` is the multi-host
DSN a client uses to find whichever one is writable
(``target_session_attrs=read-write``).

As root the clusters run as the ``postgres`` user (``initdb`` refuses root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from harness.services import ServiceError, free_port

REPLICA_NAME = "replica1"


def pg_bindir() -> Path:
    """The newest local PostgreSQL server binaries (Debian layout, or ``pg_config --bindir``)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: float(p.parts[-3]) if p.parts[-3].replace(".", "").isdigit() else 0.0)
    if found:
        return found[-1].parent
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if (Path(out) / "initdb").is_file():
            return Path(out)
    raise ServiceError("no PostgreSQL server binaries (initdb) found for a throwaway cluster")


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class ReplicatedPostgres:
    """A primary and its synchronous replica (see the module docstring). Use as a context manager."""

    def __init__(self) -> None:
        self.bindir = pg_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="ingest-pg-pair-"))
        self.primary_data, self.replica_data = self.root / "primary", self.root / "replica"
        self.primary_port, self.replica_port = free_port(), free_port()
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            import pwd

            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as_owner = ["runuser", "-u", "postgres", "--"]
        self.failed_over = False

    # -- addresses ----------------------------------------------------------------------------
    def dsn(self, dbname: str = "postgres") -> str:
        """The multi-host DSN: both servers, whichever accepts writes."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary_port},{self.replica_port} user=postgres "
                f"dbname={dbname} target_session_attrs=read-write")

    def direct(self, port: int, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{port}/{dbname}"

    @property
    def writable(self) -> str:
        """A direct DSN of the server that accepts writes now (the replica after :meth:`fail_over`)."""
        return self.direct(self.replica_port if self.failed_over else self.primary_port)

    # -- life cycle -----------------------------------------------------------------------------
    def __enter__(self) -> ReplicatedPostgres:
        try:
            self.start()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _run(self, *args: str, timeout_s: float = 90.0) -> str:
        res = subprocess.run([*self._as_owner, *args], capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            raise ServiceError(f"{Path(args[0]).name} failed ({res.returncode}): {res.stdout}{res.stderr}\n"
                               f"--- primary log ---\n{_tail(self.root / 'primary.log')}\n"
                               f"--- replica log ---\n{_tail(self.root / 'replica.log')}")
        return res.stdout

    def _pg_ctl(self, data: Path, log: str, *args: str) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(data), "-l", str(self.root / log), "-w", *args)

    def _options(self, port: int) -> str:
        return f"-h 127.0.0.1 -p {port} -k {self.root} -c max_connections=60"

    def start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.primary_data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-locale", "--no-sync")
        with open(self.primary_data / "postgresql.conf", "a") as conf:
            conf.write("\nwal_level = replica\nmax_wal_senders = 5\nwal_keep_size = '64MB'\n"
                       f"synchronous_standby_names = '{REPLICA_NAME}'\nsynchronous_commit = on\n")
        with open(self.primary_data / "pg_hba.conf", "a") as hba:
            hba.write("\nhost replication postgres 127.0.0.1/32 trust\n")
        self._pg_ctl(self.primary_data, "primary.log", "-o", self._options(self.primary_port), "start")
        self._run(str(self.bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.primary_port),
                  "-U", "postgres", "-D", str(self.replica_data), "-R", "-X", "stream",
                  "-d", f"application_name={REPLICA_NAME}")
        # The base backup copied the primary's postgresql.conf: once promoted, the replica would wait
        # for a synchronous standby of its own (there is none) and every commit would hang.
        with open(self.replica_data / "postgresql.auto.conf", "a") as conf:
            conf.write("\nsynchronous_standby_names = ''\n")
        self._pg_ctl(self.replica_data, "replica.log", "-o", self._options(self.replica_port), "start")
        self._wait_sync()

    def _wait_sync(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            with psycopg.connect(self.direct(self.primary_port), autocommit=True) as conn:
                row = conn.execute("SELECT sync_state FROM pg_stat_replication WHERE application_name = %s",
                                   (REPLICA_NAME,)).fetchone()
            state = row[0] if row else None
            if state == "sync":
                return
            time.sleep(0.1)
        raise ServiceError(f"the replica is not synchronous after {timeout_s}s (sync_state {state!r})\n"
                           f"{_tail(self.root / 'replica.log')}")

    def create_database(self, name: str) -> None:
        from psycopg import sql

        with psycopg.connect(self.writable, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def fail_over(self) -> float:
        """Kill the primary (immediate stop) and promote the replica; returns the seconds it took."""
        t0 = time.monotonic()
        self._pg_ctl(self.primary_data, "primary.log", "-m", "immediate", "stop")
        self._pg_ctl(self.replica_data, "replica.log", "promote")
        self.failed_over = True
        return time.monotonic() - t0

    def remove(self) -> None:
        for data in (self.primary_data, self.replica_data):
            if (data / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    self._run(str(self.bindir / "pg_ctl"), "-D", str(data), "-w", "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
