"""PostgreSQL driver glue shared by the sink and the DLQ table: the one place psycopg errors become ours.

:func:`translate` is the translation point (like httpx's
``map_httpcore_exceptions``): every adapter call that talks to PostgreSQL runs
inside it, and leaves it raising only :class:`~ingest.errors.TransientError`,
:class:`~ingest.errors.PermanentError` or :class:`~ingest.errors.UnclassifiedError`.

The classification asks of every error: *can a good record cause this?*

- **Permanent** (the row's own fault: split the batch, dead-letter the rows that
  fail alone) -- only where a row's values can be the cause:
  class 22 data exception (value too long, bad text representation, numeric out
  of range, ...), class 23 integrity constraint violation (not null, foreign key,
  unique, check, exclusion), 40002 (a deferred constraint failing at commit),
  class 54 program limit exceeded (e.g. an index row too large for its value;
  54011 too many columns is the table's, not the row's), class 27 triggered data
  change violation, 44 WITH CHECK OPTION violation, and errors a trigger or
  function raises for a row (P0 PL/pgSQL raise/assert, 20 case not found, 21
  cardinality, 2F, 38, 39 routine exceptions); and 42501 when its message says
  *new row violates row-level security policy* (the row is outside the policy).
  Values the client cannot send (no SQLSTATE: ``psycopg.DataError``,
  ``ValueError`` ...) are the row's too (``client_data_error``).
- **Transient** (an outage: retry with backoff, then stop without committing;
  never dead-letter) -- everything else with a SQLSTATE: the connection (08),
  a read-only transaction during a failover (25006) and any invalid transaction
  state (25), authorization (28) and a revoked privilege (42501 *permission
  denied*), a missing database, schema, table or column and every other class 42
  error (the schema is not what the config says: no record can fix that),
  serialization failures and deadlocks (40), insufficient resources (53), locks
  and objects in use (55), operator intervention and statement timeouts (57),
  system and internal errors (58, XX), and any class not listed here. A
  pipeline whose every record would fail this way stops with the server's
  message instead of emptying its topic into the DLQ.
- **Unclassified** (stop the pipeline without committing, neither retried nor
  bisected): an error psycopg raises *without* SQLSTATE on a connection that is
  still healthy (e.g. "number of parameters must be between 0 and 65535"):
  retrying the same statement cannot help, and bisecting it would dead-letter
  good rows one by one. The same without SQLSTATE on a broken connection is the
  connection failing: transient.

Some transient errors condemn the *session*, not the statement: a read-only
transaction (25006) means the server behind this connection is a replica now
(a failover) or the session was made read-only, and it stays so for the
connection's life. :func:`pooled` closes such a connection, so the pool
replaces it and the retry reaches the new primary instead of the old one.

A connection that goes *silent* (no reset, no answer: a dropped NAT flow, a
half-open socket after a peer's crash) is caught on the client, because the
server-side ``statement_timeout`` cannot fire when the server is unreachable:
every connection ingest opens is a :func:`connection_class` whose waits on the
network are bounded (``network.client_timeout_ms``), and is opened with TCP
keepalives, ``tcp_user_timeout`` and ``connect_timeout``
(:class:`~ingest.config.base.PgNetworkSettings`). A wait past its bound closes
the connection without waiting on it and raises a transient error, so the
caller's retry runs on a new connection.

Messages carry the server's diagnostic text (it names columns and constraints,
never credentials) and never a DSN.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql
from psycopg.errors import _WaitTimeout
from psycopg_pool import ConnectionPool, PoolTimeout

from ingest.config.base import PgNetworkSettings
from ingest.errors import (
    MigrationError,
    PermanentError,
    ServiceUnreachable,
    TransientError,
    UnclassifiedError,
)

#: DDL of the fixed tables (``{placeholder}`` names filled only with sql.Identifier).
SQL_DIR = Path(__file__).resolve().parents[1] / "sql"

#: SQLSTATE classes whose errors a row's values can cause (see the module docstring).
PERMANENT_CLASSES: frozenset[str] = frozenset({"20", "21", "22", "23", "27", "2F", "38", "39", "44", "54", "P0"})
#: Codes decided against their class.
PERMANENT_CODES: frozenset[str] = frozenset({"40002"})
TRANSIENT_CODES: frozenset[str] = frozenset({"54011"})
#: SQLSTATEs after which a connection is closed rather than reused (see the module docstring).
STALE_SESSION_CODES: frozenset[str] = frozenset({"25006"})
#: 42501 is insufficient_privilege: an outage, unless a row-level security policy rejected this row.
_RLS_PREFIX = "new row violates row-level security policy"

#: Human names for the error class recorded in the DLQ, by SQLSTATE class.
_CLASS_NAMES: dict[str, str] = {
    "22": "data_exception",
    "23": "integrity_constraint_violation",
    "42": "row_level_security_violation",
    "54": "program_limit_exceeded",
    "P0": "raised_by_trigger",
}


def is_row_error(sqlstate: str, message: str = "") -> bool:
    """True when an error with this SQLSTATE (and server message) can be caused by one row's values."""
    if sqlstate in TRANSIENT_CODES:
        return False
    if sqlstate in PERMANENT_CODES or sqlstate[:2] in PERMANENT_CLASSES:
        return True
    return sqlstate == "42501" and message.startswith(_RLS_PREFIX)


def classify(exc: BaseException, *, healthy: bool = False) -> TransientError | PermanentError | UnclassifiedError:
    """Translate a driver error into our tree (see the module docstring).

    ``healthy``: the connection the error came from is still usable (not closed, not broken);
    decides what an error without SQLSTATE means.
    """
    if isinstance(exc, PoolTimeout):
        return TransientError(f"no database connection available: {_first_line(str(exc))}", error_class="pool_timeout")
    if isinstance(exc, psycopg.Error):
        sqlstate = getattr(exc, "sqlstate", None)
        diag_msg = getattr(getattr(exc, "diag", None), "message_primary", None)
        message = diag_msg or _first_line(str(exc))
        if sqlstate is None:
            if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
                if healthy:
                    return UnclassifiedError(f"the database client failed without SQLSTATE on a healthy "
                                             f"connection: {message}")
                return TransientError(f"connection: {message}", error_class="connection")
            # Raised client-side while adapting a value (e.g. a number too big for its type).
            return PermanentError(message, error_class="client_data_error")
        if not is_row_error(sqlstate, message):
            return TransientError(message, sqlstate=sqlstate, error_class=type(exc).__name__)
        detail = getattr(getattr(exc, "diag", None), "message_detail", None)
        if detail:
            message = f"{message} ({detail})"
        return PermanentError(message, sqlstate=sqlstate, error_class=_CLASS_NAMES.get(sqlstate[:2], "database_error"))
    if isinstance(exc, (OSError, TimeoutError)):
        return TransientError(f"{type(exc).__name__}: {_first_line(str(exc))}", error_class="connection")
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return PermanentError(f"cannot send value: {type(exc).__name__}: {_first_line(str(exc))}",
                              error_class="client_data_error")
    return PermanentError(f"{type(exc).__name__}: {_first_line(str(exc))}", error_class="client_error")


class StalledConnection(psycopg.OperationalError):
    """The server sent nothing within the client-side bound: the connection was closed unwaited."""


class BoundedConnection(psycopg.Connection):  # type: ignore[type-arg]
    """A psycopg connection whose every wait on the network lasts at most :attr:`io_timeout_s`.

    ``Connection.wait`` is where psycopg blocks for the server (statements, COPY pieces,
    commits, health checks). A wait past the bound closes the connection at once (no goodbye
    to a server that cannot hear it) and raises :class:`StalledConnection`, which
    :func:`classify` makes transient. Subclasses made by :func:`connection_class` set the bound.
    """

    #: seconds; None: unbounded (psycopg's own behaviour)
    io_timeout_s: float | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        bound = self.io_timeout_s
        if bound is None or (timeout is not None and timeout <= bound):
            return super().wait(gen, interval=interval, timeout=timeout)
        try:
            return super().wait(gen, interval=interval, timeout=bound)
        except _WaitTimeout:
            self.close()
            raise StalledConnection(
                f"PostgreSQL sent nothing for {bound:g} s (network.client_timeout_ms): "
                "the connection was dropped") from None


@functools.cache
def connection_class(io_timeout_s: float | None) -> type[BoundedConnection]:
    """The connection class whose waits are bounded by ``io_timeout_s`` (cached per bound)."""
    return type(f"BoundedConnection_{io_timeout_s}", (BoundedConnection,), {"io_timeout_s": io_timeout_s})


def network_params(dsn: str, network: PgNetworkSettings) -> dict[str, Any]:
    """libpq parameters of ``network`` that ``dsn`` does not set itself (the DSN wins)."""
    given = conninfo.conninfo_to_dict(dsn)
    return {k: v for k, v in network.libpq_params().items() if k not in given}


def connect(dsn: str, network: PgNetworkSettings, *, statement_timeout_ms: int = 0,
            **kwargs: Any) -> BoundedConnection:
    """A new bounded connection (see the module docstring); psycopg errors pass through unchanged."""
    cls = connection_class(network.client_timeout_s(statement_timeout_ms))
    return cls.connect(dsn, **{**network_params(dsn, network), **kwargs})


def make_pool(dsn: str, network: PgNetworkSettings, *, statement_timeout_ms: int, **kwargs: Any) -> ConnectionPool:
    """A connection pool of bounded connections opened with ``network``'s libpq parameters."""
    return ConnectionPool(
        dsn, connection_class=connection_class(network.client_timeout_s(statement_timeout_ms)),
        kwargs=network_params(dsn, network), **kwargs)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def healthy(conn: psycopg.Connection[Any] | None) -> bool:
    """The connection is still usable after an error (psycopg marks a broken one)."""
    return conn is not None and not conn.closed and not conn.broken


@contextlib.contextmanager
def pooled(pool: ConnectionPool) -> Iterator[psycopg.Connection[Any]]:
    """A connection from ``pool``; closed on the way back (the pool then opens a new one) after an error
    in :data:`STALE_SESSION_CODES`. Errors pass through unchanged."""
    with pool.connection() as conn:
        try:
            yield conn
        except psycopg.Error as exc:
            if getattr(exc, "sqlstate", None) in STALE_SESSION_CODES and not conn.closed:
                conn.close()
            raise


@dataclass
class Translation:
    """What :func:`translate` knows about the call: the connection in use, once there is one."""

    conn: psycopg.Connection[Any] | None = None


@contextlib.contextmanager
def translate(conn: psycopg.Connection[Any] | None = None) -> Iterator[Translation]:
    """Run a PostgreSQL call; any driver error leaves as Transient/Permanent/UnclassifiedError.

    Pass the connection, or set ``.conn`` on the yielded :class:`Translation` once a pooled one is
    checked out, so an error without SQLSTATE can be judged by the connection's health.
    """
    t = Translation(conn)
    try:
        yield t
    except (TransientError, PermanentError, UnclassifiedError):
        raise
    except (psycopg.Error, PoolTimeout, OSError, TimeoutError, ValueError, TypeError, OverflowError) as exc:
        raise classify(exc, healthy=healthy(t.conn)) from exc


def check_dsn(dsn: str, what: str, network: PgNetworkSettings | None = None) -> None:
    """Connect to ``dsn`` and run ``SELECT 1``; raise ServiceUnreachable naming ``what`` (never the DSN)."""
    try:
        with connect(dsn, network or PgNetworkSettings(), connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise ServiceUnreachable(what, str(classify(exc))) from None


def load_sql(name: str, **identifiers: str | tuple[str, ...]) -> sql.Composed:
    """Read ``ingest/sql/<name>`` and fill its placeholders with quoted identifiers."""
    text = (SQL_DIR / name).read_text(encoding="utf-8")
    args = {k: sql.Identifier(*v) if isinstance(v, tuple) else sql.Identifier(v) for k, v in identifiers.items()}
    return sql.SQL(text).format(**args)


def execute_ddl(dsn: str, what: str, statements: Sequence[sql.Composable],
                network: PgNetworkSettings | None = None) -> None:
    """Run DDL statements in autocommit. Raises ServiceUnreachable (cannot connect) or MigrationError.

    DDL waits are not bounded on the client (an ALTER of a large table may rightly take long);
    keepalives and ``tcp_user_timeout`` still catch a dead peer."""
    network = (network or PgNetworkSettings()).model_copy(update={"client_timeout_ms": 0})
    try:
        with connect(dsn, network, autocommit=True) as conn:
            for stmt in statements:
                conn.execute(stmt)
    except psycopg.OperationalError as exc:
        if getattr(exc, "sqlstate", None) is None or str(exc.sqlstate).startswith("08"):
            raise ServiceUnreachable(what, str(classify(exc))) from None
        raise MigrationError(f"{what}: {classify(exc)}") from None
    except psycopg.Error as exc:
        raise MigrationError(f"{what}: the database rejected the DDL: {classify(exc)}") from None
